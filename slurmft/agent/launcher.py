"""torchrun's main, run after the wait-list fix is applied (or refused) in the same process.

    python -m slurmft.agent.launcher [--no-wait-list-fix] [--spare-candidate] [--rdzv-poll-s S] \
        [--warm-workers] -- <torchrun args>

Only torchrun's process imports this module's torch parts (inside `main`), so the daemon and
the agent stay torch-free. When torch's internals differ from what the fix knows, an agent that
could only be a spare (`--spare-candidate`: beyond the first N nodes) exits with
AgentExit.SPARE_REFUSED, and the first N run as a job without spares: with exactly N agents the
wait-list defect cannot trigger. `--rdzv-poll-s` shortens torch's one-second rendezvous state
poll under the same gate (rdzv_fix); refused, torch keeps its own. Every round torchrun joins is
told to the agent and to the next workers (rounds), so each restart is counted once.
`--warm-workers` forks the node's zygote (slurmft.agent.zygote) from this process once it has
imported torch; the zygote forks the workers that torchrun's `-m slurmft.agent.warm_start`
clients ask for.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import io
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slurmft.agent import peer_detector, procs, rdzv_fix, rounds, zygote
from slurmft.agent.command import AGENT_SOCKET_ENV, WARM_START_MODULE
from slurmft.agent.exits import AgentExit
from slurmft.agent.peer_watch import WatchSettings
from slurmft.agent.warm_start import ZYGOTE_SOCKET_ENV, survive_rank_signals
from slurmft.core import torch_support
from slurmft.train.report import ReportChannel

PREFIX = "slurmft launcher:"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit(
            f"{PREFIX} usage: [--no-wait-list-fix] [--spare-candidate] [--rdzv-poll-s S] "
            "-- <torchrun>"
        )
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m slurmft.agent.launcher")
    parser.add_argument("--wait-list-fix", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--spare-candidate", action="store_true")
    parser.add_argument("--rdzv-poll-s", type=float, default=rdzv_fix.TORCH_POLL_S)
    parser.add_argument("--warm-workers", action="store_true")
    parser.add_argument("--peer-dead-after-s", type=float, default=0.0)
    parser.add_argument("--peer-heartbeat-s", type=float, default=WatchSettings.heartbeat_s)
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


def prepare_rendezvous(
    wait_list_fix: bool, spare_candidate: bool, poll_s: float = rdzv_fix.TORCH_POLL_S
) -> AgentExit | None:
    """Apply the fix or decide this agent may not run; returns an exit code to stop with."""
    import torch  # noqa: TID251 (torchrun's process, never the agent's)

    if not wait_list_fix:
        say("wait-list fix disabled: with more agents than nodes torch may restart in a loop")
        return None
    module = rdzv_fix.load_module()
    problems = rdzv_fix.check_internals(module)
    if not problems:
        rdzv_fix.apply(module, poll_s)
        say(
            f"wait-list fix applied (torch {torch.__version__}), "
            f"rendezvous state poll {rdzv_fix.poll_interval(module):g} s"
        )
        return None
    tested = ", ".join(torch_support.patch(torch_support.WAIT_LIST_FIX).known)
    say(
        f"the wait-list fix does not know torch {torch.__version__}'s rendezvous internals ("
        + "; ".join(problems)
        + f"; tested with torch {tested}): running without hot spares"
    )
    if spare_candidate:
        say("this agent is a spare candidate: not joining (spares need the fix)")
        return AgentExit.SPARE_REFUSED
    return None


def die_with_parent() -> None:
    """SIGTERM this process (torchrun) when its agent dies, so torchrun stops its workers: an
    agent killed alone (srun aborting the step, an OOM kill) would otherwise leave them training."""
    procs.die_with_parent(signal.SIGTERM)


def succeed_on_graceful_exit(run: Callable[..., Any], success: Callable[[], Any]) -> Any:
    """torch 2.13: a spare still waiting when training ends leaves the rendezvous gracefully and
    `SimpleElasticAgent.run` returns None, on which `launch_agent` crashes (`None.is_failed()`),
    so torchrun exits 1 and the batch step would relaunch against a closed rendezvous until the
    restart budget gives up. A graceful exit means the run is over: report success."""

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = run(*args, **kwargs)
        return success() if result is None else result

    return wrapper


def patch_graceful_exit() -> None:
    from torch.distributed.elastic.agent.server import api  # noqa: TID251

    api.SimpleElasticAgent.run = succeed_on_graceful_exit(  # type: ignore[method-assign]  # patching torch's method in place is the point
        api.SimpleElasticAgent.run, lambda: api.RunResult(state=api.WorkerState.SUCCEEDED)
    )


def warm_target(torchrun_args: list[str]) -> list[str]:
    """The user's script and arguments, after torchrun's `-m slurmft.agent.warm_start`."""
    for index in range(len(torchrun_args) - 1):
        if torchrun_args[index : index + 2] == ["-m", WARM_START_MODULE]:
            return torchrun_args[index + 2 :]
    raise SystemExit(f"{PREFIX} --warm-workers, but torchrun does not run {WARM_START_MODULE}")


def zygote_socket() -> str:
    """The zygote's socket: beside the agent's, or in a folder of its own."""
    agent_socket = os.environ.get(AGENT_SOCKET_ENV, "")
    folder = Path(agent_socket).parent if agent_socket else Path(tempfile.mkdtemp("-slurmft"))
    return str(folder / "zygote.sock")


def fork_zygote(target: list[str]) -> list[str] | None:
    """Fork the node's zygote (slurmft.agent.zygote) once this process has imported torch:
    it starts with torch imported, where a zygote of its own would import it a second time
    (about 1.6 s of CPU on every node start). Returns the zygote's arguments in the child, None in
    the launcher, whose workers find the socket in their environment.

    Forked before the launcher patches torch's rendezvous, starts a thread of its own or
    changes its streams: the child holds what `python -u -m slurmft.agent.zygote` would after
    its `import torch`. The NVML-based CUDA check guards that import as the zygote guards its
    own; the launcher's environment, which torchrun hands to the workers, keeps its value."""
    path = zygote_socket()
    check = os.environ.get(zygote.NVML_CUDA_CHECK_ENV)
    os.environ[zygote.NVML_CUDA_CHECK_ENV] = "1"
    import torch  # noqa: F401, TID251 (torchrun's process, never the agent's)

    launcher = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid == 0:
        procs.die_with_parent(signal.SIGKILL, expected_parent=launcher)
        as_fresh_zygote()
        return ["--socket", path, "--", *target]
    if check is None:
        del os.environ[zygote.NVML_CUDA_CHECK_ENV]
    else:
        os.environ[zygote.NVML_CUDA_CHECK_ENV] = check
    os.environ[ZYGOTE_SOCKET_ENV] = path
    atexit.register(end_zygote, pid)
    return None


