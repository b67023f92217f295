"""A site's sbatch/srun options (`--sbatch-arg`, `--srun-arg`): parsed as getopt_long does with
Slurm 22.05's own option table, refused where slurmft owns the option."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurmft.controller.resubmit import SubmissionError, request_from_record, submission_record
from slurmft.slurm import passthrough
from slurmft.slurm.api import SlurmBadRequest, SubmitRequest
from slurmft.slurm.commands import submit_argv
from slurmft.slurm.option_table import SBATCH_OPTIONS, SRUN_OPTIONS

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "slurm" / "22.05"


@pytest.mark.parametrize(
    ("words", "canonical"),
    [
        (["--mail-type=END"], ["--mail-type=END"]),
        (["--mail-type", "END"], ["--mail-type=END"]),  # a required value may follow
        (["--mail-t=END"], ["--mail-type=END"]),  # a unique prefix, as getopt_long takes it
        (["-d", "singleton"], ["--dependency=singleton"]),
        (["-dsingleton"], ["--dependency=singleton"]),
        (["-vQ"], ["--verbose", "--quiet"]),  # a cluster of flags
        (["--licenses=fs:1", "--begin=now+1hour"], ["--licenses=fs:1", "--begin=now+1hour"]),
    ],
)
def test_sbatch_options_come_back_in_one_canonical_form(
    words: list[str], canonical: list[str]
) -> None:
    assert list(passthrough.parse("sbatch", words).argv) == canonical


@pytest.mark.parametrize(
    ("command", "words", "why"),
    [
        ("sbatch", ["--uid=0"], "runs as the user who submits it"),
        ("sbatch", ["--ui=0"], "runs as the user who submits it"),  # an abbreviation of --uid
        ("sbatch", ["-k"], "a lost node must not end the job"),  # the short form of --no-kill
        ("sbatch", ["-A", "acct"], "its own flag for it: --account"),
        ("sbatch", ["--export=ALL"], "environment is explicit"),
        ("sbatch", ["-p", "gpu"], "--partition"),
        ("sbatch", ["--no=1"], "ambiguous: --no-kill, --no-requeue"),
        ("sbatch", ["--wrap", "id"], "the batch script is slurmft's"),
        ("sbatch", ["--gpus-per-node=8"], "every agent step gets too"),
        ("sbatch", ["train.py"], "options only"),
        ("sbatch", ["-Z"], "no option -Z"),
        ("sbatch", ["--verbose=1"], "takes no value"),
        ("sbatch", ["--begin"], "needs a value"),
        ("srun", ["--nodelist=n1"], "one agent on each usable node"),
        ("srun", ["-K"], "must not end the others"),
        ("srun", ["--ntasks-per-node=2"], "one agent per node"),
        ("srun", ["--overl"], "slurmft sets it"),  # unique prefix of --overlap
        ("srun", ["--ov"], "ambiguous"),
        ("srun", ["--export=NONE"], "environment is explicit"),
        ("srun", ["--signal=USR1"], "signals the agents itself"),
        ("srun", ["-W", "30"], "ends the step when one agent leaves"),
    ],
)
def test_what_slurmft_owns_is_refused_with_the_reason(
    command: passthrough.Command, words: list[str], why: str
) -> None:
    with pytest.raises(SlurmBadRequest, match=why):
        passthrough.parse(command, words)


def test_a_plugins_option_passes_with_a_note() -> None:
    parsed = passthrough.parse("srun", ["--container-image", "nvcr.io#pytorch", "--mpi=pmix"])
    assert parsed.argv == ("--container-image=nvcr.io#pytorch", "--mpi=pmix")
    assert "not a Slurm 22.05 option" in parsed.notes[0]


def test_every_refused_option_is_one_slurm_has() -> None:
    """A refusal of a name Slurm does not know would refuse nothing: the table is checked
    against the option table."""
    assert set(passthrough.SBATCH_REFUSED) <= set(SBATCH_OPTIONS)
    assert set(passthrough.SRUN_REFUSED) <= set(SRUN_OPTIONS)


HELP = re.compile(r"^\s+(?:-(\w), )?--([a-z][a-z0-9-]*)", re.M)


@pytest.mark.parametrize(("command", "table"), [("sbatch", SBATCH_OPTIONS), ("srun", SRUN_OPTIONS)])
def test_the_option_table_agrees_with_the_recorded_help_of_real_slurm(
    command: str, table: dict[str, tuple[str, str]]
) -> None:
    """Every option `sbatch --help` / `srun --help` of Slurm 22.05 shows (recorded from this
    machine's packages) is in the table, with its short letter."""
    shown = (FIXTURES / f"{command}_help.txt").read_text()
    found = HELP.findall(shown)
    assert len(found) > 80
    for letter, name in found:
        assert name in table, f"{command} --{name} is missing"
        assert table[name][1] == letter, f"{command} --{name}: -{letter}, not {table[name][1]!r}"


def test_the_generator_reads_slurms_option_blocks(tmp_path: Path) -> None:
    source = tmp_path / "slurm_opt.c"
    source.write_text(
        'static slurm_cli_opt_t slurm_opt_account = {\n\t.name = "account",\n'
        "\t.has_arg = required_argument,\n\t.val = 'A',\n\t.set_func = arg_set_account,\n};\n"
        'static slurm_cli_opt_t slurm_opt_wrap = {\n\t.name = "wrap",\n'
        "\t.has_arg = required_argument,\n\t.val = LONG_OPT_WRAP,\n"
        "\t.set_func_sbatch = arg_set_wrap,\n};\n"
        'static slurm_cli_opt_t slurm_opt_unlisted = {\n\t.name = "unlisted",\n'
        "\t.has_arg = no_argument,\n\t.val = 'u',\n\t.set_func = f,\n};\n"
        "static const slurm_cli_opt_t *common_options[] = {\n"
        "\t&slurm_opt_account,\n\t&slurm_opt_wrap,\n\tNULL /* END */\n};\n"
    )
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "dev" / "gen-slurm-options"),
                           str(source)], capture_output=True, text=True, check=True)  # fmt: skip
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    exec(made.stdout, tables)
    assert tables["SBATCH_OPTIONS"] == {"account": ("required", "A"), "wrap": ("required", "")}
    assert tables["SRUN_OPTIONS"] == {"account": ("required", "A")}


def test_sbatch_gets_the_sites_options_before_slurmfts_own() -> None:
    """sbatch keeps the last of an option given twice: nothing passed through comes after."""
    request = SubmitRequest(script="#!", job_name="j", run_id="r1", nodes=2,
                            sbatch_args=("--mail-t=END",), qos="hi", reservation="m")  # fmt: skip
    argv = submit_argv(request)
    assert argv[:3] == ["sbatch", "--mail-type=END", "--parsable"]
    assert {"--qos=hi", "--reservation=m"} <= set(argv)


def test_a_recorded_submission_keeps_the_options_and_is_checked_again() -> None:
    request = SubmitRequest(script="#!", job_name="j", run_id="r1", nodes=2,
                            sbatch_args=("--mail-type=END",))  # fmt: skip
    record = submission_record(request, workdir="/home/u", path="/usr/bin")
    again = request_from_record(record, ["n3"])
    assert again.sbatch_args == ("--mail-type=END",) and again.exclude == ("n3",)
    with pytest.raises(SubmissionError, match="--uid is not allowed"):
        request_from_record({**record, "sbatch_args": ["--uid=0"]}, [])
    with pytest.raises(SubmissionError):
        request_from_record({**record, "sbatch_args": "--uid=0"}, [])
