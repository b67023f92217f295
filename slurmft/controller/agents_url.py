"""Where agents on the compute nodes report: the URL the daemon hands to every new run.

Chosen in this order:
1. `daemon.agents_url`;
2. `agent.controller_url` from the same configuration: what agents that read the file use (the
   shipped `systemd/slurmft.toml` sets it to the login node's name);
3. the ingest endpoint as bound, a wildcard bind (`0.0.0.0`, `::`) named by this host's fully
   qualified name.

Refused before the daemon serves anything, with the setting to set: an address that names no
host (each agent would post to its own node), and a loopback address while some node of the
cluster is another host (its `NodeAddr` is not an address of this machine). The demo, whose
nodes all have `NodeAddr=127.0.0.1`, keeps its loopback URL.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})
TO_SET = "set daemon.agents_url to a URL the compute nodes reach, e.g. http://login1.cluster:8787"


@dataclass(frozen=True)
class AgentsUrl:
    url: str
    source: str  # the setting or the rule that chose it, for the log and the refusal


def choose_agents_url(
    agents_url: str,
    controller_url: str,
    bound_url: str,
    *,
    fqdn: Callable[[], str] = socket.getfqdn,
) -> AgentsUrl:
    if agents_url:
        return AgentsUrl(agents_url.rstrip("/"), "daemon.agents_url")
    if controller_url:
        return AgentsUrl(controller_url.rstrip("/"), "agent.controller_url")
    parts = urlsplit(bound_url)
    if (parts.hostname or "") in WILDCARD_HOSTS:
        name = fqdn()
        return AgentsUrl(f"{parts.scheme}://{name}:{parts.port}", f"this host's name ({name})")
    return AgentsUrl(bound_url, "daemon.ingest_listen")


def unreachable_because(
    chosen: AgentsUrl,
    node_addresses: Mapping[str, str] | None,
    *,
    is_local: Callable[[str], bool],
    is_loopback: Callable[[str], bool],
) -> str | None:
    """Why agents could not reach `chosen`, or None. `node_addresses` (node -> NodeAddr) is
    None when Slurm could not say: a loopback URL is then let through (the caller warns)."""
    host = urlsplit(chosen.url).hostname or ""
    if host in WILDCARD_HOSTS:
        return (
            f"agents would report to {chosen.url} (from {chosen.source}), which names no host: "
            f"each agent would post to its own node; {TO_SET}"
        )
    if node_addresses is None or not is_loopback(host):
        return None
    remote = sorted((node, addr) for node, addr in node_addresses.items() if not is_local(addr))
    if not remote:
        return None
    node, addr = remote[0]
    return (
        f"agents would report to {chosen.url} (from {chosen.source}), a loopback address, but "
        f"node {node} (NodeAddr {addr}) and {len(remote) - 1} more are other hosts; {TO_SET}, "
        f"and bind daemon.ingest_listen where they reach it (or 0.0.0.0)"
    )


def _addresses(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def is_loopback_host(name: str) -> bool:
    """The name is, or resolves here only to, loopback addresses (an unresolvable name is not:
    the compute nodes may resolve what this host cannot)."""
    addresses = _addresses(name)
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def is_local_address(name: str) -> bool:
    """The address is this machine's: loopback, or one a socket here can bind (binding a
    foreign address fails with EADDRNOTAVAIL). An unresolvable name is another host's."""
    for address in _addresses(name):
        ip = ipaddress.ip_address(address)
        if ip.is_loopback:
            return True
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                continue
            return True
    return False
