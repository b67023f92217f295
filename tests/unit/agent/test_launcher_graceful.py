"""A spare that leaves a finished rendezvous gracefully must not fail torchrun."""

from __future__ import annotations

import pytest

from slurmft.agent.launcher import patch_graceful_exit, succeed_on_graceful_exit


def test_none_from_a_graceful_exit_becomes_success() -> None:
    wrapped = succeed_on_graceful_exit(lambda: None, lambda: "succeeded")
    assert wrapped() == "succeeded"
    passthrough = succeed_on_graceful_exit(lambda: "failed result", lambda: "succeeded")
    assert passthrough() == "failed result"


@pytest.mark.torch
def test_torch_agent_run_reports_success_after_a_graceful_rendezvous_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

    monkeypatch.setattr(api.SimpleElasticAgent, "run", api.SimpleElasticAgent.run)

    class Spare(api.SimpleElasticAgent):  # only what run() touches
        def __init__(self) -> None:
            self._shutdown_timeout = 1

        def _invoke_run(self, role: str = "default") -> api.RunResult:
            raise RendezvousGracefulExitError("the round is closed: training finished")

        def _shutdown(self, *args: object, **kwargs: object) -> None:
            pass

        _start_workers = _stop_workers = _monitor_workers = _restart_workers = _shutdown

    assert Spare().run() is None  # torch's own behaviour, on which launch_agent crashes
    patch_graceful_exit()
    assert Spare().run().state is api.WorkerState.SUCCEEDED
