"""Pure parsers for the text the Slurm commands print (formats chosen in commands.py).

Tested on output recorded from the real commands (tests/fixtures/slurm/).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from slurmft.slurm.api import JobInfo, NodeInfo, SlurmError
from slurmft.slurm.commands import SINFO_FIELDS, SQUEUE_FIELDS
from slurmft.slurm.hostlist import HostlistError, expand
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
# A squeue row starts with a job id (`12`, `12_3`, `12+1`) and a state (SQUEUE_FORMAT).
_SQUEUE_ROW_START = re.compile(r"\d+(?:[_+]\d+)?\|[A-Z_]+\|")
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
    """Lines in SQUEUE_FORMAT. Slurm 22.05 prints a name or comment as it is, newlines included:
    a line that does not start like a job's (`<id>|<STATE>|`) goes on the line before it."""
    rows: list[str] = []
    for line in stdout.splitlines():
        if rows and not _SQUEUE_ROW_START.match(line):
            rows[-1] += "\n" + line
        elif line.strip():
            rows.append(line)
    jobs: dict[str, JobInfo] = {}
    for line in rows:
        values = line.split("|", len(SQUEUE_FIELDS) - 1)
        if len(values) != len(SQUEUE_FIELDS):
            raise SlurmError(f"unexpected squeue line: {line!r}")
        row = dict(zip(SQUEUE_FIELDS, values, strict=True))
        if row["job_id"] in jobs:
            # A second row for one job: a name or comment that holds a whole row of its own.
            raise SlurmError(f"squeue printed job {row['job_id']} twice")
        try:
            nodes = tuple(expand(blank(row["nodes"])))
        except HostlistError as error:
            raise SlurmError(f"unexpected squeue line: {line!r}") from error
        jobs[row["job_id"]] = JobInfo(
            job_id=row["job_id"],
            state=parse_job_state(row["state"]),
            reason=blank(row["reason"]),
            nodes=nodes,
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
    """`scontrol -o show job <id>|node|step`: `Key=value` records, one a line.

    Not for job records: Slurm 22.05 prints a job's free text (JobName, Comment, ...) as it is,
    newlines included, so a line of a job's output may start with `JobId=` inside a name. slurmft
    asks about one job that is no array or het job, which Slurm prints as one record: the whole
    output is that record. (A record "ends where the next line starts with JobId=" would not do:
    a name can hold a complete record of its own before its newline.)
    """
    text = stdout.rstrip("\n")
    if text.startswith("JobId="):
        return [parse_scontrol_line(text)]
    return [parse_scontrol_line(line.strip()) for line in stdout.splitlines() if line.strip()]


def parse_scontrol_line(line: str) -> dict[str, str]:
    if line.startswith("JobId="):
        return _parse_job_record(line.rstrip("\n"))
    return _parse_key_values(line)


def _parse_key_values(line: str) -> dict[str, str]:
    """Nodes and steps: `Key=value` pairs, a value running to the next ` Capitalized=`."""
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


# A job record of `scontrol -o show job` in Slurm 22.05 (slurm_sprint_job_info): every key in a
# fixed order, separated by one space. Users set many values to any text, spaces, `Key=` and
# newlines included (measured on 22.05 with sbatch: --job-name, --comment, --account,
# --mcs-label, --network, --cluster-constraint, --chdir, --output/--error/--input, --bb,
# --mail-user), so ` JobState=` may stand inside a name. Such a value ends only where the keys
# that follow it in this order do. A TOKEN value is one that Slurm prints with no whitespace
# (numbers, times, states, host lists, a QOS; Reason has its spaces turned into `_`); TEXT is
# any text. Optional keys are printed only sometimes (an array job's ids, BatchHost once started,
# ...). StdErr, StdIn and StdOut are printed exactly when BatchFlag is not 0.
_TOKEN, _TEXT = False, True
_REQUIRED, _OPTIONAL = False, True
_JOB_LAYOUT: tuple[tuple[str, bool, bool], ...] = (
    ("JobId", _TOKEN, _REQUIRED),
    ("ArrayJobId", _TOKEN, _OPTIONAL),
    ("ArrayTaskId", _TOKEN, _OPTIONAL),
    ("ArrayTaskThrottle", _TOKEN, _OPTIONAL),
    ("HetJobId", _TOKEN, _OPTIONAL),
    ("HetJobOffset", _TOKEN, _OPTIONAL),
    ("HetJobIdSet", _TOKEN, _OPTIONAL),
    ("JobName", _TEXT, _REQUIRED),
    ("UserId", _TOKEN, _REQUIRED),
    ("GroupId", _TOKEN, _REQUIRED),
    ("MCS_label", _TEXT, _REQUIRED),
    ("Priority", _TOKEN, _REQUIRED),
    ("Nice", _TOKEN, _REQUIRED),
    ("Account", _TEXT, _REQUIRED),
    ("QOS", _TOKEN, _REQUIRED),  # a QOS that exists (names without spaces), or (null)
    ("WCKey", _TEXT, _OPTIONAL),
    ("JobState", _TOKEN, _REQUIRED),
    ("Reason", _TOKEN, _REQUIRED),
    ("Dependency", _TEXT, _REQUIRED),
    ("Requeue", _TOKEN, _REQUIRED),
    ("Restarts", _TOKEN, _REQUIRED),
    ("BatchFlag", _TOKEN, _REQUIRED),
    ("Reboot", _TOKEN, _REQUIRED),
    ("ExitCode", _TOKEN, _REQUIRED),
    ("DerivedExitCode", _TOKEN, _OPTIONAL),
    ("RunTime", _TOKEN, _REQUIRED),
    ("TimeLimit", _TOKEN, _REQUIRED),
    ("TimeMin", _TOKEN, _REQUIRED),
    ("SubmitTime", _TOKEN, _REQUIRED),
    ("EligibleTime", _TOKEN, _REQUIRED),
    ("AccrueTime", _TOKEN, _OPTIONAL),
    ("ResizeTime", _TOKEN, _OPTIONAL),
    ("StartTime", _TOKEN, _REQUIRED),
    ("EndTime", _TOKEN, _REQUIRED),
    ("Deadline", _TOKEN, _REQUIRED),
    ("PreemptEligibleTime", _TOKEN, _OPTIONAL),
    ("PreemptTime", _TOKEN, _OPTIONAL),
    ("SuspendTime", _TOKEN, _REQUIRED),
    ("SecsPreSuspend", _TOKEN, _REQUIRED),
    ("LastSchedEval", _TOKEN, _REQUIRED),
    ("Scheduler", _TOKEN, _OPTIONAL),
    ("Partition", _TOKEN, _REQUIRED),
    ("AllocNode:Sid", _TOKEN, _REQUIRED),
    ("ReqNodeList", _TOKEN, _REQUIRED),
    ("ExcNodeList", _TOKEN, _REQUIRED),
    ("NodeList", _TOKEN, _REQUIRED),
    ("SchedNodeList", _TOKEN, _OPTIONAL),
    ("BatchHost", _TOKEN, _OPTIONAL),
    ("NumNodes", _TOKEN, _REQUIRED),
    ("NumCPUs", _TOKEN, _REQUIRED),
    ("NumTasks", _TOKEN, _REQUIRED),
    ("CPUs/Task", _TOKEN, _REQUIRED),
    ("ReqB:S:C:T", _TOKEN, _REQUIRED),
    ("TRES", _TOKEN, _REQUIRED),
    ("Socks/Node", _TOKEN, _REQUIRED),
    ("NtasksPerN:B:S:C", _TOKEN, _REQUIRED),
    ("CoreSpec", _TOKEN, _REQUIRED),
    ("MinCPUsNode", _TOKEN, _REQUIRED),
    ("MinMemoryNode", _TOKEN, _OPTIONAL),
    ("MinMemoryCPU", _TOKEN, _OPTIONAL),
    ("MinTmpDiskNode", _TOKEN, _REQUIRED),
    ("Features", _TEXT, _REQUIRED),
    ("DelayBoot", _TOKEN, _REQUIRED),
    ("ClusterFeatures", _TEXT, _OPTIONAL),
    ("Prefer", _TEXT, _OPTIONAL),
    ("Reservation", _TEXT, _OPTIONAL),
    ("OverSubscribe", _TOKEN, _REQUIRED),
    ("Contiguous", _TOKEN, _REQUIRED),
    ("Licenses", _TEXT, _REQUIRED),
    ("Network", _TEXT, _REQUIRED),
    ("Command", _TEXT, _REQUIRED),
    ("WorkDir", _TEXT, _REQUIRED),
    ("AdminComment", _TEXT, _OPTIONAL),
    ("SystemComment", _TEXT, _OPTIONAL),
    ("Comment", _TEXT, _OPTIONAL),
    ("StdErr", _TEXT, _OPTIONAL),
    ("StdIn", _TEXT, _OPTIONAL),
    ("StdOut", _TEXT, _OPTIONAL),
    ("Switches", _TOKEN, _OPTIONAL),
    ("BurstBuffer", _TEXT, _OPTIONAL),
    ("BurstBufferState", _TEXT, _OPTIONAL),
    # The last key read by position: what follows (TresPerNode, MailUser, MailType, ...) is
    # read as plain `Key=value` pairs, and never for a key of this table.
    ("Power", _TOKEN, _REQUIRED),
)
_JOB_KEYS = {key: index for index, (key, _, _) in enumerate(_JOB_LAYOUT)}
# Every key the daemon decides by (state, nodes, owner, restarts, ...) stands up to DelayBoot,
# where every TEXT value is followed by a key Slurm always prints: there, exactly one reading
# must fit, or the record is refused. After it, a TEXT value followed by an optional key can
# always be read two ways (`WorkDir=/a Comment=b ` is also a workdir named so): there the
# first reading that fits is taken, each value as short as it can be (the job's own paths and
# comment, which its owner sets as they like anyway).
_DECISIVE_END = _JOB_KEYS["DelayBoot"]
_BATCH_KEYS = {"StdErr", "StdIn", "StdOut"}
# Slurm 22.05 prints these as `Key=%s ` (a space of their own before the separator).
_TRAILING_SPACE_KEYS = {"AdminComment", "SystemComment", "Comment"}
# A key of the table anywhere a new key may start (after a space): where a TEXT value may end.
_JOB_KEY = re.compile(r"(?:^|(?<= ))([A-Z][A-Za-z0-9_/:.]*)=")
_TOKEN_VALUE = re.compile(r"[^\s]*")
# Free text holding this many keys of the table beyond the record's own is refused before any
# parsing: the search below would grow with their square.
_MAX_EXTRA_KEYS = 200


def _parse_job_record(line: str) -> dict[str, str]:
    """A job record, read by the key order of _JOB_LAYOUT; SlurmError unless its keys up to
    DelayBoot can be placed on the line in exactly one way (with the rest still readable).

    The real record is always one of the ways the keys can be placed, so when there is one it is
    the real one. Free text that holds a whole second run of the keys, in order, could be read
    either way: that record is refused rather than guessed (the daemon gives up on that job).
    """
    starts: dict[str, list[int]] = {}
    for match in _JOB_KEY.finditer(line):
        if match.group(1) in _JOB_KEYS:
            starts.setdefault(match.group(1), []).append(match.start())
    if sum(len(found) for found in starts.values()) > len(_JOB_LAYOUT) + _MAX_EXTRA_KEYS:
        raise SlurmError(f"scontrol printed a job record with too many field names: {line!r}")

    def steps(index: int, at: int, batch: bool) -> list[_Step]:
        return _job_steps(line, starts, index, at, batch)

    memo: dict[tuple[int, int, bool], int] = {}

    def count(index: int, at: int, batch: bool) -> int:
        """Placements of key `index` on (at `at`) up to DelayBoot, each with some reading of the
        rest: 0, 1, or 2 for two or more. Past DelayBoot only whether one exists (0 or 1)."""
        if index == len(_JOB_LAYOUT):
            return 1
        if (index, at, batch) not in memo:
            total = 0
            for step in steps(index, at, batch):
                total += count(step.to, step.at, step.batch)
                if total >= 2 or (total and index > _DECISIVE_END):
                    break
            memo[(index, at, batch)] = min(total, 2)
        return memo[(index, at, batch)]

    readings = count(0, 0, False)
    if readings != 1:
        what = "no" if readings == 0 else "more than one"
        raise SlurmError(f"{what} reading of this job record fits Slurm's key order: {line!r}")
    record: dict[str, str] = {}
    index, at, batch = 0, 0, False
    while index < len(_JOB_LAYOUT):
        # Up to DelayBoot the one step that leads on; after it the first (shortest value).
        step = next(s for s in steps(index, at, batch) if count(s.to, s.at, s.batch))
        if step.key:
            value = line[step.start : step.end]
            record[step.key] = value[:-1] if step.key in _TRAILING_SPACE_KEYS else value
        index, at, batch = step.to, step.at, step.batch
    # After Power: plain pairs (TresPerNode=, MailUser=, MailType=, ...), none of the table's.
    for key, value in _parse_key_values(line[at:].strip()).items():
        if key not in _JOB_KEYS:
            record.setdefault(key, value)
    return record


def _job_steps(
    line: str, starts: dict[str, list[int]], index: int, at: int, batch: bool
) -> list[_Step]:
    """Each way on from key `index` of _JOB_LAYOUT, expected at `at` of the line (`starts`: where
    each of its keys stands in the line)."""
    key, text, optional = _JOB_LAYOUT[index]
    if key in _BATCH_KEYS and optional:
        optional = not batch  # printed exactly for batch jobs
        if not batch:
            return [_Step(index + 1, at, batch)]
    found = [_Step(index + 1, at, batch)] if optional else []
    if not line.startswith(f"{key}=", at):
        return found
    start = at + len(key) + 1
    if text:
        # The value ends before any later key that may come next (up to the first one Slurm
        # always prints). Past DelayBoot, where more than one reading may fit, the first tried
        # is taken: an optional key present rather than inside the value before it, each value
        # as short as it fits. Slurm 22.05 prints a comment as `Comment=%s `: its value ends with
        # that space.
        ends: list[tuple[int, int]] = []
        for later_index in range(index + 1, len(_JOB_LAYOUT)):
            later, _, later_optional = _JOB_LAYOUT[later_index]
            ends += [(later_index, at - 1) for at in starts.get(later, ()) if at > start]
            if not later_optional:
                break
        if key in _TRAILING_SPACE_KEYS:
            ends = [(i, end) for i, end in ends if end > start and line[end - 1] == " "]
        return found + [
            _Step(index + 1, end + 1, batch, key, start, end) for _, end in sorted(ends)
        ]
    token = _TOKEN_VALUE.match(line, start)
    end = token.end() if token else start
    if key == "BatchFlag":
        batch = line[start:end] != "0"
    if index == len(_JOB_LAYOUT) - 1:  # Power, the last: what follows is read apart
        if end == len(line) or line[end] == " ":
            found.append(_Step(index + 1, end, batch, key, start, end))
    elif end < len(line) and line[end] == " ":
        found.append(_Step(index + 1, end + 1, batch, key, start, end))
    return found


class _Step(NamedTuple):
    """One way on: to key `to` of _JOB_LAYOUT at `at` of the line, having read `key`'s value
    as line[start:end] (no key: an optional one that is not there)."""

    to: int
    at: int
    batch: bool
    key: str = ""
    start: int = 0
    end: int = 0


def job_from_scontrol(record: dict[str, str]) -> JobInfo:
    """SlurmError (never another error) for a value that is not what Slurm prints there."""
    requeue = record.get("Requeue")
    restarts = record.get("Restarts", "0") or "0"
    if not restarts.isdigit():
        raise SlurmError(f"scontrol printed Restarts={restarts!r}")
    return JobInfo(
        job_id=record["JobId"],
        state=parse_job_state(record.get("JobState", "")),
        reason=blank(record.get("Reason", "")),
        nodes=_hosts(record, "NodeList"),
        batch_host=blank(record.get("BatchHost", "")),
        name=record.get("JobName", ""),
        comment=blank(record.get("Comment", "")),
        restarts=int(restarts),
        excluded_nodes=_hosts(record, "ExcNodeList"),
        exit_code=record.get("ExitCode", ""),
        requeue=None if requeue is None else requeue == "1",
        user_id=_owner_uid(record.get("UserId", "")),
        raw=record,
    )


def _hosts(record: dict[str, str], key: str) -> tuple[str, ...]:
    try:
        return tuple(expand(blank(record.get(key, ""))))
    except HostlistError as error:
        raise SlurmError(f"scontrol printed {key}={record.get(key)!r}: {error}") from error


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
