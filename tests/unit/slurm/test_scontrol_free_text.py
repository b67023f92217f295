"""Free text that users set (job name, comment, workdir, output paths) holds scontrol's own keys.

Replayed through real output recorded on 22.05 (tests/fixtures/slurm/record.py, `hostile`): the
names and comments hold every key `scontrol show job` prints, with `=`, `[`, spaces and a
newline. Each job was recorded by scontrol and by squeue (SQUEUE_FORMAT) at the same moment:
the two must agree on every field the daemon decides by.
"""

from __future__ import annotations

import pytest
from support.slurm_recordings import load_recording

from slurmft.slurm.api import JobInfo, SlurmError
from slurmft.slurm.parse import job_from_scontrol, parse_scontrol_records, parse_squeue
from slurmft.slurm.states import JobState

DECIDED_BY = ("job_id", "state", "nodes", "batch_host", "name", "reason")


def scontrol_and_squeue(name: str) -> tuple[JobInfo, JobInfo]:
    (record,) = parse_scontrol_records(load_recording(f"show_job_{name}").stdout)
    (row,) = parse_squeue(load_recording(f"squeue_{name}").stdout).values()
    return job_from_scontrol(record), row


def fields(job: JobInfo, names: tuple[str, ...]) -> dict[str, object]:
    return {name: getattr(job, name) for name in names}


def test_a_held_job_named_and_commented_with_every_key_reads_as_squeue_says() -> None:
    shown, listed = scontrol_and_squeue("hostile_text_held")
    assert (
        "JobState=COMPLETED" in shown.name and "\n" in shown.name and "NodeList=a[[" in shown.name
    )
    assert fields(shown, (*DECIDED_BY, "comment")) == fields(listed, (*DECIDED_BY, "comment"))
    assert (shown.state, shown.nodes, shown.restarts) == (JobState.PENDING, (), 0)
    assert shown.user_id == 0 and shown.raw["WorkDir"] == "/work/main"


def test_a_running_job_with_keys_in_its_paths_too_reads_as_squeue_says() -> None:
    shown, listed = scontrol_and_squeue("hostile_text")
    assert fields(shown, DECIDED_BY) == fields(listed, DECIDED_BY)
    assert (shown.state, shown.nodes, shown.batch_host) == (JobState.RUNNING, ("n1",), "n1")
    # Its workdir holds ` Comment=`, so its comment reads either way (docs/slurm.md): the job's
    # own text, which its owner may set to anything anyway.
    assert shown.comment.endswith(f" Comment={listed.comment}")


def test_a_name_that_holds_a_whole_record_is_refused() -> None:
    """The name holds the job's own keys from UserId on, in order, with JobState=COMPLETED and
    NodeList=n9: no reader can tell which run of keys is the real one."""
    stdout = load_recording("show_job_hostile_whole_run").stdout
    assert " JobState=COMPLETED " in stdout and " NodeList=n9 " in stdout
    with pytest.raises(SlurmError, match="more than one reading"):
        job_from_scontrol(parse_scontrol_records(stdout)[0])


def test_a_newline_in_a_name_does_not_start_a_record() -> None:
    """Slurm 22.05 prints a newline in a name as it is (measured): the output of one job id is
    one record, even where a line of it starts with `JobId=`, and even when the text before
    that newline holds a complete record."""
    line = load_recording("show_job_running").stdout.rstrip("\n")
    name_at, rest_at = line.index(" JobName=") + 9, line.index(" UserId=")
    forged = line[rest_at:].replace("JobState=RUNNING", "JobState=COMPLETED")
    for name in ("a\nJobId=7 JobName=b", f"x{forged}\nJobId=7 JobName=b"):
        stdout = line[:name_at] + name + line[rest_at:] + "\n"
        if "COMPLETED" in name:
            with pytest.raises(SlurmError):
                parse_scontrol_records(stdout)
            continue
        (record,) = parse_scontrol_records(stdout)
        job = job_from_scontrol(record)
        assert (job.name, job.state, job.job_id) == (name, JobState.RUNNING, line[6:].split()[0])


def test_unreadable_values_are_slurm_errors() -> None:
    record = parse_scontrol_records(load_recording("show_job_running").stdout)[0]
    for key, value in (("Restarts", "x"), ("NodeList", "a[["), ("ExcNodeList", "n[9")):
        with pytest.raises(SlurmError, match=key):
            job_from_scontrol({**record, key: value})


def test_squeue_rows_with_newlines_and_forged_rows() -> None:
    shown = parse_squeue("7|RUNNING|None|n1|n1|c\nd|a\nJobId=8 JobName=b\n")["7"]
    assert (shown.comment, shown.name) == ("c\nd", "a\nJobId=8 JobName=b")
    with pytest.raises(SlurmError, match="twice"):
        parse_squeue("7|RUNNING|None|n1|n1|c|a\n7|COMPLETED|None|n9|n9|c|b\n")
