"""A site's own sbatch and srun options (`slurmft submit --sbatch-arg/--srun-arg`), parsed as
sbatch and srun parse them, and refused where slurmft owns the option or where it would break
the trust model.

Parsing follows getopt_long, which both commands use with the table of
src/common/slurm_opt.c (slurmft/slurm/option_table.py): `--name=value`, `--name value` for a
required argument, an unambiguous prefix of a long name (`--mail-t=END` is `--mail-type`), and
short options (`-A acct`, `-Aacct`, clusters such as `-vQ`). Every option comes back in one
canonical form, `--name=value`, so what reaches Slurm, what the store keeps and what the refusal
table checks are the same words, and no abbreviation (`--ui=0` for `--uid`) slips past the
table.

A long option Slurm 22.05 does not have is passed on with a note: a site's SPANK plugins add
their own (pyxis's `--container-image`, `--network` plugins), and sbatch or srun refuses what
nothing defines. It cannot be a short form of a refused option: a prefix of a known name
resolves to it first (or is ambiguous, and refused).
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from slurmft.slurm.api import SlurmBadRequest
from slurmft.slurm.option_table import SBATCH_OPTIONS, SRUN_OPTIONS

Command = Literal["sbatch", "srun"]

_OWN_FLAG = "slurmft submit has its own flag for it"
_NODES = "slurmft chooses the nodes (N + S, then without the bad ones)"
_ENV = "the job's environment is explicit: use --env and setup lines, replayed on every attempt"
_NOT_SUBMITTED = "sbatch would not submit the job"
_IDENTITY = "a job runs as the user who submits it; slurmft never submits as anyone else"

# sbatch: what slurmft sets on every job (and again on every resubmission), and what would make
# sbatch do something other than submit this one job as this user.
SBATCH_REFUSED: dict[str, str] = {
    "nodes": _NODES + ": use --nodes and --spares",
    "nodefile": _NODES + "; a node list would bring back a drained or denylisted node",
    "nodelist": _NODES + "; a node list would bring back a drained or denylisted node",
    "exclude": _NODES + ": the denylist and the run's removed nodes are its exclusions",
    "no-kill": "slurmft sets it: a lost node must not end the job",
    "requeue": "slurmft sets it: the job is requeued without the bad nodes",
    "no-requeue": "slurmft sets --requeue: the job is requeued without the bad nodes",
    "comment": "slurmft tags the job with its run in the comment",
    "job-name": "slurmft names the job after the run: use --name",
    "output": "slurmft keeps the job's log in the checkpoint directory's .slurmft",
    "signal": "slurmft sets it from the time limit and save_lead_s (the coordinated save)",
    "uid": _IDENTITY,
    "gid": _IDENTITY,
    "export": _ENV,
    "export-file": _ENV,
    "get-user-env": _ENV,
    "chdir": "the job starts where slurmft submit ran (and a resubmission there too)",
    "wrap": "the batch script is slurmft's",
    "array": "one run is one job",
    "hold": "a held job would never start, nor its resubmission",
    "test-only": _NOT_SUBMITTED,
    "parsable": "slurmft sets it to read the job id",
    "wait": "sbatch would not return until the job ends",
    "clusters": "slurmft watches the jobs of its own cluster only",
    "batch": "the batch step runs slurmft, on any node of the job",
    "container": "the batch step runs slurmft outside a container: containers are for the "
    "agent step (--container-image, --apptainer, --container-wrapper, or --srun-arg)",
    "help": _NOT_SUBMITTED,
    "usage": _NOT_SUBMITTED,
    "version": _NOT_SUBMITTED,
    "partition": _OWN_FLAG + ": --partition",
    "time": _OWN_FLAG + ": --time",
    "gpus-per-node": _OWN_FLAG + ", which every agent step gets too: --gpus-per-node",
    "gres": _OWN_FLAG + ", which every agent step gets too: --gres",
    "gpus": "agent steps need GPUs per node: use --gpus-per-node",
    "cpus-per-task": _OWN_FLAG + ", which every agent step gets too: --cpus-per-task",
    "ntasks-per-node": "slurmft runs one agent per node",
    "account": _OWN_FLAG + ": --account",
    "qos": _OWN_FLAG + ": --qos",
    "constraint": _OWN_FLAG + ": --constraint",
    "mem": _OWN_FLAG + ": --mem",
    "exclusive": _OWN_FLAG + ": --exclusive",
    "reservation": _OWN_FLAG + ": --reservation",
}

# srun (the agent step, one agent per node, started again after every loss and requeue).
SRUN_REFUSED: dict[str, str] = {
    "nodelist": "slurmft places one agent on each usable node",
    "nodefile": "slurmft places one agent on each usable node",
    "exclude": "slurmft places one agent on each usable node",
    "nodes": "slurmft places one agent on each usable node",
    "relative": "slurmft places one agent on each usable node",
    "ntasks": "slurmft runs one agent per node",
    "ntasks-per-node": "slurmft runs one agent per node",
    "ntasks-per-core": "slurmft runs one agent per node",
    "ntasks-per-socket": "slurmft runs one agent per node",
    "ntasks-per-gpu": "slurmft runs one agent per node",
    "ntasks-per-tres": "slurmft runs one agent per node",
    "multi-prog": "every task is slurmft's agent",
    "export": _ENV,
    "kill-on-bad-exit": "one agent that leaves must not end the others (slurmft sets 0)",
    "no-kill": "slurmft sets it: a lost node must not end the step",
    "wait": "it ends the step when one agent leaves; slurmft ends its steps itself",
    "signal": "slurmft signals the agents itself (the coordinated save)",
    "overlap": "slurmft sets it: a new step reuses the CPUs of one that ended",
    "exclusive": "it conflicts with --overlap, which slurmft sets",
    "immediate": "slurmft sets it",
    "time": "a step time limit would stop training without the coordinated save: use --time",
    "jobid": "the agent step runs in the run's own job",
    "het-group": "the run's job has one component",
    "uid": _IDENTITY,
    "gid": _IDENTITY,
    "pty": "agents run without a terminal",
    "test-only": "srun would not start the agents",
    "help": "srun would not start the agents",
    "usage": "srun would not start the agents",
    "version": "srun would not start the agents",
    "gres": _OWN_FLAG + ": --gres (or --gpus-per-node)",
    "gpus-per-node": _OWN_FLAG + ": --gpus-per-node",
    "cpus-per-task": _OWN_FLAG + ": --cpus-per-task",
}

_TABLES = {"sbatch": (SBATCH_OPTIONS, SBATCH_REFUSED), "srun": (SRUN_OPTIONS, SRUN_REFUSED)}


@dataclass(frozen=True)
class Parsed:
    """Passthrough options in canonical form, and what the caller should be told."""

    argv: tuple[str, ...]
    notes: tuple[str, ...] = ()


def split_args(values: Iterable[str]) -> list[str]:
    """`--sbatch-arg` values as words: each is split as a shell would (`"-A acct"`)."""
    words: list[str] = []
    for value in values:
        try:
            words.extend(shlex.split(value))
        except ValueError as error:
            raise SlurmBadRequest(f"cannot split {value!r} into words: {error}") from None
    return words


def parse(command: Command, words: Sequence[str]) -> Parsed:
    """``words`` as ``command`` would read them, in canonical form; SlurmBadRequest (naming the
    option and why) for a refused, ambiguous or malformed one."""
    options, refused = _TABLES[command]
    argv: list[str] = []
    notes: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        if any(ord(char) < 32 for char in word):
            raise SlurmBadRequest(f"{command} option {word!r} contains control characters")
        if word.startswith("--") and word != "--":
            name, value, index = _long(command, words, index, options)
        elif word.startswith("-") and len(word) > 1:
            found, index = _short(command, words, index, options)
            for name, value in found:
                argv.append(_checked(command, name, value, refused))
            continue
        else:
            raise SlurmBadRequest(
                f"{command} passthrough takes options only, not {word!r} "
                f"(slurmft gives {command} its command)"
            )
        if name not in options:
            notes.append(f"{command} {word}: not a Slurm 22.05 option, passed on as given "
                         "(a SPANK plugin's?)")  # fmt: skip
        argv.append(_checked(command, name, value, refused))
    return Parsed(tuple(argv), tuple(notes))


def check(command: Command, argv: Sequence[str]) -> tuple[str, ...]:
    """Stored passthrough options checked again where they are used (a resubmission, the batch
    step): the same parse, so a record that bypassed the client is held to the same table."""
    if isinstance(argv, str) or not all(isinstance(word, str) for word in argv):
        raise SlurmBadRequest(f"{command} options are a list of words, not {argv!r}")
    return parse(command, argv).argv


def _checked(command: str, name: str, value: str | None, refused: dict[str, str]) -> str:
    if name in refused:
        raise SlurmBadRequest(f"{command} --{name} is not allowed: {refused[name]}")
    return f"--{name}" if value is None else f"--{name}={value}"


def _long(
    command: str, words: Sequence[str], index: int, options: dict[str, tuple[str, str]]
) -> tuple[str, str | None, int]:
    given, has_value, value = words[index][2:].partition("=")
    name = _resolve(command, given, options)
    if name in options:
        kind = options[name][0]
    else:  # a plugin's option: `--x v` when a value follows, as its own table would say
        follows = index + 1 < len(words) and not words[index + 1].startswith("-")
        kind = "required" if has_value or follows else "none"
    if kind == "none" and has_value:
        raise SlurmBadRequest(f"{command} --{name} takes no value (given {value!r})")
    if kind == "required" and not has_value:
        if index + 1 >= len(words):
            raise SlurmBadRequest(f"{command} --{name} needs a value")
        return name, words[index + 1], index + 2
    return name, value if has_value else None, index + 1


def _resolve(command: str, given: str, options: dict[str, tuple[str, str]]) -> str:
    """getopt_long: an exact name, else the one name it is a prefix of."""
    if given in options:
        return given
    matches = sorted(name for name in options if name.startswith(given))
    if len(matches) > 1:
        raise SlurmBadRequest(
            f"{command} option --{given} is ambiguous: {', '.join('--' + m for m in matches)}"
        )
    return matches[0] if matches else given


def _short(
    command: str, words: Sequence[str], index: int, options: dict[str, tuple[str, str]]
) -> tuple[list[tuple[str, str | None]], int]:
    by_letter = {short: name for name, (_, short) in options.items() if short}
    word = words[index]
    found: list[tuple[str, str | None]] = []
    position = 1
    while position < len(word):
        letter = word[position]
        if letter not in by_letter:
            raise SlurmBadRequest(f"{command} has no option -{letter} (in {word!r})")
        name = by_letter[letter]
        kind = options[name][0]
        rest = word[position + 1 :]
        if kind == "none":
            found.append((name, None))
            position += 1
            continue
        if rest:  # -Aacct, and the only way an optional value attaches: -k0
            found.append((name, rest))
        elif kind == "required":
            if index + 1 >= len(words):
                raise SlurmBadRequest(f"{command} -{letter} (--{name}) needs a value")
            found.append((name, words[index + 1]))
            return found, index + 2
        else:
            found.append((name, None))
        break
    return found, index + 1
