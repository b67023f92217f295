"""The shipped alert rules and Grafana dashboard, checked with Prometheus' own promtool against a
real scrape of the daemon.

From the scrape, every series becomes a promtool input series, as Prometheus would store it
(its target labels `job` and `instance` added; a metric label that clashes with them renamed
`exported_…`), holding its scraped value for three hours: a healthy site. Each alert then gets a
test of its own in which one series is changed to its condition: that alert, and no other,
fires. Every dashboard expression is wrapped as the alert ``count(EXPR) > 0``, which fires when
the expression returns anything: on the healthy series, each must.

promtool compares an alert's annotations too, expanded; the tests run on a copy of the rules
without them (`promtool check rules` checks their templates on the shipped file).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "monitoring" / "prometheus" / "slurmft-alerts.yml"
DASHBOARD = ROOT / "monitoring" / "grafana" / "slurmft.json"
TARGET = {"job": "slurmft", "instance": "login1:9464"}
SAMPLES = 180  # one a minute: three hours
EVAL_AT = "175m"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (scripts/test installs Debian's prometheus)")
    return found


def run_promtool(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [promtool(), *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _selector(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _constant(value: float) -> str:
    shown = "NaN" if math.isnan(value) else repr(value)
    return f"{shown}x{SAMPLES - 1}"


def _rising(start: float, per_minute: float) -> str:
    return f"{start}+{per_minute}x{SAMPLES - 1}"


@dataclass
class Series:
    """The input series of one promtool test: selector -> values."""

    values: dict[str, str] = field(default_factory=dict)

    def set(self, name: str, values: str, **labels: str) -> None:
        self.values[_selector(name, {**labels, **TARGET})] = values

    def to_yaml(self) -> list[dict[str, str]]:
        return [{"series": s, "values": v} for s, v in sorted(self.values.items())]


def healthy(scrape: str) -> Series:
    """The scrape as three hours of a healthy site: every value held, the clock-like ones
    moving with time, nothing failing."""
    series = Series()
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            labels = {
                (f"exported_{k}" if k in TARGET else k): v for k, v in sample.labels.items()
            }
            series.set(sample.name, _constant(sample.value), **labels)
    series.set("up", _constant(1))
    series.set("slurmft_last_control_pass_timestamp_seconds", _rising(0, 60))
    series.set("slurmft_run_wall_seconds_total", _rising(0, 60))  # one run, training
    series.set("slurmft_outages_unmeasured", _constant(0))
    series.set("slurmft_live_run_effective_ratio_min", _constant(0.99))
    return series


def _buckets(name: str, scrape: str, above: float, **labels: str) -> dict[str, str]:
    """A histogram's series where every new observation lands above ``above``."""
    changed = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name != f"{name}_bucket" or any(
                sample.labels.get(k) != v for k, v in labels.items()
            ):
                continue
            le = float(sample.labels["le"])
            changed[_selector(sample.name, {**sample.labels, **TARGET})] = (
                _rising(sample.value, 1) if le > above else _constant(sample.value)
            )
    assert changed, f"no {name} buckets in the scrape"
    return changed


