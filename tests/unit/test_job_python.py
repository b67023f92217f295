"""`slurmft submit --python`: the job's interpreter, run here as the user before sbatch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from slurmft.cli.job_python import check_python, default_python
from slurmft.controller.spec import RunSpec, SpecError
from slurmft.core import torch_support


def test_an_interpreter_with_slurmft_and_torch_says_which_torch() -> None:
    assert check_python(sys.executable).torch == torch_support.installed_version()


def test_a_missing_interpreter_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"no such interpreter .*--python /shared/venv/bin/python"):
        check_python(str(tmp_path / "venv" / "bin" / "python"))


def _stand_in_slurmft(site: Path) -> Path:
    """A site folder whose slurmft.train imports (an empty stand-in)."""
    (site / "slurmft").mkdir(parents=True)
    (site / "slurmft" / "__init__.py").write_text("")
    (site / "slurmft" / "train.py").write_text("")
    return site


def test_an_interpreter_without_torch_is_refused_with_the_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python that imports slurmft.train (here a stand-in package) but has no torch."""
    monkeypatch.setenv("PYTHONPATH", str(_stand_in_slurmft(tmp_path / "site")))
    bare = "/usr/bin/python3"
    with pytest.raises(SpecError, match=r"No module named 'torch'.*-m pip install torch"):
        check_python(bare)


def _stand_in_torch(site: Path, version: str | None) -> None:
    """A torch package that fails when imported, with package metadata when ``version``."""
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        "__version__ = '0.0.1'\nif __import__('os').environ.get('STAND_IN_TORCH_FAILS'):\n"
        "    raise RuntimeError('stand-in torch imported')\n"
    )
    if version is not None:
        info = site / f"torch-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def test_torch_is_found_by_its_metadata_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check never pays for `import torch` (seconds of CPU; far more from a network
    filesystem): a torch whose import would fail is reported by its package metadata."""
    site = _stand_in_slurmft(tmp_path / "site")
    _stand_in_torch(site, "9.9.9+site")
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("STAND_IN_TORCH_FAILS", "1")
    assert check_python("/usr/bin/python3").torch == "9.9.9+site"


def test_a_torch_without_metadata_is_imported_for_its_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = _stand_in_slurmft(tmp_path / "site")
    _stand_in_torch(site, None)
    monkeypatch.setenv("PYTHONPATH", str(site))
    assert check_python("/usr/bin/python3").torch == "0.0.1"
    monkeypatch.setenv("STAND_IN_TORCH_FAILS", "1")
    with pytest.raises(SpecError, match="stand-in torch imported"):
        check_python("/usr/bin/python3")


def test_an_interpreter_without_slurmft_is_told_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(SpecError, match=r"-m pip install 'slurmft\[train\]'"):
        check_python("/usr/bin/python3", ["env", "-C", "/", "-u", "PYTHONPATH"])


def test_a_pyxis_image_or_a_wrapper_this_host_lacks_is_not_checked() -> None:
    assert "pyxis image" in check_python("python3", pyxis=True).warning
    skipped = check_python("python3", ["apptainer-not-installed-here", "exec", "/img.sif"])
    assert skipped.torch is None and "not installed here" in skipped.warning


def test_the_default_is_the_active_venv_then_the_conda_env(tmp_path: Path) -> None:
    venv, conda = tmp_path / "venv", tmp_path / "conda"
    for prefix in (venv, conda):
        (prefix / "bin").mkdir(parents=True)
        (prefix / "bin" / "python").write_text("")
    assert default_python({"VIRTUAL_ENV": str(venv), "CONDA_PREFIX": str(conda)}) == str(
        venv / "bin" / "python"
    )
    assert default_python({"CONDA_PREFIX": str(conda)}) == str(conda / "bin" / "python")
    assert default_python({}) == sys.executable


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"python": "python3"}, "an absolute path to the interpreter"),
        ({"env": {"A-B": "1"}}, "not a variable name"),
        ({"sbatch_args": ("--uid=0",)}, "--uid is not allowed"),
        ({"srun_args": ("--nodelist=n1",)}, "one agent on each usable node"),
        ({"apptainer": "/i.sif", "container_wrapper": "bwrap"}, "one container at a time"),
        ({"container_mounts": "/a:/a"}, "add container_image"),
        ({"container_wrapper": "bwrap 'unclosed"}, "bad container_wrapper"),
    ],
)
def test_the_spec_refuses_a_bad_environment_or_container(
    fields: dict[str, object], why: str
) -> None:
    with pytest.raises(SpecError, match=why):
        RunSpec(name="r", nodes=1, script=("t.py",), ckpt_dir="/c", **fields)  # type: ignore[arg-type]


def test_a_container_run_may_name_the_images_python() -> None:
    run = RunSpec(name="r", nodes=1, script=("t.py",), ckpt_dir="/c",
                  container_image="img", python="python3")  # fmt: skip
    assert run.in_container and run.container_options == ("--container-image=img",)


def test_the_spec_round_trips_through_the_store_with_its_lists() -> None:
    run = RunSpec(name="r", nodes=1, script=("t.py",), ckpt_dir="/c", setup=("module load x",),
                  sbatch_args=("--mail-type=END",), env={"A": "1"})  # fmt: skip
    assert RunSpec.from_dict(run.to_dict()) == run
