"""Pure argv builders and the batch script: what slurmft asks Slurm, and that hostile strings
stay data."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from slurmft.slurm import commands
from slurmft.slurm.api import SignalTarget, SlurmBadRequest, SubmitRequest
from slurmft.slurm.names import check_node_name
from slurmft.slurm.script import (
    check_job_name,
    check_partition,
    check_reason,
    check_signal_name,
    check_signal_spec,
    check_time_limit,
    comment_for_run,
    job_name_for,
    render_batch_script,
    run_id_from_comment,
)

HOSTILE = [
    "it's",
    'say "hi"',
    "$(touch {canary})",
    "`touch {canary}`",
    "a; touch {canary}",
    "line1\nline2",
    "*",
    "${HOME}",
    "-n",
    "",
    "back\\slash",
    "| cat /etc/passwd",
]


def request(**changes: object) -> SubmitRequest:
    fields: dict[str, object] = {
        "script": "#!/bin/bash\ntrue\n",
        "job_name": "slurmft-demo",
        "run_id": "run-42",
        "nodes": 4,
        "spare_nodes": 2,
    }
    fields.update(changes)
    return SubmitRequest(**fields)  # type: ignore[arg-type]


def test_submit_argv_defaults() -> None:
    assert commands.submit_argv(request()) == [
        "sbatch",
        "--parsable",
        "--job-name=slurmft-demo",
        "--comment=slurmft-run:run-42",
        "--nodes=6",  # N + S
        "--requeue",
        "--no-kill",
    ]


def test_submit_argv_every_option() -> None:
    argv = commands.submit_argv(
        request(
            no_kill=False,
            requeue=False,
            exclude=("n3", "n1", "n2", "n7"),
            signal="B:USR1@300",
            time_limit="1-00:00:00",
            partition="gpu",
            ntasks_per_node=1,
            cpus_per_task=4,
            output="/scratch/runs/%j.out",
            workdir="/scratch/runs",
        )
    )
    assert argv[5:] == [
        "--no-requeue",
        "--exclude=n[1-3,7]",
        "--signal=B:USR1@300",
        "--time=1-00:00:00",
        "--partition=gpu",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--output=/scratch/runs/%j.out",
        "--open-mode=append",  # a requeued job's attempts, one after another in one file
        "--chdir=/scratch/runs",
    ]


def test_a_sites_own_open_mode_stands() -> None:
    argv = commands.submit_argv(
        request(output="/scratch/runs/%j.out", sbatch_args=("--open-mode", "truncate"))
    )
    assert [word for word in argv if word.startswith("--open-mode")] == ["--open-mode=truncate"]


def test_submit_argv_site_options() -> None:
    """What a GPU site asks for; --qos and --reservation are checked here only (the local
    cluster has no slurmdbd, so sbatch refuses both there)."""
    argv = commands.submit_argv(
        request(
            gpus_per_node=8,
            gres="nvme:1",
            account="ml-team",
            qos="high",
            reservation="maint_2026",
            constraint="a100&[rack1|rack2]",
            mem="500G",
            exclusive=True,
        )
    )
    assert argv[7:] == [
        "--gpus-per-node=8",
        "--gres=nvme:1",
        "--account=ml-team",
        "--qos=high",
        "--reservation=maint_2026",
        "--constraint=a100&[rack1|rack2]",
        "--mem=500G",
        "--exclusive",
    ]


@pytest.mark.parametrize(
    "changes",
    [
        {"gres": "gpu:2 --uid=0"},
        {"account": "ml;id"},
        {"qos": "--uid=0"},
        {"constraint": "a100 --uid=0"},
        {"mem": "500G --wrap=id"},
        {"job_name": "x'; rm -rf /"},
        {"job_name": "two\nlines"},
        {"job_name": "a|b"},
        {"run_id": "run 1"},
        {"run_id": "$(id)"},
        {"exclude": ("n1,n2",)},
        {"exclude": ("n1;id",)},
        {"signal": "USR1; id"},
        {"time_limit": "1h"},
        {"partition": "a b"},
        {"output": "/tmp/a\nb"},
        {"nodes": 0},
        {"spare_nodes": -1},
    ],
)
def test_submit_refuses_unsafe_values(changes: dict[str, object]) -> None:
    with pytest.raises(SlurmBadRequest):
        commands.submit_argv(request(**changes))


def test_query_argv() -> None:
    assert commands.squeue_argv(["7", "8"]) == [
        "squeue", "--noheader", "--states=all", "--jobs=7,8", "--format=%i|%T|%r|%N|%B|%k|%j",
    ]  # fmt: skip
    assert commands.sinfo_nodes_argv(["n2", "n1"])[-1] == "--nodes=n[1-2]"
    assert commands.show_job_argv("7") == ["scontrol", "--oneliner", "show", "job", "7"]
    assert commands.squeue_steps_argv("7") == [
        "squeue", "--noheader", "--steps", "--jobs=7", "--format=%i|%N",
    ]  # fmt: skip
    assert commands.show_node_argv("n1") == ["scontrol", "--oneliner", "show", "node", "n1"]
    with pytest.raises(SlurmBadRequest):
        commands.squeue_argv(["7 8"])
    with pytest.raises(SlurmBadRequest):
        commands.show_job_argv("-1")


def test_node_actions_argv() -> None:
    reason = 'xid 79 on GPU 3 (run "a"; $(id))'
    assert commands.drain_argv("n2", reason) == [
        "scontrol", "update", "NodeName=n2", "State=DRAIN", f"Reason={reason}",
    ]  # fmt: skip
    assert commands.down_argv("n2", "gone")[3:] == ["State=DOWN", "Reason=gone"]
    assert commands.resume_argv("n2") == ["scontrol", "update", "NodeName=n2", "State=RESUME"]
    for bad_reason in ("", "two\nlines", "x" * 300):
        with pytest.raises(SlurmBadRequest):
            commands.drain_argv("n2", bad_reason)
    with pytest.raises(SlurmBadRequest):
        commands.drain_argv("n2 State=RESUME", "x")


def test_job_actions_argv() -> None:
    assert commands.requeue_argv("9") == ["scontrol", "requeue", "9"]
    assert commands.set_excluded_nodes_argv("9", ["n4", "n2"]) == [
        "scontrol", "update", "JobId=9", "ExcNodeList=n[2,4]",
    ]  # fmt: skip
    assert commands.set_excluded_nodes_argv("9", [])[-1] == "ExcNodeList="
    assert commands.cancel_argv("9") == ["scancel", "9"]


@pytest.mark.parametrize(
    ("target", "flags"),
    [(SignalTarget.STEPS, []), (SignalTarget.BATCH, ["--batch"]), (SignalTarget.ALL, ["--full"])],
)
def test_signal_argv(target: SignalTarget, flags: list[str]) -> None:
    assert commands.signal_argv("9", "USR1", target) == ["scancel", "--signal=USR1", *flags, "9"]


def test_signal_name_is_checked() -> None:
    with pytest.raises(SlurmBadRequest):
        commands.signal_argv("9", "USR1 --full", SignalTarget.STEPS)


def test_names_and_comments() -> None:
    assert job_name_for("my run: 'quoted' $(x)\n") == "slurmft-my_run___quoted____x"
    assert job_name_for("$$$") == "slurmft-run"
    assert comment_for_run("run-1") == "slurmft-run:run-1"
    assert run_id_from_comment("slurmft-run:run-1") == "run-1"
    assert run_id_from_comment("someone else's comment") is None
    assert check_reason("  padded  ") == "padded"


@pytest.mark.parametrize(
    ("check", "good"),
    [
        (check_job_name, "slurmft-demo"),
        (check_node_name, "n1"),
        (check_partition, "gpu"),
        (check_signal_name, "USR1"),
        (check_signal_spec, "B:USR1@300"),
        (check_time_limit, "1:00:00"),
        (comment_for_run, "run-1"),
        (commands.check_job_id, "42"),
    ],
)
def test_validators_refuse_a_trailing_newline(check: Callable[[str], str], good: str) -> None:
    """`$` matches before a final newline: every validator matches the whole value."""
    check(good)
    for bad in (f"{good}\n", f"{good}\r\n"):
        with pytest.raises(SlurmBadRequest):
            check(bad)
    assert run_id_from_comment("slurmft-run:run-1\n") is None
    with pytest.raises(SlurmBadRequest):
        check_time_limit("\uff11\uff12")  # full-width digits: `\d` without re.ASCII


def test_batch_script_keeps_hostile_arguments_inert(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    args = [arg.replace("{canary}", str(canary)) for arg in HOSTILE]
    env = {"RUN_NAME": "x'; touch " + str(canary) + "; '$(id)"}
    # A setup line is the user's shell code, run as written (here it expands the variable);
    # the command's words stay inert whatever they hold.
    script = render_batch_script(
        ["printf", "%s\\0", *args], env=env, setup=['printf "%s\\0" "$RUN_NAME"']
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split("\0")[:-1] == [env["RUN_NAME"], *args]
    assert not canary.exists()
    printed_env = subprocess.run(
        ["bash", "-c", render_batch_script(["printenv", "RUN_NAME"], env=env)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert printed_env.stdout == env["RUN_NAME"] + "\n"
    assert not canary.exists()


def test_batch_script_refuses_bad_env_names() -> None:
    with pytest.raises(SlurmBadRequest):
        render_batch_script(["true"], env={"A;B": "x"})
    with pytest.raises(SlurmBadRequest):
        render_batch_script([])
