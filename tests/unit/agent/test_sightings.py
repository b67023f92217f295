"""What the agents record for the batch step's budget, read back and charged with the daemon's
rule: a torn last line, two nodes reporting one failure, nodes that left, earlier charges."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from slurmft.agent.agent import AgentSettings, NodeAgent
from slurmft.agent.batch import BatchSpec, BatchState, write_step_outcome
from slurmft.agent.batch_step import BatchStep
from slurmft.agent.channel import RendezvousRound
from slurmft.agent.command import TorchrunSpec
from slurmft.agent.sightings import (
    SightingLog,
    charge_step,
    parse_sightings,
    read_step,
    sightings_path,
)
from slurmft.core.budget import RestartBudget, Seen, Sighting, budget_from_history
from slurmft.db.models import EventKind
from slurmft.protocol import AgentEvent, RankHeartbeat

T0 = 1_800_000_000.0
SPEC = BatchSpec(run_id="r", nodes=3, spares=1, script=("x.py",), ckpt_dir="")


def crash_round(log_by_node: dict[str, SightingLog], at: float) -> None:
    """One crash of rank 1 (on n2): ranks 0 and 2 see it fail, every agent's workers restart."""
    log_by_node["n1"].record(Seen.FAILURE, rank=0, at=at)
    log_by_node["n3"].record(Seen.FAILURE, rank=2, at=at + 0.5)
    for i, node in enumerate(("n1", "n2", "n3")):
        log_by_node[node].record(Seen.RESTART, at=at + 5 + i)


def logs(step_dir: Path) -> dict[str, SightingLog]:
    return {node: SightingLog(str(step_dir), node) for node in ("n1", "n2", "n3")}


def test_a_torn_last_line_and_foreign_lines_are_skipped() -> None:
    whole = json.dumps({"kind": "failure", "at": T0, "rank": 2, "step": -1})
    text = "\n".join([whole, "not json", '{"kind": "spaceship", "at": 1}', whole[:20]])
    (seen,) = parse_sightings(text, "n3")
    assert seen == Sighting(Seen.FAILURE, datetime.fromtimestamp(T0, UTC), agent="n3", rank=2)
    assert parse_sightings(text + "\n", "n3") == [seen]  # the last line, once whole, is not


def test_the_agents_files_of_one_failure_make_one_restart(tmp_path: Path) -> None:
    by_node = logs(tmp_path)
    crash_round(by_node, T0)
    crash_round(by_node, T0 + 30)
    by_node["n1"].record(Seen.CHECKPOINT, step=10, at=T0 - 5)
    # The node that crashed died mid-write of its next line.
    with sightings_path(str(tmp_path), "n2").open("a") as stream:
        stream.write('{"kind": "restart", "at": ')
    sightings = read_step(str(tmp_path))
    assert len(sightings) == 2 * 5 + 1
    budget = charge_step(RestartBudget(max_restarts_without_progress=5), sightings)
    assert budget.restarts_without_progress == 2
    assert budget.last_progress == "step 10"
    assert budget.restarts_by_class == {"user_code": 2}
    # The daemon's rule on the same sightings, not a second one.
    assert budget == budget_from_history(sightings, 5)


def test_charges_add_to_what_earlier_steps_charged(tmp_path: Path) -> None:
    by_node = logs(tmp_path)
    for i in range(2):
        crash_round(by_node, T0 + 30 * i)
    before = RestartBudget(5, restarts_without_progress=4, last_progress="step 10")
    after = charge_step(before, read_step(str(tmp_path)))
    assert after.restarts_without_progress == 6 and after.exhausted
    # Read later, after a third failure: still the budget at the failure that spent it.
    crash_round(by_node, T0 + 60)
    assert charge_step(before, read_step(str(tmp_path))) == after
    assert after.stop_reason().startswith("crash loop: 5 restarts in a row without progress")
    # The same checkpoint reported again is not progress; a newer one is.
    by_node["n1"].record(Seen.CHECKPOINT, step=10, at=T0 - 1)
    assert charge_step(before, read_step(str(tmp_path))).restarts_without_progress == 6
    by_node["n1"].record(Seen.CHECKPOINT, step=15, at=T0 + 20)
    after_progress = charge_step(before, read_step(str(tmp_path)))
    assert after_progress.restarts_without_progress == 2  # at +30, +60


def test_a_restart_near_an_agent_that_left_is_free(tmp_path: Path) -> None:
    by_node = logs(tmp_path)
    crash_round(by_node, datetime.now(UTC).timestamp())  # the outcome file's time is now
    write_step_outcome(str(tmp_path), "n2", "LEFT_CORDONED", "leave: straggler")
    write_step_outcome(str(tmp_path), "n4", "FAILED")  # ended, but nothing was taken away
    sightings = read_step(str(tmp_path))
    assert [s.kind for s in sightings].count(Seen.NODE_REMOVED) == 1
    budget = charge_step(RestartBudget(max_restarts_without_progress=5), sightings)
    assert budget.restarts_without_progress == 0 and budget.restarts_by_class == {"hardware": 1}
    # Left after the batch step stopped the step: the leaving caused nothing.
    stopped = datetime.now(UTC) - timedelta(seconds=10)
    assert Seen.NODE_REMOVED not in {s.kind for s in read_step(str(tmp_path), stopped)}