def as_fresh_zygote() -> None:
    """What `python -u` with its standard input closed gives a process: the zygote's workers
    write through torchrun's pipes at once, as torchrun's own `python -u` workers do."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                io.FileIO(stream.fileno(), "w", closefd=False),
                encoding=stream.encoding,
                errors=stream.errors,
                write_through=True,
            ),
        )


def end_zygote(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # unreaped, so the pid is still the zygote's
        os.kill(pid, signal.SIGKILL)


def watch_peers(options: argparse.Namespace, channel: ReportChannel) -> Callable[[], None]:
    """Start slurmft's dead-peer detector where torch's internals are the ones it knows;
    returns what to call when this launcher ends (no-op when it was not started)."""
    if options.peer_dead_after_s <= 0:
        return lambda: None
    module = rdzv_fix.load_module()
    problems = peer_detector.check_internals(module)
    if problems:
        say(
            "the dead-peer detector does not know this torch's rendezvous internals ("
            + "; ".join(problems)
            + "): dead nodes are found by torch's keep-alive alone"
        )
        return lambda: None
    settings = WatchSettings(options.peer_heartbeat_s, options.peer_dead_after_s)
    say(
        f"dead-peer detector: heartbeat {settings.heartbeat_s:g} s, a peer silent for "
        f"{settings.dead_after_s:g} s is evicted"
    )
    return peer_detector.apply(module, settings, channel.send, say)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    survive_rank_signals()
    options, torchrun_args = parse_args(sys.argv[1:] if argv is None else argv)
    if options.warm_workers:
        zygote_args = fork_zygote(warm_target(torchrun_args))
        if zygote_args is not None:  # the zygote, and in the end each worker it forks
            return zygote.main(zygote_args)
    refused = prepare_rendezvous(
        options.wait_list_fix, options.spare_candidate, options.rdzv_poll_s
    )
    if refused is not None:
        return int(refused)
    channel = ReportChannel()
    if not rounds.observe(rdzv_fix.load_module(), channel, warn=say):
        say("torch's rendezvous has no next_rendezvous to observe: restarts are grouped by time")
    leave_peers = watch_peers(options, channel)
    patch_graceful_exit()
    # torchrun copies the tee'd worker lines to its own stdout and stderr without flushing; to
    # the job's output file they are block-buffered: seen minutes late, and lost with the node.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    from torch.distributed.run import main as torchrun_main  # noqa: TID251

    try:
        torchrun_main(torchrun_args)
    finally:
        leave_peers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
