"""`slurmft logs RUN`: the job's output (the batch step, the agents, the training script), read
as the caller.

The daemon says where each attempt's output is (the `--output` the job was submitted with);
this command reads the file with the caller's own rights: the root daemon never reads a user's
files for them. A requeued job writes every attempt into one file: each attempt's part begins at
the batch step's line "batch step of job J, Slurm restart R". Each line a worker wrote carries its
global rank (slurmft.core.output), which `--rank` selects by.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from slurmft.cli.runs_cmd import RUN, ask

ATTEMPT_MARK = re.compile(r"batch step of job (\S+), Slurm restart (\d+), on ")
FOLLOW_POLL_S = 0.5
STATE_EVERY_S = 2.0  # how often --follow asks the daemon whether the run has ended


def _pick(attempts: list[dict[str, Any]], number: int | None) -> dict[str, Any]:
    with_output = [a for a in attempts if a["path"]]
    if not with_output:
        raise typer.BadParameter("the run has no job yet: nothing has written output")
    if number is None:
        return with_output[-1]
    for attempt in with_output:
        if attempt["attempt"] == number:
            return attempt
    known = ", ".join(str(a["attempt"]) for a in with_output)
    raise typer.BadParameter(
        f"no attempt {number} with output (attempts: {known})", param_hint="--attempt"
    )


def attempt_lines(lines: list[str], job_id: str, restarts: int) -> list[str]:
    """The part of a job's output that is one attempt's: from its batch step's first line to
    the next attempt's. A file without the marks (written before they were) is whole."""
    marks = [(i, m) for i, line in enumerate(lines) if (m := ATTEMPT_MARK.search(line))]
    if not marks:
        return lines
    # Lines before the first mark (the store's, the job script's) belong to the first attempt.
    starts = [0 if n == 0 else i for n, (i, _) in enumerate(marks)]
    for n, (_, mark) in enumerate(marks):
        if (mark.group(1), int(mark.group(2))) == (job_id, restarts):
            end = starts[n + 1] if n + 1 < len(starts) else len(lines)
            return lines[starts[n] : end]
    return []


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise typer.BadParameter(
            f"no output at {path} yet: the job has not started, or its checkpoint directory is "
            "not mounted on this host"
        ) from None
    except PermissionError:
        raise typer.BadParameter(
            f"cannot read {path}: the output is the run owner's (read it as them, or as root)"
        ) from None


def _follow(ctx: typer.Context, run_id: str, path: Path, offset: int) -> Iterator[str]:
    """New output as it is written, until the run has ended and nothing more came."""
    from slurmft.core.states import RunState  # by --follow only: `slurmft` starts light

    checked, ended = 0.0, False
    while True:
        with path.open("rb") as stream:
            stream.seek(offset)
            chunk = stream.read()
        if chunk:
            offset += len(chunk)
            yield chunk.decode(errors="replace")
        elif ended:
            return
        now = time.monotonic()
        if now - checked >= STATE_EVERY_S:
            checked = now
            ended = RunState(ask(ctx, "status", run_id=run_id)["state"]).is_terminal
        time.sleep(FOLLOW_POLL_S)


def complete_lines(chunks: Iterator[str]) -> Iterator[str]:
    """The lines in a stream of chunks, each once it is whole (the last, whole or not, at the
    end): a chunk read while a line is being written ends mid-line."""
    partial = ""
    for chunk in chunks:
        *whole, partial = (partial + chunk).split("\n")
        yield from (line + "\n" for line in whole)
    if partial:
        yield partial


def of_rank(lines: list[str], rank: int | None) -> list[str]:
    """The lines rank ``rank`` wrote, without their label (all lines for None)."""
    if rank is None:
        return lines
    from slurmft.core.output import rank_line  # by --rank only: `slurmft` starts light

    return [found[1] for line in lines if (found := rank_line(line)) and found[0] == rank]


def logs(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    run_id: RUN,
    attempt: Annotated[
        int | None,
        typer.Option("--attempt", min=1, help="This attempt's output (default: the latest)."),
    ] = None,
    lines: Annotated[
        int | None, typer.Option("--lines", "-n", min=1, help="Only the last N lines.")
    ] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Keep printing new output until the run ends."),
    ] = False,
    rank: Annotated[
        int | None,
        typer.Option(
            "--rank",
            min=0,
            help="Only what the worker of this global rank wrote (its label removed). After an "
            "elastic restart a rank may be another node's.",
        ),
    ] = None,
    show_path: Annotated[
        bool, typer.Option("--path", help="Print where the output is, and nothing else.")
    ] = False,
) -> None:
    """The output of a run's job: its batch step, its agents (each line names its node) and
    the training script (each line labelled `[rankN]: ` with its worker's global rank), as Slurm
    wrote it (`<ckpt>/.slurmft/slurm-<job>.out` by default). Read with your own rights."""
    found = ask(ctx, "log_files", run_id=run_id)
    chosen = _pick(found["attempts"], attempt)
    path = Path(chosen["path"])
    if show_path:
        typer.echo(path)
        return
    written = _read(path)
    latest = chosen is [a for a in found["attempts"] if a["path"]][-1]
    if follow and latest:  # a line being written is printed whole, by the follow
        written = written[: written.rfind(b"\n") + 1]
    text = written.decode(errors="replace").splitlines(keepends=True)
    part = of_rank(attempt_lines(text, chosen["job_id"], chosen["slurm_restarts"]), rank)
    if lines is not None:
        part = part[-lines:]
    typer.echo("".join(part), nl=False)
    if follow:
        if not latest:
            raise typer.BadParameter("only the latest attempt grows", param_hint="--follow")
        try:
            chunks = _follow(ctx, run_id, path, len(written))
            if rank is None:  # as written: a progress bar's "\r" updates show as they come
                for chunk in chunks:
                    typer.echo(chunk, nl=False)
            else:  # a label is read off a whole line
                for line in complete_lines(chunks):
                    typer.echo("".join(of_rank([line], rank)), nl=False)
        except KeyboardInterrupt:
            return


def register(app: typer.Typer) -> None:
    app.command()(logs)
