"""The CLI backend end to end, on recorded real output replayed through the one runner seam."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support.slurm_recordings import ReplayRunner, job_id_of, jobs_asked, load_recording

from slurmft.slurm.api import (
    SlurmBadRequest,
    SlurmClient,
    SlurmJobNotFound,
    SlurmPermissionDenied,
    SlurmUnreachable,
    SubmitRequest,
)
from slurmft.slurm.cli_backend import CliSlurmClient
from slurmft.slurm.runner import CommandResult
from slurmft.slurm.script import render_batch_script
from slurmft.slurm.states import JobState

Replay = Callable[..., tuple[CliSlurmClient, ReplayRunner]]


def test_cli_backend_implements_the_protocol() -> None:
    assert isinstance(CliSlurmClient(), SlurmClient)


def test_version(replay: Replay) -> None:
    client, runner = replay("sinfo_version")
    assert str(client.version()) == "22.05.8"
    assert str(client.version()) == "22.05.8"  # asked once, then remembered
    assert runner.exhausted


def test_submit_sends_the_recorded_argv(replay: Replay) -> None:
    client, runner = replay("sbatch_parsable")
    # The same request record.py submitted.
    script = render_batch_script(["srun", "-N3", "-n3", "sleep", "600"])
    job_id = client.submit(
        SubmitRequest(script=script, job_name="slurmft-fixture", run_id="run-0001", nodes=2,
                      spare_nodes=1, signal="B:USR1@60", output="/dev/null")
    )  # fmt: skip
    assert job_id == load_recording("sbatch_parsable").stdout.strip()
    assert runner.exhausted


def test_jobs_many_in_one_call(replay: Replay) -> None:
    client, runner = replay("squeue_many")
    asked = jobs_asked(load_recording("squeue_many"))
    jobs = client.jobs(asked)
    assert len(runner.calls) == 1
    assert set(jobs) == set(asked) - {"999999"}


def test_a_single_unknown_job_is_simply_absent(replay: Replay) -> None:
    client, _ = replay("squeue_unknown_single")
    assert client.jobs(["999999"]) == {}


def test_unreachable_controller_is_never_an_empty_answer(replay: Replay) -> None:
    client, _ = replay("squeue_unreachable")
    with pytest.raises(SlurmUnreachable):
        client.jobs(jobs_asked(load_recording("squeue_unreachable")))


def test_job_detail_and_unknown_job(replay: Replay) -> None:
    client, _ = replay("show_job_rerun", "show_job_unknown")
    job = client.job(job_id_of(load_recording("show_job_rerun")))
    assert (job.state, job.restarts) == (JobState.RUNNING, 1)
    with pytest.raises(SlurmJobNotFound):
        client.job("999999")


def test_batch_host_down(replay: Replay) -> None:
    client, runner = replay("show_job_batch_host_down", "show_node_down")
    assert client.batch_host_down(job_id_of(load_recording("show_job_batch_host_down")))
    assert runner.exhausted


def test_batch_host_alive(replay: Replay) -> None:
    client, _ = replay("show_job_running", "show_node_allocated")
    assert not client.batch_host_down(job_id_of(load_recording("show_job_running")))


def test_batch_host_of_a_pending_job_is_not_asked_about(replay: Replay) -> None:
    client, runner = replay("show_job_pending_held")
    assert not client.batch_host_down(job_id_of(load_recording("show_job_pending_held")))
    assert runner.exhausted


def test_nodes(replay: Replay) -> None:
    client, _ = replay("sinfo_nodes_down", "show_node_drained")
    nodes = client.nodes()
    assert nodes["n1"].status.down
    assert client.node("n6").status.drained


def test_node_and_job_actions(replay: Replay) -> None:
    client, runner = replay(
        "drain_idle", "drain_unknown_node", "show_job_running", "requeue",
        "update_exclude_pending",
        "update_exclude_running", "cancel",
    )  # fmt: skip
    client.drain("n6", 'it\'s "bad" $(touch /tmp/x); a|b rm -rf / Foo=bar `id`')
    with pytest.raises(SlurmBadRequest):
        client.drain("nosuchnode", "x")
    client.requeue(job_id_of(load_recording("requeue")))
    pending = load_recording("update_exclude_pending").argv[2].removeprefix("JobId=")
    client.set_excluded_nodes(pending, ["n6", "n5"])
    running = load_recording("update_exclude_running").argv[2].removeprefix("JobId=")
    with pytest.raises(SlurmBadRequest):
        client.set_excluded_nodes(running, ["n6"])
    client.cancel(job_id_of(load_recording("cancel")))
    assert runner.exhausted


def test_permission_denied_is_typed() -> None:
    recording = load_recording("drain_not_admin")

    class AsNonAdmin(ReplayRunner):
        def run(self, argv, timeout, *, stdin=None):  # type: ignore[no-untyped-def]
            assert ["runuser", "-u", "daemon", "--", *argv] == list(recording.argv)
            return recording

    client = CliSlurmClient(AsNonAdmin([]))
    with pytest.raises(SlurmPermissionDenied):
        client.drain("n5", "x")


def test_requeue_with_excluded_nodes_requeues_then_sets_them(replay: Replay) -> None:
    client, runner = replay("show_job_running", "requeue", "update_exclude_held")
    client.requeue(job_id_of(load_recording("requeue")), exclude=["n2"])
    assert [call[1] for call in runner.calls] == ["--oneliner", "requeue", "update"]


def test_an_exclusion_slurm_refuses_does_not_undo_the_requeue() -> None:
    """22.05 refuses every update of a job that lost a node: the requeue stands (never a hold
    that could not be released), and the exclusion is left to the daemon's next passes."""
    refused = load_recording("update_exclude_shrunk")
    job_id = job_id_of(load_recording("requeue_shrunk"))

    class ShrunkJob(ReplayRunner):
        def run(self, argv, timeout, *, stdin=None):  # type: ignore[no-untyped-def]
            self.calls.append(tuple(argv))
            if argv[1] == "update":
                assert tuple(argv) == refused.argv
                return refused
            if argv[1] == "requeue":
                return load_recording("requeue_shrunk")
            return load_recording("show_job_running")  # the restart count, unused on success

    runner = ShrunkJob([])
    CliSlurmClient(runner).requeue(job_id, exclude=refused.argv[-1].split("=")[1].split(","))
    assert [call[1] for call in runner.calls] == ["--oneliner", "requeue", "update"]
    assert "Unexpected message received" in refused.stderr and refused.returncode == 1


