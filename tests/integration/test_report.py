"""`slurmft report`: a run with one rank 30% slower gives a picture whose row for that rank
stands out — checked on the plotted array and on the PNG's pixels — and the same numbers as JSON."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from slurmft.cli.app import app
from slurmft.db import Database
from slurmft.db.models import (
    Action,
    ActionKind,
    ActionStatus,
    Event,
    EventKind,
    FaultClass,
    RankHeartbeat,
    Run,
    StepTime,
    StepTimeMinute,
)
from slurmft.db.states import RunState
from slurmft.report.steps import NoStepTimes, StepPicture, load_step_picture

pytest.importorskip("matplotlib", reason="the report extra (pip install 'slurmft[report]')")

RANKS, STEPS, SLOW_RANK = 8, 60, 5
BASE_S, SLOWER = 0.10, 1.30
FLAGGED_AT_STEP = 40
T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _axes(fig: Any, label: str) -> Any:
    """One panel of the picture: "timeline", "heat" or "band"."""
    return next(ax for ax in fig.axes if ax.get_label() == label)


def _node(rank: int) -> str:
    return f"n{rank // 2}"  # two ranks per node


def _seed(database: Database, seed_run: Any) -> None:
    seed_run(database, "rs", job_id="77", nodes=4, spares=1)
    noise = random.Random(8)
    with database.session() as s:
        for step in range(STEPS):
            ended = T0 + timedelta(seconds=step)
            for rank in range(RANKS):
                compute = BASE_S * (SLOWER if rank == SLOW_RANK else 1.0)
                compute *= 1 + noise.uniform(-0.03, 0.03)
                s.add(
                    StepTime(
                        run_id="rs",
                        rank=rank,
                        step=step,
                        compute_s=compute,
                        wait_s=BASE_S * SLOWER - compute,  # everyone waits for the slowest
                        ended_at=ended,
                    )
                )
        for rank in range(RANKS):
            s.add(
                RankHeartbeat(
                    run_id="rs",
                    rank=rank,
                    node=_node(rank),
                    phase="train",
                    step=STEPS - 1,
                    seq=1,
                    sent_at=T0 + timedelta(seconds=STEPS),
                )
            )
        flagged_at = T0 + timedelta(seconds=FLAGGED_AT_STEP, milliseconds=500)
        s.add(
            Event(
                run_id="rs",
                kind=EventKind.STRAGGLER,
                fault_class=FaultClass.STRAGGLER,
                node=_node(SLOW_RANK),
                rank=SLOW_RANK,
                message="rank 5 computes 30% above its peers' median",
                occurred_at=flagged_at,
            )
        )
        s.add(
            Action(
                run_id="rs",
                kind=ActionKind.AGENT_LEAVE,
                node=_node(SLOW_RANK),
                reason="straggler leaves the run; a spare takes its place",
                status=ActionStatus.DONE,
                created_at=flagged_at,
            )
        )


@pytest.fixture
def store(database: Database, seed_run: Any) -> Database:
    _seed(database, seed_run)
    return database


def test_numbers_show_the_straggler_and_place_the_marks(store: Database) -> None:
    with store.session() as s:
        picture = load_step_picture(s, "rs")
    assert picture.ranks == list(range(RANKS))
    assert len(picture.columns) == STEPS
    assert picture.slowdown[SLOW_RANK] == pytest.approx(SLOWER, rel=0.03)
    assert all(
        picture.slowdown[r] == pytest.approx(1.0, abs=0.04) for r in range(RANKS) if r != SLOW_RANK
    )
    assert picture.median_s[10] == pytest.approx(BASE_S, rel=0.04)
    assert picture.flagged_ranks == [SLOW_RANK]
    assert picture.flags[0].step == FLAGGED_AT_STEP
    (leave,) = picture.actions
    assert (leave.kind, leave.step, leave.ranks) == ("agent_leave", FLAGGED_AT_STEP, (4, 5))


def test_picture_row_of_the_straggler_stands_out(store: Database, tmp_path: Path) -> None:
    import matplotlib.image
    import numpy as np

    from slurmft.report.plot import render

    with store.session() as s:
        picture = load_step_picture(s, "rs")
    out = tmp_path / "rs.png"
    fig = render(picture, out, threshold=0.2)

    # The data drawn: the heat map's array, row by row.
    heat = _axes(fig, "heat")
    drawn = np.asarray(heat.images[0].get_array())
    row_means = drawn.mean(axis=1)
    others = np.delete(row_means, SLOW_RANK)
    assert row_means[SLOW_RANK] / others.mean() == pytest.approx(SLOWER, rel=0.03)

    # The pixels written: the straggler's row has another colour than every other row.
    pixels = matplotlib.image.imread(out)[:, :, :3]
    height = pixels.shape[0]

    def row_colour(row: int) -> Any:
        samples = []
        for column in range(5, STEPS - 5, 5):
            if column == FLAGGED_AT_STEP:
                continue  # the flag's marker is drawn there
            x, y = heat.transData.transform((column, row))
            samples.append(pixels[round(height - y), round(x)])
        return np.median(np.array(samples), axis=0)

    colours = np.array([row_colour(r) for r in range(RANKS)])
    normal = np.median(np.delete(colours, SLOW_RANK, axis=0), axis=0)
    distance = np.linalg.norm(colours - normal, axis=1)
    assert distance[SLOW_RANK] > 0.3, distance
    assert np.delete(distance, SLOW_RANK).max() < 0.1, distance
    print(
        f"colour distance from the usual row: straggler {distance[SLOW_RANK]:.2f}, others "
        f"<= {np.delete(distance, SLOW_RANK).max():.2f}"
    )


def test_folded_minutes_fill_in_older_steps(store: Database) -> None:
    with store.session() as s:
        for rank in range(RANKS):
            s.add(
                StepTimeMinute(
                    run_id="rs",
                    rank=rank,
                    minute=T0 - timedelta(minutes=1),
                    steps=20,
                    first_step=-20,
                    last_step=-1,
                    compute_median_s=0.2 if rank == SLOW_RANK else 0.1,
                    compute_p95_s=0.2,
                    compute_total_s=2.0,
                    wait_median_s=0.0,
                    wait_p95_s=0.0,
                    wait_total_s=0.0,
                )
            )
    with store.session() as s:
        picture = load_step_picture(s, "rs", max_columns=16)
    assert picture.columns[0][0] == -20 and picture.columns[-1][1] == STEPS - 1
    assert len(picture.columns) <= 16
    assert picture.compute_s[SLOW_RANK][0] == pytest.approx(0.2)
    assert picture.compute_s[0][0] == pytest.approx(0.1)


def test_cli_json_and_png(store: Database, tmp_path: Path) -> None:
    runner = CliRunner()
    url = f"database.url={store.url.render_as_string(hide_password=False)}"
    result = runner.invoke(app, ["--set", url, "report", "rs", "--json", "--store"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["flagged_ranks"] == [SLOW_RANK]
    assert data["slowdown"][str(SLOW_RANK)] == pytest.approx(SLOWER, rel=0.03)
    assert len(data["compute_s"]) == RANKS and len(data["compute_s"][0]) == STEPS

    out = tmp_path / "picture.png"
    result = runner.invoke(app, ["--set", url, "report", "rs", "--out", str(out), "--store"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"flagged ranks: {SLOW_RANK}" in result.output


def test_a_run_without_step_times_says_why(database: Database, seed_run: Any) -> None:
    seed_run(database, "plain", job_id="78")
    with database.session() as s, pytest.raises(NoStepTimes, match=r"slurmft\.train"):
        load_step_picture(s, "plain")


def test_a_hang_leaves_a_hole_and_a_restart_a_line(store: Database, tmp_path: Path) -> None:
    """Rank 2 hangs from step 50 (no more step times), is flagged, its workers restart."""
    import matplotlib.colors
    import matplotlib.image
    import numpy as np

    from slurmft.report.plot import MISSING_COLOUR, render

    hung_from = 50
    with store.session() as s:
        s.query(StepTime).filter(StepTime.rank == 2, StepTime.step >= hung_from).delete()
        s.add(
            Event(
                run_id="rs",
                kind=EventKind.HANG,
                fault_class=FaultClass.HANG,
                node=_node(2),
                rank=2,
                message="rank 2 made no progress in train for 45 s",
                occurred_at=T0 + timedelta(seconds=55, milliseconds=500),
            )
        )
        s.add(
            Event(
                run_id="rs",
                kind=EventKind.RESTART,
                node=_node(2),
                message="workers restarted (restart 1)",
                source="agent",
                occurred_at=T0 + timedelta(seconds=57, milliseconds=500),
            )
        )
    with store.session() as s:
        picture = load_step_picture(s, "rs")
    assert picture.compute_s[2][hung_from:] == [None] * (STEPS - hung_from)
    assert picture.flagged_ranks == [2, SLOW_RANK]
    hang = next(m for m in picture.flags if m.kind == "hang")
    assert hang.step == 55 and hang.ranks == (2,)
    restart = next(m for m in picture.actions if m.kind == "restart")
    assert restart.step == 57

    out = tmp_path / "hang.png"
    fig = render(picture, out)
    heat = _axes(fig, "heat")
    pixels = matplotlib.image.imread(out)[:, :, :3]
    x, y = heat.transData.transform((hung_from + 2, 2))
    hole = pixels[round(pixels.shape[0] - y), round(x)]
    assert np.allclose(hole, matplotlib.colors.to_rgb(MISSING_COLOUR), atol=0.02), hole
    lines = [line.get_xdata()[0] for line in heat.get_lines() if line.get_linestyle() == ":"]
    assert restart.column in lines


def test_the_numbers_the_daemon_sends_draw_the_same_picture(store: Database) -> None:
    """`slurmft report` asks the daemon for the numbers (to_json) and draws them (from_json)."""
    with store.session() as s:
        picture = load_step_picture(s, "rs", max_columns=16)
    sent = StepPicture.from_json(json.loads(json.dumps(picture.to_json())))
    assert sent.slowdown == pytest.approx(picture.slowdown, abs=1e-4)
    assert replace(sent, slowdown=picture.slowdown) == picture


def test_the_timeline_marks_each_failure_where_it_happened(store: Database, tmp_path: Path) -> None:
    """Two outages, measured: the PNG has the failure colour in the pixel columns of each, in
    the timeline panel, and the time each cost is shaded by cause from its last step."""
    import matplotlib.colors
    import matplotlib.image
    import numpy as np

    from slurmft.report.plot import FAILURE_COLOUR, render

    with store.session() as s:
        run = s.get(Run, "rs")
        assert run is not None
        run.first_step_at, run.last_step_at = T0, T0 + timedelta(seconds=STEPS - 1)
        run.state = RunState.COMPLETED  # the timeline ends with its last step, not now
        for at, node in ((20, "n1"), (45, "n3")):
            s.add(Event(run_id="rs", kind=EventKind.NODE_LOST, node=node,
                        occurred_at=T0 + timedelta(seconds=at), message=f"{node} lost",
                        time_lost_s=8.0, lost_detection_s=2.0, lost_queue_wait_s=0.0,
                        lost_restart_s=4.0, lost_replay_s=2.0,
                        time_lost_estimate=False))  # fmt: skip
    with store.session() as s:
        picture = load_step_picture(s, "rs")
    assert picture.timeline is not None
    failures = picture.timeline.failures
    assert [(f.at_s, f.lost_s) for f in failures] == [(20.0, 8.0), (45.0, 8.0)]
    assert failures[0].spans == (("detection", 18.0, 20.0), ("queue_wait", 20.0, 20.0),
                                 ("restart", 20.0, 24.0), ("replay", 24.0, 26.0))  # fmt: skip
    assert {b.world_size for b in picture.timeline.bins} == {RANKS}

    out = tmp_path / "timeline.png"
    fig = render(picture, out)
    line = _axes(fig, "timeline")
    pixels = matplotlib.image.imread(out)[:, :, :3]
    height = pixels.shape[0]
    crimson = np.array(matplotlib.colors.to_rgb(FAILURE_COLOUR))
    (_, y0), (_, y1) = line.get_window_extent().get_points()
    rows = slice(round(height - y1) + 2, round(height - y0) - 2)  # inside the panel

    def has_failure_colour(column: int) -> bool:
        strip = pixels[rows, column - 1 : column + 2].reshape(-1, 3)
        return bool((np.linalg.norm(strip - crimson, axis=1) < 0.08).any())

    for failure in failures:
        x, _ = line.transData.transform((failure.at_s, 0))
        assert has_failure_colour(round(x)), f"no failure mark at {failure.at_s} s"
    quiet = {t: round(line.transData.transform((t, 0))[0]) for t in (5.0, 33.0, 55.0)}
    assert not [t for t, x in quiet.items() if has_failure_colour(x)], quiet


def test_one_huge_step_leaves_the_other_cells_their_colours(
    store: Database, tmp_path: Path
) -> None:
    import numpy as np

    from slurmft.report.plot import render

    with store.session() as s:
        picture = load_step_picture(s, "rs")
    median = float(np.median([v for row in picture.compute_s for v in row if v is not None]))
    rows = [list(row) for row in picture.compute_s]
    rows[3][30] = 100 * median  # one step of one rank a hundred times the median
    fig = render(replace(picture, compute_s=rows), tmp_path / "outlier.png")
    image = _axes(fig, "heat").images[0]
    others = [v for r, row in enumerate(rows) for c, v in enumerate(row)
              if v is not None and (r, c) != (3, 30)]  # fmt: skip
    levels = {tuple(image.cmap(image.norm(v))) for v in others}
    assert len(levels) >= 8, len(levels)
    assert image.norm(rows[3][30]) > 1  # drawn off the scale, in the "over" colour


def test_a_late_straggler_is_labelled_by_its_slow_window(store: Database) -> None:
    """Rank 1 slows to 1.6x for the last eighth of the run: its whole-run median hides it, its
    worst window does not."""
    with store.session() as s:
        for row in s.query(StepTime).filter(StepTime.rank == 1, StepTime.step >= STEPS - 8):
            row.compute_s *= 1.6
    with store.session() as s:
        picture = load_step_picture(s, "rs")
    assert picture.slowdown[1] == pytest.approx(1.0, abs=0.05)
    ratio, first, last = picture.worst_window[1]
    assert ratio == pytest.approx(1.6, rel=0.06) and last == STEPS - 1 and first >= STEPS - 16
