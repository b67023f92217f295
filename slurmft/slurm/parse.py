"""Pure parsers for the text the Slurm commands print (formats chosen in commands.py).

Tested on output recorded from the real commands (tests/fixtures/slurm/).
"""

from __future__ import annotations

import re

from slurmft.slurm.api import JobInfo, NodeInfo, SlurmError
from slurmft.slurm.commands import SINFO_FIELDS, SQUEUE_FIELDS
from slurmft.slurm.hostlist import expand
from slurmft.slurm.states import parse_job_state, parse_node_state

# Slurm's spellings of "nothing here".
_EMPTY = {"(null)", "n/a", "N/A", "None", "none", "(None)"}

# `scontrol -o` prints `Key=value` pairs separated by spaces, but values may hold spaces
# (Command=, Reason=, OS=). A key starts after whitespace with a capital letter: Slurm's keys do
# (AllocNode:Sid, CPUs/Task, MCS_label), while free text such as a drain reason is taken as part
# of the value unless it contains ` Capitalized=`. slurmft's own names and comments never do.
_SCONTROL_KEY = re.compile(r"(?:^|(?<=\s))([A-Z][A-Za-z0-9_/:.]*)=")
# A node's Reason ends with `[user@2026-11-29T11:07:08]`: that, not the next `Key=`, ends it, so a
# drain reason may hold any text.
_BOUNDED_NODE_VALUES = {
    "Reason": re.compile(r"\s?\[[^\[\]@]*@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\]"),
}
_OWNER = re.compile(r"[^()\s]*\((\d+)\)")  # UserId=alice(1001)
_REASON_SUFFIX = re.compile(r"^(?P<text>.*?)\s*\[(?P<user>[^@\]]*)@(?P<time>[^\]]*)\]$")


def blank(value: str) -> str:
    value = value.strip()
    return "" if value in _EMPTY else value


def parse_sbatch_parsable(stdout: str) -> str:
    """`sbatch --parsable` prints `<job id>` or `<job id>;<cluster>`."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    job_id = line.split(";")[0].strip()
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {stdout!r}")
    return job_id


def parse_squeue(stdout: str) -> dict[str, JobInfo]:
    jobs: dict[str, JobInfo] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        values = line.split("|", len(SQUEUE_FIELDS) - 1)
        if len(values) != len(SQUEUE_FIELDS):
            raise SlurmError(f"unexpected squeue line: {line!r}")
        row = dict(zip(SQUEUE_FIELDS, values, strict=True))
        jobs[row["job_id"]] = JobInfo(
            job_id=row["job_id"],
            state=parse_job_state(row["state"]),
            reason=blank(row["reason"]),
            nodes=tuple(expand(blank(row["nodes"]))),
            batch_host=blank(row["batch_host"]),
            name=row["name"],
            comment=blank(row["comment"]),
            raw=row,
        )
    return jobs


def parse_squeue_steps(stdout: str) -> dict[str, tuple[str, ...]]:
    """`squeue --steps` in STEPS_FORMAT: {step id: the nodes it was launched on}."""
    steps: dict[str, tuple[str, ...]] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        step_id, sep, nodes = line.strip().partition("|")
        if not sep or "." not in step_id:
            raise SlurmError(f"unexpected squeue --steps line: {line!r}")
        steps[step_id] = tuple(expand(blank(nodes)))
    return steps


def parse_scontrol_records(stdout: str) -> list[dict[str, str]]:
    """`scontrol -o show job|node`: one record per line, `Key=value` pairs."""
    records = []
    for line in stdout.splitlines():
        if line.strip():
            records.append(parse_scontrol_line(line.strip()))
    return records


def parse_scontrol_line(line: str) -> dict[str, str]:
    matches = list(_SCONTROL_KEY.finditer(line))
    record: dict[str, str] = {}
    bounded_values = _BOUNDED_NODE_VALUES if line.startswith("NodeName=") else {}
    index = 0
    while index < len(matches):
        match = matches[index]
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        terminator = bounded_values.get(match.group(1))
        bounded = terminator.search(line, match.end()) if terminator else None
        if bounded is not None:
            # The value runs to its own terminator, whatever `Key=` text a user put inside it.
            end = bounded.end()
            while index + 1 < len(matches) and matches[index + 1].start() < end:
                index += 1
        # The first occurrence wins: a key repeated inside later free text cannot override it.
        record.setdefault(match.group(1), line[match.end() : end].strip())
        index += 1
    return record


def job_from_scontrol(record: dict[str, str]) -> JobInfo:
    requeue = record.get("Requeue")
    return JobInfo(
        job_id=record["JobId"],
        state=parse_job_state(record.get("JobState", "")),
        reason=blank(record.get("Reason", "")),
        nodes=tuple(expand(blank(record.get("NodeList", "")))),
        batch_host=blank(record.get("BatchHost", "")),
        name=record.get("JobName", ""),
        comment=blank(record.get("Comment", "")),
        restarts=int(record.get("Restarts", "0") or 0),
        excluded_nodes=tuple(expand(blank(record.get("ExcNodeList", "")))),
        exit_code=record.get("ExitCode", ""),
        requeue=None if requeue is None else requeue == "1",
        user_id=_owner_uid(record.get("UserId", "")),
        raw=record,
    )


def _owner_uid(user_id: str) -> int | None:
    """`root(0)` -> 0; None for anything else (a field Slurm left out or changed)."""
    match = _OWNER.fullmatch(user_id)
    return int(match.group(1)) if match else None


def parse_sinfo_nodes(stdout: str) -> dict[str, NodeInfo]:
    """`sinfo -N` lists a node once per partition: the first line per node is kept."""
    nodes: dict[str, NodeInfo] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        values = line.split("|", len(SINFO_FIELDS) - 1)
        if len(values) != len(SINFO_FIELDS):
            raise SlurmError(f"unexpected sinfo line: {line!r}")
        row = dict(zip(SINFO_FIELDS, values, strict=True))
        if row["name"] in nodes:
            continue
        nodes[row["name"]] = NodeInfo(
            name=row["name"],
            status=parse_node_state(row["state"]),
            reason=blank(row["reason"]),
            reason_user=blank(row["reason_user"]) if blank(row["reason"]) else "",
            reason_time=blank(row["reason_time"]) if blank(row["reason"]) else "",
            raw=row,
        )
    return nodes


def node_from_scontrol(record: dict[str, str]) -> NodeInfo:
    """`Reason=Not responding [root@2026-11-29T11:07:08]`: user and time split off the text."""
    reason, user, when = blank(record.get("Reason", "")), "", ""
    match = _REASON_SUFFIX.match(reason)
    if match:
        reason, user, when = match.group("text"), match.group("user"), match.group("time")
    return NodeInfo(
        name=record["NodeName"],
        status=parse_node_state(record.get("State", "")),
        reason=reason,
        reason_user=user,
        reason_time=when,
        raw=record,
    )
