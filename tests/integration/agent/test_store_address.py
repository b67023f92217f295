"""The rendezvous store is unauthenticated (torch's TCPStore, pickled values), so it listens on
the job's address only, never on every interface (issue 14 item 13; the site requirement is in
docs/install.md, "Security model"). Started as the batch step starts it: the address `slurmft agent
batch` picks (its --store-host, else the node's host name's address) and a free port on it."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from slurmft.agent.batch import BatchSpec
from slurmft.agent.batch_step import BatchStep, store_address
from slurmft.agent.store import StoreSupervisor, check_store_host, ping_store
from slurmft.core.exits import BatchExit

SPEC = BatchSpec(run_id="r1", nodes=1, spares=0, script=("t.py",), ckpt_dir="", store_port=0)
WILDCARDS = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and ::, as /proc says


def listening(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp{,6}) that listen on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


def proc_hex(ipv4: str) -> str:
    return socket.inet_aton(ipv4)[::-1].hex().upper()  # /proc/net/tcp: host byte order


def _job_addresses() -> list[str]:
    """The batch step's default, and this host's address on its outward network (a job network
    stand-in that is not loopback) where it has one."""
    found = [store_address()]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            found.append(probe.getsockname()[0])
        except OSError:
            pass
    return sorted(set(found))


class StoreOnly(BatchStep):
    """The batch step up to its loop: what listens while its store is up."""

    seen: set[str]

    def _loop(self) -> BatchExit:
        assert ping_store(self.store_host, self.spec.store_port) < 5.0
        self.seen = listening(self.spec.store_port)
        return BatchExit.FINISHED


@pytest.mark.torch
@pytest.mark.parametrize("host", _job_addresses())
def test_the_batch_steps_store_listens_on_the_jobs_address_only(host: str, tmp_path: Path) -> None:
    """Holds on the parent commit too: the store binds its own listening socket to the host
    and hands it to TCPStore (which alone would listen on every interface)."""
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path))
    step = StoreOnly(spec, client=None, job_id="7", store_host=host)  # type: ignore[arg-type]
    assert step.run() is BatchExit.FINISHED
    assert step.spec.store_port != 0  # a free port was taken on that address
    assert step.seen == {proc_hex(host)}
    assert not step.seen & WILDCARDS


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "0"])
def test_the_store_refuses_every_interfaces_address(host: str) -> None:
    with pytest.raises(ValueError, match="every"):
        check_store_host(host)
    with pytest.raises(ValueError, match="every"):
        StoreSupervisor(host, 29400)
    with pytest.raises(ValueError, match="every"):
        store_address(host or "0.0.0.0")