def firing_conditions(scrape: str) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """Each alert: the series that make it fire, and the labels it then fires with."""
    page, warning = {"severity": "page", **TARGET}, {"severity": "warning", **TARGET}

    def one(name: str, values: str, **labels: str) -> dict[str, str]:
        return {_selector(name, {**labels, **TARGET}): values}

    return {
        "SlurmftDaemonDown": (one("up", _constant(0)), page),
        "SlurmftControlLoopStalled": (
            one("slurmft_last_control_pass_timestamp_seconds", _constant(0)),
            page,
        ),
        "SlurmftStoreDown": (one("slurmft_store_up", _constant(0)), page),
        "SlurmftSlurmCommandsFailing": (
            one(
                "slurmft_slurm_command_errors_total",
                _rising(0, 60),
                command="squeue",
                error="timeout",
            ),
            warning,
        ),
        "SlurmftSchedulerSkippingJobs": (
            one(
                "slurmft_scheduler_jobs_skipped_total",
                _rising(0, 1),
                exported_job="control",
                reason="busy",
            ),
            {**warning, "exported_job": "control", "reason": "busy"},
        ),
        "SlurmftRunStoppedAtCap": (
            one("slurmft_runs", f"0x{SAMPLES - 11} 1x10", state="stopped"),
            {**warning, "state": "stopped"},
        ),
        "SlurmftRunHeld": (one("slurmft_runs_held", _constant(1)), warning),
        "SlurmftDrainNotDone": (
            one("slurmft_drains_total", _rising(0, 1), status="skipped"),
            {**warning, "status": "skipped"},
        ),
        "SlurmftLowGoodput": (
            one("slurmft_time_lost_seconds_total", _rising(0, 30), cause="restart"),
            warning,
        ),
        "SlurmftLiveRunLowGoodput": (
            one("slurmft_live_run_effective_ratio_min", _constant(0.5)),
            warning,
        ),
        "SlurmftSlowRecovery": (
            _buckets("slurmft_recovery_seconds", scrape, 900, kind="node_lost"),
            warning,
        ),
        "SlurmftSlowDetection": (
            _buckets("slurmft_detection_latency_seconds", scrape, 120, kind="node_lost"),
            warning,
        ),
        "SlurmftOutagesUnmeasured": (
            one("slurmft_outages_unmeasured", _constant(2)),
            {"severity": "info", **TARGET},
        ),
    }


def alert_names() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["alert"] for group in rules["groups"] for r in group["rules"] if "alert" in r]


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title and target, expression) of every Grafana target."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def dashboard_rules() -> dict[str, Any]:
    return {
        "groups": [
            {
                "name": "slurmft-dashboard",
                "rules": [
                    {"alert": f"DashboardTarget{i}", "expr": f"count({expr}) > 0",
                     "labels": {"panel": title}}
                    for i, (title, expr) in enumerate(dashboard_expressions())
                ],
            }
        ]
    }  # fmt: skip


def rules_without_annotations() -> dict[str, Any]:
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    return rules


def _expected(fired: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    return [
        {
            "eval_time": EVAL_AT,
            "alertname": name,
            "exp_alerts": [{"exp_labels": fired[name]}] if name in fired else [],
        }
        for name in alert_names()
    ]


def rule_tests(scrape: str, workdir: Path) -> str:
    """Writes the promtool test file (and the dashboard's rules) under ``workdir``, runs
    `promtool test rules`, and returns its output."""
    dashboard_file = workdir / "dashboard-rules.yml"
    dashboard_file.write_text(yaml.safe_dump(dashboard_rules()))
    run_promtool("check", "rules", str(ALERTS), str(dashboard_file))
    alerts_file = workdir / "alerts-without-annotations.yml"
    alerts_file.write_text(yaml.safe_dump(rules_without_annotations()))
    base = healthy(scrape)
    conditions = firing_conditions(scrape)
    assert set(conditions) == set(alert_names()), "every shipped alert needs its test here"
    dashboard_fires = [
        {"eval_time": EVAL_AT, "alertname": f"DashboardTarget{i}",
         "exp_alerts": [{"exp_labels": {"panel": title}}]}
        for i, (title, _) in enumerate(dashboard_expressions())
    ]  # fmt: skip
    tests = [
        {
            "name": "a healthy site: no alert, and every dashboard expression has data",
            "interval": "1m",
            "input_series": base.to_yaml(),
            "alert_rule_test": [*_expected({}), *dashboard_fires],
        }
    ]
    for name, (changed, labels) in conditions.items():
        series = Series(dict(base.values) | changed)
        tests.append(
            {
                "name": f"{name} fires for its condition, and no other alert does",
                "interval": "1m",
                "input_series": series.to_yaml(),
                "alert_rule_test": _expected({name: labels}),
            }
        )
    test_file = workdir / "slurmft-rules-test.yml"
    test_file.write_text(
        yaml.safe_dump({"rule_files": [str(alerts_file), str(dashboard_file)], "tests": tests})
    )
    return run_promtool("test", "rules", str(test_file))
