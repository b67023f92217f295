"""torchrun's rendezvous rounds, told to the agent and to the workers (slurmft.agent.rounds)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from slurmft.agent import rounds
from slurmft.agent.channel import RankChannelServer, RendezvousRound
from slurmft.train.report import RDZV_ROUND_ENV, SOCKET_ENV

# A real c10d rendezvous of one node, three rounds; in a child, as the launcher patches torch's
# class for the whole process.
THREE_ROUNDS = textwrap.dedent(
    """
    import os
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from slurmft.agent import rdzv_fix, rounds

    assert rounds.observe(rdzv_fix.load_module())
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    params = RendezvousParameters("c10d", f"127.0.0.1:{store.port}", "r", 1, 1, store=store)
    backend, state_store = create_backend(params)
    handler = create_handler(state_store, backend, params)
    for _ in range(3):
        handler.next_rendezvous()
        print("workers would start in round", os.environ["SLURMFT_RDZV_ROUND"])
    handler.shutdown()
    """
)


@pytest.mark.torch
def test_each_round_torchrun_joins_is_told_to_the_agent_and_to_the_next_workers(
    tmp_path: Path,
) -> None:
    channel = RankChannelServer(str(tmp_path / "ranks.sock"))
    try:
        done = subprocess.run(
            [sys.executable, "-c", THREE_ROUNDS],
            env={**os.environ, SOCKET_ENV: channel.path},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        told = channel.drain()
    finally:
        channel.close()
    assert done.stdout.split("\n")[:3] == [f"workers would start in round {n}" for n in range(3)]
    assert [(r.round, r.previous) for r in told if isinstance(r, RendezvousRound)] == [
        (0, None),
        (1, 0),
        (2, 1),
    ]


class Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []

    def send(self, kind: str, **fields: Any) -> bool:
        self.messages.append((kind, fields))
        return True


def fake_torch_module(state: Any) -> types.ModuleType:
    module = types.ModuleType("fake_dynamic_rendezvous")

    class DynamicRendezvousHandler:
        def __init__(self) -> None:
            if state is not None:
                self._state_holder = types.SimpleNamespace(state=state)

        def next_rendezvous(self) -> str:
            if state is not None:
                state.round += 1
            return "info"

    module.DynamicRendezvousHandler = DynamicRendezvousHandler  # type: ignore[attr-defined]
    return module


def test_an_unreadable_round_is_said_once_and_the_next_workers_get_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(RDZV_ROUND_ENV, "4")  # left from an earlier round
    module = fake_torch_module(state=None)
    sent, warnings = Sent(), []
    assert rounds.observe(module, sent, warn=warnings.append)  # type: ignore[arg-type]
    handler = module.DynamicRendezvousHandler()
    assert handler.next_rendezvous() == "info" and handler.next_rendezvous() == "info"
    assert RDZV_ROUND_ENV not in os.environ
    assert sent.messages == []
    assert len(warnings) == 1 and "grouped by time" in warnings[0]


def test_observing_twice_wraps_once_and_a_module_without_the_handler_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RDZV_ROUND_ENV, raising=False)
    module = fake_torch_module(state=types.SimpleNamespace(round=6))
    sent = Sent()
    assert rounds.observe(module, sent)  # type: ignore[arg-type]
    assert rounds.observe(module, sent)  # type: ignore[arg-type]
    module.DynamicRendezvousHandler().next_rendezvous()
    assert sent.messages == [("round", {"round": 7, "previous": None})]
    assert os.environ[RDZV_ROUND_ENV] == "7"
    assert not rounds.observe(types.ModuleType("no_rendezvous_here"))
