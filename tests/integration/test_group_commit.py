"""Group commit: batches that arrive together share one transaction, each is answered only
after it is stored, and one bad batch does not take its neighbours down with it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from sqlalchemy import func, select
from support.waiting import wait_for

from slurmft.controller import group_commit
from slurmft.controller.group_commit import GroupCommitter
from slurmft.controller.ingest import IngestRefused, new_run_token
from slurmft.db import Database, DatabaseUnavailable
from slurmft.db.models import AgentCursor, RankHeartbeat, StepTime
from slurmft.protocol import AgentBatch, AgentEvent, BatchReply, RankStepTime
from slurmft.protocol import RankHeartbeat as WireHeartbeat

NOW = datetime(2026, 11, 29, 12, tzinfo=UTC)


def _batch(node: int, run_id: str = "g1", seq: int = 1) -> AgentBatch:
    """Node ``node``'s agent: ranks 4*node .. 4*node+3, one heartbeat and one step time each."""
    ranks = range(4 * node, 4 * node + 4)
    at = NOW.timestamp() + seq
    return AgentBatch(
        run_id=run_id,
        agent_id=f"n{node}-agent",
        node=f"n{node}",
        seq=seq,
        sent_at=at,
        heartbeats=tuple(
            WireHeartbeat(r, r % 4, "step", seq, 0.1, 300.0, False, at) for r in ranks
        ),
        step_times=tuple(RankStepTime(r, seq, 0.5, 0.1, at) for r in ranks),
    )


@pytest.fixture
def token(database: Database, seed_run: Callable[..., None]) -> str:
    token, digest = new_run_token()
    seed_run(database, "g1", job_id="8", token_hash=digest)
    return token


def _committer(database: Database) -> GroupCommitter:
    return GroupCommitter(database, clock=lambda: NOW, sample_every=timedelta(seconds=60))


def _submit_together(
    committer: GroupCommitter, posts: Sequence[tuple[AgentBatch, str]]
) -> list[BatchReply | Exception]:
    """Every post from its own thread, all queued before the writer starts: one group."""
    results: list[BatchReply | Exception] = [RuntimeError("no answer")] * len(posts)

    def post(index: int) -> None:
        try:
            results[index] = committer.submit(*posts[index], timeout_s=30)
        except Exception as error:
            results[index] = error

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(posts))]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: committer.queued() >= len(posts),
        10,
        lambda: f"every post queued: {committer.queued()} of {len(posts)}",
        interval_s=0.01,
    )
    committer.start()
    for thread in threads:
        thread.join(30)
    committer.stop()
    return results


def _count(database: Database, model: type) -> int:
    with database.session() as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def test_batches_that_arrive_together_are_one_transaction(database: Database, token: str) -> None:
    committer = _committer(database)
    wrong, _ = new_run_token()
    posts = [(_batch(node), token) for node in range(40)] + [(_batch(40), wrong)]
    results = _submit_together(committer, posts)
    assert (committer.groups, committer.batches) == (1, 41)
    assert all(isinstance(r, BatchReply) and r.acked_seq == 1 for r in results[:40]), results
    # A wrong token is refused alone; the others are stored.
    assert isinstance(results[40], IngestRefused) and results[40].status == 403
    assert _count(database, RankHeartbeat) == _count(database, StepTime) == 160
    assert _count(database, AgentCursor) == 40


def test_an_agents_resend_in_the_same_group_is_stored_once(database: Database, token: str) -> None:
    committer = _committer(database)
    posts = [(_batch(0, seq=1), token), (_batch(0, seq=1), token), (_batch(0, seq=2), token)]
    results = _submit_together(committer, posts)
    assert [r.acked_seq for r in results if isinstance(r, BatchReply)] == [1, 1, 2]
    assert _count(database, StepTime) == 8  # seq 1 and seq 2, four ranks each
    with database.session() as s:
        assert s.scalar(select(AgentCursor.last_seq)) == 2
        assert s.scalar(select(func.max(RankHeartbeat.step))) == 2


