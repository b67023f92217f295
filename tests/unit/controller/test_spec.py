from __future__ import annotations

from pathlib import Path

import pytest

from slurmft.controller.spec import RunSpec, SpecError

GOOD = {
    "name": "llama",
    "nodes": 3,
    "script": ["train.py", "--lr", "0.1"],
    "ckpt_dir": "/shared/llama",
}


def test_defaults_and_round_trip() -> None:
    spec = RunSpec.from_dict(GOOD)
    assert (spec.spares, spec.workers_per_node, spec.time_limit) == (1, 1, None)
    assert spec.step_gres == "" and not spec.asks_for_gpus
    assert RunSpec.from_dict(spec.to_dict()) == spec


def test_site_options_are_kept_and_gpus_default_the_workers_to_one_per_gpu() -> None:
    site = {
        "gpus_per_node": 8, "account": "ml", "qos": "high", "constraint": "a100&ib",
        "mem": "500G", "exclusive": True, "reservation": "maint", "cpus_per_task": 96,
    }  # fmt: skip
    spec = RunSpec.from_dict({**GOOD, **site})
    assert spec.workers_per_node == "gpu" and spec.step_gres == "gpu:8"
    assert spec.site_options() == {**{k: v for k, v in site.items() if k != "cpus_per_task"},
                                   "gres": None}  # fmt: skip
    assert RunSpec.from_dict(spec.to_dict()) == spec  # stored with the run, replayed as it is
    typed = RunSpec.from_dict({**GOOD, "gres": "gpu:h100:4", "nproc_per_node": 2})
    assert (typed.step_gres, typed.workers_per_node) == ("gpu:h100:4", 2)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"nproc_per_node": "gpu"}, "gpu needs GPUs"),
        ({"nproc_per_node": "four"}, "bad nproc_per_node"),
        ({"gpus_per_node": 0}, "bad gpus_per_node"),
        ({"gres": "gpu:2;id"}, "bad gres"),
        ({"account": "a b"}, "bad account"),
        ({"constraint": "a100$(id)"}, "bad constraint"),
        ({"mem": "lots"}, "bad mem"),
        ({"exclusive": "yes"}, "bad exclusive"),
    ],
)
def test_bad_site_options_are_refused_before_slurm(change: dict[str, object], needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        RunSpec.from_dict({**GOOD, **change})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"nodes": 0}, "bad nodes: 0"),
        ({"nodes": "3"}, "bad nodes: '3' is not int"),
        ({"nodes": True}, "bad nodes"),
        ({"spares": -1}, "bad spares"),
        ({"ckpt_dir": "ckpt"}, "absolute path"),
        ({"script": []}, "bad script: missing"),
        ({"script": ["train.py", 3]}, "bad script"),
        ({"time_limit": "two days"}, "bad time_limit"),
        ({"name": "my run; rm -rf /"}, "bad name"),
        ({"env": {"A": 1}}, "bad env"),
        ({"gpus": 8}, "unknown field 'gpus'"),  # it is gpus_per_node
    ],
)
def test_bad_specs_name_the_field(change: dict[str, object], needle: str) -> None:
    with pytest.raises(SpecError) as info:
        RunSpec.from_dict({**GOOD, **change})
    assert needle in str(info.value)


@pytest.mark.parametrize("limit", ["90", "1:30:00", "2-00:00:00", "2-00:00"])
def test_slurm_time_limits(limit: str) -> None:
    assert RunSpec.from_dict({**GOOD, "time_limit": limit}).time_limit == limit


def test_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'name = "llama"\nnodes = 4\nspares = 2\nscript = ["-m", "pkg.train"]\n'
        'ckpt_dir = "/shared/x"\n[env]\nNCCL_DEBUG = "WARN"\n'
    )
    spec = RunSpec.from_toml(path)
    assert (spec.nodes, spec.spares, spec.script, spec.env) == (
        4,
        2,
        ("-m", "pkg.train"),
        {"NCCL_DEBUG": "WARN"},
    )
    path.write_text("nodes = [")
    with pytest.raises(SpecError, match="not valid TOML"):
        RunSpec.from_toml(path)
    with pytest.raises(SpecError, match="does not exist"):
        RunSpec.from_toml(tmp_path / "absent.toml")
    path.write_text('name = "x"\n')
    with pytest.raises(SpecError, match=r"missing 2 required .*'nodes' and 'ckpt_dir'"):
        RunSpec.from_toml(path)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        # `$` matches before a final newline: these passed and broke the table output.
        ({"name": "llama\n"}, "bad name: 'llama\\n'"),
        ({"time_limit": "60\n"}, "bad time_limit: '60\\n'"),
        ({"time_limit": "1:00:00\n"}, "bad time_limit"),
        ({"time_limit": "\uff11\uff12"}, "bad time_limit"),  # full-width digits are \d too
        # A byte that is not UTF-8 in an argument reaches Python as a lone surrogate.
        ({"script": ["tr\udcffain.py"]}, "bad script: 'tr\\udcffain.py' is not valid UTF-8"),
        ({"ckpt_dir": "/shared/\udce9t\u00e9"}, "bad ckpt_dir"),
        ({"env": {"NCCL_DEBUG": "WARN\udcff"}}, "bad env"),
        ({"script": ["train.py", "a\x00b"]}, "contains a NUL"),
        # Counts beyond any cluster: a spec error, not a database overflow.
        ({"nodes": 10**30}, "bad nodes: a number of 100 bits"),
        ({"nodes": 10**5000}, "bad nodes"),  # too long for str(): still a clear message
        ({"nodes": 70_000}, "at most 65536"),
        ({"spares": 2**63}, "bad spares"),
        ({"nproc_per_node": 2**64}, "bad nproc_per_node"),
        ({"save_lead_s": 10**12}, "bad save_lead_s"),
    ],
)
def test_hostile_values_are_spec_errors_naming_the_field(
    change: dict[str, object], needle: str
) -> None:
    with pytest.raises(SpecError) as info:
        RunSpec.from_dict({**GOOD, **change})
    assert needle in str(info.value)
    assert len(str(info.value)) < 400