def test_a_spent_budget_stays_spent_when_the_stopped_agents_leave(tmp_path: Path) -> None:
    """The batch step stops the step at the cap; every agent then writes LEFT. Read as node
    losses, they would make the crashes just before them free and relaunch a crash loop."""
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path), max_restarts_without_progress=1)
    batch = BatchStep(spec, client=None, job_id="7", store_host="127.0.0.1")  # type: ignore[arg-type]
    batch.outcome_dir = str(tmp_path / ".slurmft" / "steps" / "7.1")
    now = datetime.now(UTC).timestamp()
    by_node = logs(Path(batch.outcome_dir))
    crash_round(by_node, now - 40)
    crash_round(by_node, now - 20)
    assert batch._charge_in_place_restarts().exhausted
    batch.step_stopped_at = datetime.now(UTC)  # what _stop notes before it signals the agents
    for node in ("n1", "n2", "n3"):
        write_step_outcome(batch.outcome_dir, node, "LEFT", "SIGTERM")
    budget = batch._charge_in_place_restarts()
    assert budget.exhausted and budget.restarts_without_progress == 2
    assert BatchState.load(str(tmp_path), 1).budget.restarts_without_progress == 2


def test_a_restart_long_after_a_node_loss_is_charged() -> None:
    lost = datetime.fromtimestamp(T0, UTC)
    sightings = [
        Sighting(Seen.NODE_REMOVED, lost),
        Sighting(Seen.FAILURE, lost + timedelta(seconds=5), agent="n1", rank=0),
        Sighting(Seen.FAILURE, lost + timedelta(seconds=300), agent="n1", rank=0),
    ]
    budget = charge_step(RestartBudget(max_restarts_without_progress=5), sightings)
    assert budget.restarts_without_progress == 1


def test_without_a_step_folder_nothing_is_written_or_read(tmp_path: Path) -> None:
    SightingLog("", "n1").record(Seen.RESTART)
    assert read_step("") == [] and not list(tmp_path.iterdir())


class Channel:
    def __init__(self, *records: RankHeartbeat | AgentEvent | RendezvousRound) -> None:
        self.records = list(records)

    def drain(self) -> list[RankHeartbeat | AgentEvent | RendezvousRound]:
        records, self.records = self.records, []
        return records


def _agent(tmp_path: Path, step_dir: Path, node: str, *, nproc_per_node: int) -> NodeAgent:
    """An agent of the batch step's launch `step_dir`, not started: fed through _take_reports."""
    spec = TorchrunSpec(
        nodes=1,
        nproc_per_node=nproc_per_node,
        rdzv_endpoint="127.0.0.1:1",
        rdzv_id="r",
        script=("x.py",),
    )
    settings = AgentSettings(
        spec=spec, node=node, run_id="r", work_dir=tmp_path / "w", step_dir=str(step_dir)
    )
    return NodeAgent(settings)


def test_the_agent_records_restarts_collective_errors_and_checkpoints(tmp_path: Path) -> None:
    step_dir = tmp_path / "steps" / "7.1"
    agent = _agent(tmp_path, step_dir, "n2", nproc_per_node=2)

    def beat(local_rank: int, restart_count: int) -> RankHeartbeat:
        rank = 2 + local_rank
        return RankHeartbeat(rank, local_rank, "step", 1, 0.1, 300.0, False, T0, restart_count)

    def event(kind: EventKind, rank: int, cls: str | None = None, **details: object) -> AgentEvent:
        return AgentEvent(kind=kind, occurred_at=T0, rank=rank, fault_class=cls,
                          details=dict(details))  # fmt: skip

    first = [beat(0, 0), beat(1, 0)]  # the first workers: no restart
    saved = event(EventKind.CHECKPOINT, 0, step=5)
    stopped = event(EventKind.NUMERICAL_FAULT, 2, "numerical", step=6, action="stop")
    suspect = event(EventKind.NUMERICAL_FAULT, 3, "hardware", step=4)  # the node's: no cause
    failed = event(EventKind.COLLECTIVE_ERROR, 3, error="peer closed")
    restarted = [beat(0, 1), beat(1, 1)]
    reports = Channel(*first, saved, suspect, stopped, failed, *restarted)
    agent._take_reports(reports)  # type: ignore[arg-type]
    seen = read_step(str(step_dir))
    assert [(s.kind, s.agent, s.rank, s.step) for s in seen] == [
        (Seen.CHECKPOINT, "n2", -1, 5),
        (Seen.NUMERICAL, "n2", -1, -1),
        (Seen.FAILURE, "n2", 3, -1),
        (Seen.RESTART, "n2", -1, -1),  # once for the node, not once per local rank
    ]
    # The batch step charges the failure after it as the daemon does: to the numerical class
    # (the restart here is recorded at the wall clock's now, a failure of its own).
    budget = charge_step(RestartBudget(max_restarts_without_progress=5), seen)
    assert budget.restarts_by_class["numerical"] == 1


