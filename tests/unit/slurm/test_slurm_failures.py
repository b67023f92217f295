"""Failed commands become typed errors; recorded real stderr where Slurm could be made to fail."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import pytest
from support.waiting import wait_for

from slurmft.slurm.api import (
    SlurmBadRequest,
    SlurmError,
    SlurmJobNotFound,
    SlurmPermissionDenied,
    SlurmTimeout,
    SlurmUnreachable,
)
from slurmft.slurm.failures import classify_failure
from slurmft.slurm.runner import CommandResult, SubprocessRunner

Recorded = Callable[[str], CommandResult]


@pytest.mark.parametrize(
    ("recording", "error_type"),
    [
        ("squeue_unreachable", SlurmUnreachable),
        ("sbatch_unreachable", SlurmUnreachable),
        ("drain_unreachable", SlurmUnreachable),
        ("drain_not_admin", SlurmPermissionDenied),  # 22.05 says "Invalid user id"
        ("requeue_not_owner", SlurmPermissionDenied),
        ("cancel_not_owner", SlurmPermissionDenied),
        ("show_job_unknown", SlurmJobNotFound),
        ("squeue_unknown_single", SlurmJobNotFound),
        ("update_exclude_running", SlurmBadRequest),
        ("drain_unknown_node", SlurmBadRequest),
        ("sbatch_bad_partition", SlurmBadRequest),
    ],
)
def test_recorded_failures(recorded: Recorded, recording: str, error_type: type) -> None:
    result = recorded(recording)
    assert result.returncode != 0
    error = classify_failure(result)
    assert type(error) is error_type
    assert error.argv == list(result.argv) and error.stderr == result.stderr


def test_unreachable_wins_over_everything_else() -> None:
    # A query that could not be sent says nothing about the job: never "not found".
    result = CommandResult(
        ("squeue",), 1, "", "Invalid job id specified\nUnable to contact slurm controller"
    )
    assert type(classify_failure(result)) is SlurmUnreachable


@pytest.mark.parametrize(
    ("stderr", "error_type"),
    [
        ("slurm_load_jobs error: Socket timed out on send/recv operation", SlurmTimeout),
        ("sbatch: error: Munge encode failed: Failed to access socket", SlurmUnreachable),
        ("squeue: fatal: Unable to process configuration file", SlurmUnreachable),
        ("scontrol: error: Zero Bytes were transmitted or received", SlurmUnreachable),
        ("something Slurm never said before", SlurmError),
        ("", SlurmError),
    ],
)
def test_other_messages(stderr: str, error_type: type) -> None:
    assert type(classify_failure(CommandResult(("scontrol",), 1, "", stderr))) is error_type


def test_messages_say_what_to_do(recorded: Recorded) -> None:
    assert "SLURM_CONF" in str(classify_failure(recorded("squeue_unreachable")))
    assert "Operator" in str(classify_failure(recorded("drain_not_admin")))


def test_runner_timeout_is_typed_and_ends_what_the_command_started() -> None:
    """A wrapper script's `sleep` left alive would hold the output pipes, and the call, open."""
    raised: list[BaseException] = []

    def call() -> None:
        with pytest.raises(SlurmTimeout) as error:
            SubprocessRunner().run(["sh", "-c", "sleep 600; echo never"], 0.2)
        raised.append(error.value)

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive() and len(raised) == 1


def test_missing_command_is_unreachable() -> None:
    with pytest.raises(SlurmUnreachable):
        SubprocessRunner().run(["slurmft-no-such-command"], 5)


def test_runner_passes_stdin_and_env_without_a_shell() -> None:
    runner = SubprocessRunner({"SLURM_CONF": "/x/slurm.conf"})
    result = runner.run(["sh", "-c", 'cat; printf "%s" "$SLURM_CONF"', "$(id)"], 5, stdin="a;b\n")
    assert result.stdout == "a;b\n/x/slurm.conf"
    assert runner.calls == {"sh": 1}


def test_stop_ends_the_command_in_flight_and_refuses_the_next() -> None:
    """The daemon stopping: a command waiting on a busy slurmctld does not hold the stop for
    its timeout (a 600 s `sleep` stands for it), and no command starts after it."""
    runner = SubprocessRunner()
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            runner.run(["sh", "-c", "sleep 600; echo never"], 600)
        except SlurmUnreachable as error:
            outcome.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: runner._running, 30, "the command to start", interval_s=0.01)
    (child,) = runner._running
    runner.stop("the daemon is stopping")
    caller.join(timeout=30)
    assert not caller.is_alive()
    assert [str(e) for e in outcome] == ["sh ended early: the daemon is stopping"]
    assert child.returncode == -signal.SIGKILL
    with pytest.raises(SlurmUnreachable, match=r"^sleep not run: the daemon is stopping$"):
        runner.run(["sleep", "0"], 5)
    assert runner.calls == {"sh": 1, "sleep": 1}
