"""A straggler on the real cluster: one active node of a 3+1 run slowed by 30% mid-run.

The slowdown follows the node (tiny's --slow-nodes-file), as a slow GPU or a hot node would:
once the spare has taken the node's place, the run is at speed again. The daemon's window is
10 s here (five 2 s buckets; production: 300 s of 60 s buckets): "sustained" means slower than
the median of the other ranks by more than 20% in every bucket. The daemon records the
straggler with its rank, node and margin, takes the node out of the run (the agent leaves, the
spare joins, world size stays 3) and training reaches its last step. Draining the node in
Slurm for everyone follows the trust policy: not after one window by default (three windows),
at once when the policy says one window is enough.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from daemon_process import running_daemon
from e2e_run import TINY, submit
from local_cluster import Cluster
from support.waiting import wait_for_value

from slurmft.db.models import Action, ActionKind, Event, EventKind

# serial: the finding is one rank's step times against the others'; load lands unevenly.
pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.serial]

STEPS = 150  # ~0.25 s a step: long enough to flag, replace and still train on afterwards
EXAMPLE = [
    "-m",
    "slurmft.train.examples.tiny",
    "--ckpt-dir",
    "{ckpt}",
    "--out-dir",
    "{out}",
    *TINY,
    "--steps",  # after TINY's own --steps: the last one wins
    str(STEPS),
    "--slow-factor",
    "0.3",
]
DAEMON_POLICY = {"SLURMFT_POLICY_STRAGGLER_WINDOW_S": "10"}


@pytest.mark.parametrize("drain_after_windows", [3, 1], ids=["default-trust", "drain-at-once"])
def test_a_slow_node_is_flagged_replaced_by_the_spare_and_drained_only_by_the_trust_policy(
    cluster: Cluster, tmp_path: Path, drain_after_windows: int
) -> None:
    slow_nodes = tmp_path / "slow-nodes"
    slow_nodes.write_text("")
    trust = {"SLURMFT_TRUST_STRAGGLER_DRAIN_AFTER_WINDOWS": str(drain_after_windows)}
    with running_daemon(tmp_path, **DAEMON_POLICY, **trust) as daemon:
        run = submit(
            cluster,
            daemon,
            tmp_path,
            [*EXAMPLE, "--slow-nodes-file", str(slow_nodes)],
            name=f"straggler-{drain_after_windows}",
        )
        run.wait_training()
        batch_host = cluster.client.job(run.job_id).batch_host
        ranks = run.beating_nodes()
        victim = sorted(set(ranks.values()) - {batch_host})[0]
        victim_rank = next(rank for rank, node in ranks.items() if node == victim)
        cluster._drained.add(victim)  # resumed by the fixture whatever happens
        slow_nodes.write_text(f"{victim}\n")
        slowed_at, slowed_step = time.monotonic(), run.latest_step()

        mine = (Event.kind == EventKind.STRAGGLER, Event.source == "daemon")
        (event,), _ = wait_for_value("the straggler finding", lambda: run.events(*mine), bool, 120)
        flagged_s, flagged_step = time.monotonic() - slowed_at, run.latest_step()
        assert (event.node, event.rank) == (victim, victim_rank)
        assert 0.2 < event.details["margin"] < 0.45  # 30% slower work, some compute at speed
        # The evidence keeps the margin to 3 decimals; the reason rounds the exact one.
        shown = re.fullmatch(
            rf"slurmft: straggler rank {victim_rank} \+(\d+)% over median", event.message
        )
        assert shown and abs(int(shown[1]) - event.details["margin"] * 100) <= 1, event.message
        (leave,), _ = wait_for_value(
            "the node to be taken out of the run",
            lambda: run.actions(Action.kind == ActionKind.AGENT_LEAVE),
            bool,
            timeout_s=30,
        )
        assert (leave.node, leave.reason) == (victim, event.message)

        replaced_s = run.wait_replaced(victim)
        run.wait_completed(STEPS)
        print(
            f"\nslowed at step {slowed_step}; flagged {flagged_s:.1f} s and "
            f"{flagged_step - slowed_step} steps later (margin {event.details['margin']:.2f}); "
            f"spare training {replaced_s:.1f} s after that"
        )
        records = run.jsonl("losses.jsonl")
        assert {r["world_size"] for r in records} == {3}
        assert sorted({r["step"] for r in records}) == list(range(1, STEPS + 1))
        # Once the slow node left, nobody is slow: the spare and the others are not flagged.
        assert [e.node for e in run.events(*mine)] == [victim]

        drains = [a for a in run.actions() if a.kind is ActionKind.DRAIN_NODE]
        node = cluster.client.node(victim)
        if drain_after_windows == 1:
            assert [(d.node, d.status.value) for d in drains] == [(victim, "done")]
            assert node.status.drain_requested
            assert node.reason == f"{event.message}, slow in 1 windows"
        else:
            assert drains == []
            assert not node.status.drain_requested  # one window: out of the run, not of Slurm
        run.database.dispose()
