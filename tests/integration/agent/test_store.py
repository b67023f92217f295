"""The standalone rendezvous store: answers pings, is bound to the given address, and is
restarted within seconds when it dies or freezes."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from agent_cluster import free_port
from support.waiting import wait_for

from slurmft.agent.store import StoreSupervisor, ping_store

pytestmark = [pytest.mark.torch, pytest.mark.serial]  # a frozen store is found by ping timeouts


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


def test_store_is_supervised_through_death_and_freeze() -> None:
    port = free_port()
    # The default ping timeout (2 s): a healthy store slowed by a loaded machine past a shorter
    # one would be restarted too, and the counts below would skip.
    supervisor = StoreSupervisor("127.0.0.1", port, python=sys.executable, interval_s=0.5).start()
    try:
        assert ping_store("127.0.0.1", port) < 1.0
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, not every interface
        first = supervisor.process
        assert first is not None
        os.kill(first.pid, signal.SIGSTOP)  # frozen: accepts connections, answers nothing
        wait_for(lambda: supervisor.stats.restarts == 1 and supervisor.healthy(), 20,
                 "a frozen store to be replaced")
        second = supervisor.process
        assert second is not None and second.pid != first.pid
        os.kill(second.pid, signal.SIGKILL)
        wait_for(lambda: supervisor.stats.restarts == 2 and supervisor.healthy(), 20,
                 "a dead store to be replaced")
    finally:
        supervisor.stop()
    assert supervisor.process is not None and supervisor.process.poll() is not None