class RequeueAnswersAnError(ReplayRunner):
    """A loaded slurmctld: scontrol's requeue fails (the answer seen in the daemon's action rows
    on the loaded test cluster) while the job record says whether it was carried out."""

    def __init__(self, *, carried_out: bool) -> None:
        super().__init__([])
        self.show = ["show_job_running", "show_job_requeued" if carried_out else "show_job_running"]

    def run(self, argv, timeout, *, stdin=None):  # type: ignore[no-untyped-def]
        self.calls.append(tuple(argv))
        if argv[1] == "requeue":
            return CommandResult(tuple(argv), 1, "", "scontrol: Unexpected message received\n")
        recording = load_recording(self.show.pop(0))
        assert tuple(argv) == recording.argv
        return recording


def test_a_requeue_slurm_carried_out_is_done_though_scontrol_failed() -> None:
    runner = RequeueAnswersAnError(carried_out=True)
    # Restarts 0 -> 1: done, not retried later
    CliSlurmClient(runner).requeue(job_id_of(load_recording("show_job_running")))
    assert [call[1] for call in runner.calls] == ["--oneliner", "requeue", "--oneliner"]


def test_a_requeue_that_did_not_happen_still_fails() -> None:
    with pytest.raises(SlurmBadRequest, match="Unexpected message"):
        CliSlurmClient(RequeueAnswersAnError(carried_out=False)).requeue(
            job_id_of(load_recording("show_job_running"))
        )


def test_a_shrunk_jobs_step_still_names_the_node_it_lost(replay: Replay) -> None:
    client, runner = replay("show_job_shrunk", "squeue_steps_shrunk", "squeue_steps_unknown")
    job_id = job_id_of(load_recording("show_job_shrunk"))
    held = set(client.job(job_id).nodes)
    had = client.step_nodes(job_id)
    assert len(held) == 2 and held < had and len(had) == 3  # one node lost, its step runs on
    assert client.step_nodes("999999") == frozenset()  # Slurm knows no such job: no steps
    assert runner.exhausted


class _ForgedSqueue:
    """The recorded cluster, where the completed job's name holds a row of its own for the
    running job (Slurm 22.05 prints a name's newline as it is): squeue's answer is the recorded
    one with that name; scontrol's are the recordings."""

    FORGED = "done\n1|COMPLETED|None|n9|n9|slurmft-run:run-0001|x"

    def __init__(self) -> None:
        squeue = load_recording("squeue_many")
        names = ("show_job_running", "show_job_pending_held", "show_job_completed")
        self.answers = {r.argv: r for r in map(load_recording, (*names, "show_job_unknown"))}
        self.answers[squeue.argv] = CommandResult(
            squeue.argv, 0, squeue.stdout.replace("|done\n", f"|{self.FORGED}\n"), ""
        )
        self.calls: list[str] = []

    def run(self, argv: object, timeout: float, *, stdin: str | None = None) -> CommandResult:
        key = tuple(argv)  # type: ignore[call-overload]
        self.calls.append(key[0])
        return self.answers[key]


def test_a_row_forged_in_a_jobs_name_is_never_taken_each_job_is_read_alone() -> None:
    runner = _ForgedSqueue()
    client = CliSlurmClient(runner)

    jobs = client.jobs(jobs_asked(load_recording("squeue_many")))

    assert runner.calls == ["squeue", "scontrol", "scontrol", "scontrol", "scontrol"]
    assert {job_id: (job.state, job.nodes) for job_id, job in jobs.items()} == {
        "1": (JobState.RUNNING, ("n1", "n2", "n3")),
        "2": (JobState.PENDING, ()),
        "3": (JobState.COMPLETED, ("n1",)),
    }
    assert jobs["3"].name == "done"


def test_a_row_for_a_job_not_asked_about_is_left_out() -> None:
    runner = _ForgedSqueue()
    squeue = load_recording("squeue_many")
    forged = squeue.stdout.replace("|done\n", "|done\n7|COMPLETED|None|n9|n9||x\n")
    runner.answers[squeue.argv] = CommandResult(squeue.argv, 0, forged, "")

    jobs = CliSlurmClient(runner).jobs(jobs_asked(squeue))

    assert runner.calls == ["squeue"]
    assert sorted(jobs) == ["1", "2", "3"]
