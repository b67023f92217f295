"""The URL the daemon hands to agents: which setting chooses it, and which URLs are refused."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import pytest
from support.slurm_recordings import load_recording

from slurmft.controller.agents_url import (
    AgentsUrl,
    choose_agents_url,
    is_local_address,
    is_loopback_host,
    unreachable_because,
)
from slurmft.slurm.parse import parse_scontrol_records

REPO = Path(__file__).resolve().parents[3]
SHIPPED = tomllib.loads((REPO / "systemd" / "slurmft.toml").read_text())


def _fqdn() -> str:
    return "login1.cluster"


def _check(url: AgentsUrl, nodes: dict[str, str] | None) -> str | None:
    return unreachable_because(
        url,
        nodes,
        is_local=lambda addr: addr in {"127.0.0.1", "localhost", "10.0.0.1"},
        is_loopback=lambda host: host in {"127.0.0.1", "localhost", "::1"},
    )


def test_the_shipped_config_hands_out_its_agent_controller_url_not_the_wildcard_bind() -> None:
    daemon, agent = SHIPPED["daemon"], SHIPPED["agent"]
    assert daemon["ingest_listen"].startswith("0.0.0.0:") and "agents_url" not in daemon
    chosen = choose_agents_url("", agent["controller_url"], "http://0.0.0.0:8787", fqdn=_fqdn)
    assert chosen == AgentsUrl("http://login1.cluster:8787", "agent.controller_url")
    assert _check(chosen, {"n1": "10.1.0.5"}) is None


def test_daemon_agents_url_comes_first() -> None:
    chosen = choose_agents_url("https://ingest.site:8443/", "http://x:1", "http://0.0.0.0:8787")
    assert chosen == AgentsUrl("https://ingest.site:8443", "daemon.agents_url")


def test_a_wildcard_bind_with_nothing_set_is_named_by_the_hosts_fully_qualified_name() -> None:
    chosen = choose_agents_url("", "", "http://0.0.0.0:8787", fqdn=_fqdn)
    assert chosen.url == "http://login1.cluster:8787" and "login1.cluster" in chosen.source
    assert choose_agents_url("", "", "https://[::]:8443", fqdn=_fqdn).url == (
        "https://login1.cluster:8443"
    )


def test_a_bound_address_is_handed_out_as_it_is() -> None:
    chosen = choose_agents_url("", "", "http://10.0.0.1:8787", fqdn=_fqdn)
    assert chosen == AgentsUrl("http://10.0.0.1:8787", "daemon.ingest_listen")


def test_a_url_that_names_no_host_is_refused_with_the_setting_to_set() -> None:
    refusal = _check(AgentsUrl("http://0.0.0.0:8787", "agent.controller_url"), {})
    assert refusal is not None
    assert "names no host" in refusal and "set daemon.agents_url" in refusal


def test_loopback_is_refused_when_a_node_is_another_host() -> None:
    url = AgentsUrl("http://127.0.0.1:8787", "daemon.ingest_listen")
    refusal = _check(url, {"n1": "127.0.0.1", "n2": "10.1.0.7", "n3": "10.1.0.8"})
    assert refusal is not None
    assert "node n2 (NodeAddr 10.1.0.7) and 1 more are other hosts" in refusal
    assert "daemon.agents_url" in refusal and "daemon.ingest_listen" in refusal


def test_loopback_is_kept_when_every_node_is_this_host_or_slurm_cannot_say() -> None:
    """The demo and the test clusters: every node's NodeAddr is 127.0.0.1 (recorded)."""
    records = parse_scontrol_records(load_recording("show_nodes").stdout)
    recorded = {r["NodeName"]: r["NodeAddr"] for r in records}
    assert recorded and set(recorded.values()) == {"127.0.0.1"}
    url = AgentsUrl("http://127.0.0.1:8787", "daemon.ingest_listen")
    assert _check(url, recorded) is None
    assert _check(url, None) is None  # Slurm down at start: the daemon warns, it does not refuse


def test_locality_and_loopback_on_this_machine() -> None:
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never an address of this machine
    assert not is_local_address("no-such-host.invalid")
    assert is_loopback_host("localhost") and is_loopback_host("::1")
    assert not is_loopback_host("192.0.2.1") and not is_loopback_host("no-such-host.invalid")


def test_an_address_of_a_local_interface_is_local() -> None:
    """An address this machine holds besides loopback (its own hostname's, when it resolves to
    one that is not loopback)."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        pytest.skip("this machine's name does not resolve")
    assert is_local_address(address)