def test_one_failing_batch_is_refused_alone(
    database: Database, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = group_commit.ingest_batches

    def failing_on_node_3(session, posts, **kwargs):  # type: ignore[no-untyped-def]
        if any(batch.node == "n3" for batch, _ in posts):
            raise ValueError("the store refused n3's rows")
        return real(session, posts, **kwargs)

    monkeypatch.setattr(group_commit, "ingest_batches", failing_on_node_3)
    committer = _committer(database)
    results = _submit_together(committer, [(_batch(node), token) for node in range(6)])
    assert isinstance(results[3], ValueError)
    assert all(isinstance(r, BatchReply) for i, r in enumerate(results) if i != 3), results
    assert _count(database, AgentCursor) == 5  # the group, then each batch on its own


def test_an_unreachable_store_answers_every_waiting_agent_at_once() -> None:
    dead = Database("postgresql+psycopg://nobody@127.0.0.1:9/none")
    committer = _committer(dead)
    results = _submit_together(committer, [(_batch(node), "t") for node in range(5)])
    assert all(isinstance(r, DatabaseUnavailable) for r in results), results
    assert committer.groups == 0
    with pytest.raises(DatabaseUnavailable, match="stopping"):
        committer.submit(_batch(0), "t")


def test_a_value_too_long_for_the_store_is_refused_not_cut_short(
    database: Database, token: str
) -> None:
    """A node name over the store's varchar(128) (which the bulk insert must not cut short) is
    refused before the group is written, on both stores: that batch alone, the group intact."""
    long_node = msgspec.structs.replace(_batch(2), node="n" * 200)
    posts = [(_batch(0), token), (_batch(1), token), (long_node, token)]
    committer = _committer(database)
    results = _submit_together(committer, posts)
    assert all(isinstance(r, BatchReply) for r in results[:2]), results
    assert isinstance(results[2], IngestRefused) and results[2].status == 400, results[2]
    assert "batch.node: 200 characters, over 128" in str(results[2])
    assert (committer.groups, committer.fallbacks) == (1, 0)
    with database.session() as s:
        assert set(s.scalars(select(RankHeartbeat.node))) == {"n0", "n1"}


def test_a_refused_batch_queued_with_good_ones_leaves_the_group_path_whole(
    database: Database, token: str
) -> None:
    """Issue 14, item 9: malformed batches (a sequence number past int64, an event time of 1e20;
    on PostgreSQL a NUL byte, which needs no valid token) queued with good ones while the writer
    is held: each is refused alone, before the group is written, and the good batches are
    stored by the group path, not by the one-transaction-per-batch fallback."""
    huge_seq = msgspec.structs.replace(_batch(1), seq=2**63)
    far_event = AgentEvent("restart", 1e20, "from the far future")
    far = msgspec.structs.replace(_batch(2), events=(far_event,))
    nul = msgspec.structs.replace(_batch(3), node="n\x003")
    committer = _committer(database).start()
    results: dict[int, BatchReply | Exception] = {}

    def post(index: int, batch: AgentBatch, token: str) -> threading.Thread:
        def run() -> None:
            try:
                results[index] = committer.submit(batch, token, timeout_s=30)
            except Exception as error:
                results[index] = error

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    try:
        with committer.hold():
            threads = [post(0, _batch(0), token)]
            wait_for(committer.holding.is_set, 10, "the writer holding batch 0", interval_s=0.01)
            posts = [(huge_seq, token), (far, token), (nul, "no-token"), (_batch(4), token)]
            threads += [post(i, batch, tok) for i, (batch, tok) in enumerate(posts, start=1)]
            wait_for(lambda: committer.queued() == 4, 10, "four batches queued", interval_s=0.01)
        for thread in threads:
            thread.join(30)
    finally:
        committer.stop()
    assert isinstance(results[0], BatchReply) and isinstance(results[4], BatchReply), results
    refused = [results[i] for i in (1, 2, 3)]
    assert [r.status if isinstance(r, IngestRefused) else r for r in refused] == [400, 422, 400]
    assert (committer.groups, committer.batches, committer.fallbacks) == (1, 5, 0)
    with database.session() as s:
        assert set(s.scalars(select(AgentCursor.agent_id))) == {"n0-agent", "n4-agent"}
        assert set(s.scalars(select(RankHeartbeat.node))) == {"n0", "n4"}
