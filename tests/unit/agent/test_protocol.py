"""The agent <-> daemon wire format: round trips, strict validation, store conversion."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmft import protocol
from slurmft.controller.ingest import heartbeat_reports, step_time_reports
from slurmft.protocol import (
    AgentBatch,
    AgentEvent,
    BatchReply,
    Command,
    ProtocolError,
    RankHeartbeat,
    RankStepTime,
    TimeReply,
)

T0 = 1_800_000_000.25


def batch() -> AgentBatch:
    return AgentBatch(
        run_id="r1",
        agent_id="n1-abc",
        node="n1",
        seq=3,
        sent_at=T0,
        heartbeats=(RankHeartbeat(2, 0, "step", 17, 0.4, 300.0, False, T0, 1, 4242),),
        step_times=(RankStepTime(2, 17, 0.2, 0.05, T0),),
        events=(
            AgentEvent(
                "hang", T0, "stuck", rank=2, fault_class="hang", details={"stacks": {"2": "..."}}
            ),
        ),
    )


def body(**changes: Any) -> dict[str, Any]:
    data = json.loads(batch().to_json())
    data.update(changes)
    return data


def test_round_trip() -> None:
    assert AgentBatch.from_json(batch().to_json()) == batch()
    reply = BatchReply(3, T0, (Command("leave", "node n1 cordoned"),))
    assert BatchReply.from_json(reply.to_json()) == reply
    assert TimeReply.from_json(TimeReply(T0).to_json()) == TimeReply(T0)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (json.dumps({**body(), "v": 2}).encode(), "protocol version 2"),
        (json.dumps({k: v for k, v in body().items() if k != "v"}).encode(), "protocol version"),
        (
            json.dumps({k: v for k, v in body().items() if k != "seq"}).encode(),
            "batch.seq: missing",
        ),
        (json.dumps(body(seq="3")).encode(), "batch.seq: expected `int`, got `str`"),
        (json.dumps(body(seq=True)).encode(), "batch.seq: expected `int`, got `bool`"),
        (json.dumps(body(seq=0)).encode(), "batch.seq: 0 is not in [1, "),
        (json.dumps(body(extra=1)).encode(), "unknown field 'extra'"),
        (
            json.dumps(body(heartbeats={})).encode(),
            "batch.heartbeats: expected `array`, got `object`",
        ),
        (
            json.dumps(body(heartbeats=[1])).encode(),
            "batch.heartbeats[0]: expected `object`, got `int`",
        ),
        (json.dumps(body(step_times=[{"rank": 1}])).encode(), "batch.step_times[0].step: missing"),
        (
            json.dumps(body(events=[{"kind": "party", "occurred_at": T0}])).encode(),
            "batch.events[0].kind: invalid enum value 'party'",
        ),
        (
            json.dumps(
                body(events=[{"kind": "hang", "occurred_at": T0, "fault_class": "x"}])
            ).encode(),
            "batch.events[0].fault_class: invalid enum value 'x'",
        ),
        # JSON has no NaN; a number beyond a double is refused, not read as infinity.
        (
            b'{"v": 1, "run_id": "r", "agent_id": "a", "node": "n", "seq": 1, "sent_at": NaN}',
            "not JSON",
        ),
        (
            b'{"v": 1, "run_id": "r", "agent_id": "a", "node": "n", "seq": 1, "sent_at": 1e999}',
            "batch.sent_at: number out of range",
        ),
        (
            json.dumps(body(heartbeats=[{"rank": 1, "extra": 2}])).encode(),
            "batch.heartbeats[0]: unknown field 'extra'",
        ),
    ],
)
def test_malformed_batches_name_the_field(payload: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message.replace("[", r"\[").replace("]", r"\]")):
        AgentBatch.from_json(payload)


def test_unknown_command_kind_is_refused() -> None:
    with pytest.raises(ProtocolError, match=r"reply.commands\[0\].kind"):
        BatchReply.from_json(
            b'{"v":1,"acked_seq":1,"server_time":1.0,"commands":[{"kind":"explode"}]}'
        )


def test_conversion_to_store_reports() -> None:
    (hb,) = heartbeat_reports(batch())
    assert (hb.rank, hb.node, hb.phase, hb.step) == (2, "n1", "step", 17)
    assert hb.sent_at == datetime.fromtimestamp(T0, UTC)
    # seq orders a rank's heartbeats across agents (a spare's batches restart at 1).
    assert hb.seq == 1_800_000_000_250_000
    (st,) = step_time_reports(batch())
    assert (st.rank, st.step, st.compute_s, st.wait_s) == (2, 17, 0.2, 0.05)
    assert st.ended_at.tzinfo is UTC


_ints = st.one_of(st.integers(-(2**64), 2**64), st.sampled_from([0, -1, 2**20, 2**31, 2**62]))
_floats = st.one_of(
    st.floats(allow_nan=True), st.sampled_from([T0, 1.5e9, 4.2e9, 1e20, float("inf")])
)
_texts = st.text(max_size=70)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.builds(
        RankHeartbeat,
        _ints,
        _ints,
        _texts,
        _ints,
        _floats,
        _floats,
        st.booleans(),
        _floats,
        _ints,
        _ints,
    ),
    st.builds(RankStepTime, _ints, _ints, _floats, _floats, _floats, _texts),
)
def test_the_one_pass_bounds_check_agrees_with_the_one_that_names_the_field(
    heartbeat: RankHeartbeat, step_time: RankStepTime
) -> None:
    latest = T0 + 86_400
    assert protocol._heartbeats_fine([heartbeat], latest) == (
        protocol._heartbeat_problem(heartbeat, latest) is None
    )
    assert protocol._step_times_fine([step_time], latest) == (
        protocol._step_time_problem(step_time, latest) is None
    )