@pytest.mark.parametrize(("grace_s", "stops"), [(0.0, True), (600.0, False)])
def test_a_spent_budget_stops_the_step_after_the_daemons_grace(
    tmp_path: Path, grace_s: float, stops: bool
) -> None:
    """A daemon that watches the run stops it first (its reason in the store); the batch step
    stops the step once the grace has passed, with the budget as it was when spent."""
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path), max_restarts_without_progress=1)
    batch = BatchStep(spec, None, "7", "127.0.0.1", give_up_grace_s=grace_s)  # type: ignore[arg-type]
    batch.outcome_dir = str(tmp_path / "7.1")
    by_node = logs(Path(batch.outcome_dir))
    crash_round(by_node, T0)
    assert not batch._budget_spent()  # one restart: within the cap
    crash_round(by_node, T0 + 30)
    assert batch._budget_spent() is stops
    crash_round(by_node, T0 + 60)  # torchrun goes on restarting during the grace
    assert batch._budget_spent() is stops
    assert batch.step_spent is not None and batch.step_spent.restarts_without_progress == 2
    assert BatchState.load(str(tmp_path), 1).budget.restarts_without_progress == 2


def test_a_node_loss_confirmed_during_the_grace_makes_the_spending_restart_free(
    tmp_path: Path,
) -> None:
    """At the cap a node dies: its peers' restart is recorded at once and spends the budget;
    Slurm's word that the node is lost comes seconds later (confirmed after confirm_s). The
    restart is then free, as the daemon counts it, and the step is not stopped."""
    spec = dataclasses.replace(SPEC, ckpt_dir=str(tmp_path), max_restarts_without_progress=1)
    batch = BatchStep(spec, None, "7", "127.0.0.1", give_up_grace_s=600.0)  # type: ignore[arg-type]
    batch.outcome_dir = str(tmp_path / "7.1")
    by_node = logs(Path(batch.outcome_dir))
    now = datetime.now(UTC).timestamp()
    crash_round(by_node, now - 90)  # the user's code: one restart, the cap
    crash_round(by_node, now - 5)  # the node's death: spends the budget, for now
    assert not batch._budget_spent() and batch.step_spent is not None
    batch._note_removed(["n1", "n2", "n3"], alive={"n1", "n3"})  # n2 lost, confirmed
    assert not batch._budget_spent() and batch.step_spent is None
    budget = BatchState.load(str(tmp_path), 1).budget
    assert budget.restarts_without_progress == 1
    assert budget.restarts_by_class == {"user_code": 1, "hardware": 1}


class Forwarded:
    """The agent's reporter: what it would send to the daemon."""

    def __init__(self) -> None:
        self.records: list[object] = []

    def add(self, record: object) -> None:
        self.records.append(record)

    add_event = add


def test_with_rounds_told_restarts_and_failures_are_named_by_the_round_they_ended(
    tmp_path: Path,
) -> None:
    step_dir = tmp_path / "steps" / "7.2"
    agent = _agent(tmp_path, step_dir, "n1", nproc_per_node=1)
    agent.reporter = forwarded = Forwarded()  # type: ignore[assignment]

    failed = AgentEvent(
        kind=EventKind.COLLECTIVE_ERROR, occurred_at=T0, rank=0, details={"rdzv_round": 4}
    )
    after = RankHeartbeat(0, 0, "step", 1, 0.1, 300.0, False, T0 + 3, 1)  # torch's count: 1
    agent._take_reports(
        Channel(  # type: ignore[arg-type]
            RendezvousRound(4, None, T0 - 10),  # torchrun's first round: no restart
            failed,
            RendezvousRound(6, 4, T0 + 1),  # round 5 never got to workers here
            after,
        )
    )
    seen = read_step(str(step_dir))
    assert [(s.kind, s.round) for s in seen] == [(Seen.FAILURE, "7.2/4"), (Seen.RESTART, "7.2/4")]
    events = [r for r in forwarded.records if isinstance(r, AgentEvent)]
    assert [(e.kind, e.details["rdzv_round"]) for e in events] == [
        (EventKind.COLLECTIVE_ERROR, "7.2/4"),  # the rank's report, named in this agent step
        (EventKind.RESTART, "7.2/4"),  # once, from the round: not again from the heartbeat
    ]
    assert budget_from_history(seen, 5).restarts_without_progress == 1
