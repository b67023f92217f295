"""`slurmft simulate` and `slurmft plan` as a user runs them."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli


@pytest.mark.parametrize("gpus", [512, 2048, 16384])
def test_plan_answers_at_every_size(capsys: pytest.CaptureFixture[str], gpus: int) -> None:
    code, out, err = run_cli(capsys, "plan", "--gpus", str(gpus), "--days", "1", "--seeds", "2",
                          "--json")  # fmt: skip
    assert code == 0, err
    plan = json.loads(out)
    nodes = gpus // 8
    assert plan["nodes"] == nodes
    # Young's interval for the table's rate: sqrt(2 x 0.78 s x MTBF), MTBF shrinking with size.
    mtbf = 3600 / (419 / (54 * 24 * 2048) * nodes)
    assert plan["mtbf_s"] == pytest.approx(mtbf)
    assert plan["young_interval_s"] == pytest.approx((2 * 0.78 * mtbf) ** 0.5)
    recommended = plan["recommended"]
    assert recommended["spares"] in [c["spares"] for c in plan["spare_choices"]]
    intervals = [c["interval_s"] for c in plan["interval_choices"]]
    assert recommended["checkpoint_interval_s"] in intervals
    assert 0.9 < recommended["ettr"]["mean"] <= 1.0
    # Spares are chosen by goodput: none beats the recommendation.
    best = max(c["goodput"]["mean"] for c in plan["spare_choices"])
    chosen = next(c for c in plan["spare_choices"] if c["spares"] == recommended["spares"])
    assert chosen["goodput"]["mean"] == best


def test_simulate_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "simulate", "--gpus", "1024", "--days", "2", "--seeds", "3",
                          "--spares", "0,4", "--workers", "1")  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("1,024 GPUs (128 nodes), 2 days, 3 seeds")
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        (s, n) for s in ("requeue", "in_job", "ladder") for n in ("0", "4")
    ]


def test_any_input_can_be_set(capsys: pytest.CaptureFixture[str]) -> None:
    def ettr(*extra: str) -> float:
        argv = ["simulate", "--gpus", "2048", "--days", "2", "--seeds", "3",
                "--strategies", "ladder", "--spares", "2", "--json", *extra]  # fmt: skip
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, err
        return float(json.loads(out)["table"][0]["ettr"]["mean"])

    slow = ettr("--input", "spare_swap_s=900", "--input", "job_startup_s=1800")
    assert slow < ettr() - 0.005  # slower recovery paths cost ETTR


def test_simulate_json_and_meta_like(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "simulate", "--gpus", "1024", "--days", "1", "--seeds", "2",
                          "--meta-like", "--json")  # fmt: skip
    assert code == 0, err
    table = json.loads(out)["table"]
    assert [(r["strategy"], r["spares"]) for r in table] == [("requeue", 0)]
    assert table[0]["checkpoint_cost_s"] == 3.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--gpus", "100"], "--gpus 100 is not a whole number of 8-GPU nodes"),
        (["simulate", "--strategies", "ladder,magic"], "--strategies: choose from"),
        (["simulate", "--strategies", ","], "--strategies: choose from"),
        (["simulate", "--spares", "0,x"], "--spares: expected comma-separated whole numbers"),
        (["plan"], "Missing option '--gpus'"),
        (["simulate", "--input", "warp_s=3"], "expected NAME=NUMBER with NAME one of"),
        (["simulate", "--input", "spare_swap_s=fast"], "'fast' is not a number"),
        (["plan", "--gpus", "64", "--input", "poll_s=0"], "must be a finite number > 0"),
    ],
)
def test_bad_input_is_one_clear_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code != 0
    assert message in err + out
    assert "Traceback" not in err
