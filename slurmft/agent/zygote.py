"""The node's zygote: imports torch and the training script's imports once, then forks each new
worker already warm, so a restart after a node loss skips the 2-3 s every fresh interpreter spends
importing (measured in docs/agent.md, "Where the time goes").

    python -u -m slurmft.agent.zygote --socket PATH -- train.py ARGS   (or: -- -m pkg.train ARGS)

The launcher forks it from torchrun's process (the user's `--python`, inside the container,
after the setup lines) once that process has imported torch, so it runs the interpreter and
environment the workers would have run, and imports torch once per node start, not twice. torchrun
runs slurmft.agent.warm_start in place of the script; each client sends its arguments,
environment, working directory and standard streams, and the zygote forks a worker that takes
them on and runs the script as `__main__` (runpy), in its own session as torchrun would start it.

What a fork keeps from the zygote, and why it is safe:
- Nothing initialises CUDA here: the imports run with PYTORCH_NVML_BASED_CUDA_CHECK=1 (a
  module's `torch.cuda.is_available()` asks NVML, not the driver), and a zygote whose imports
  initialised CUDA anyway refuses every fork (CUDA does not survive a fork). Each worker creates
  its own context after the fork, as a fresh process would.
- Random state: Python's `random` reseeds itself in a forked child; numpy's global generator is
  reseeded here; torch's is untouched since import (its default seed, as in a fresh process).
- Source files: a fork runs the modules as imported. If any loaded module's file (or the script)
  changed since, the zygote refuses, and the client starts the worker cold with the new code.
- The zygote is single-threaded in Python and forks from its main loop. The one native thread
  torch's import starts is numpy's OpenBLAS thread server, which OpenBLAS stops before a fork
  (pthread_atfork) and starts again when next needed (DataLoader workers fork torch processes
  the same way). The launcher forks the zygote itself the same way.

A forked worker's /proc/PID/environ is the zygote's (the kernel shows the environment a process
was exec'd with): each worker writes the environment it runs with to
`<socket folder>/warm-workers/<pid>` (NUL-separated, as /proc shows it), removed when it exits,
so its rank and run can still be read from outside (`warm_environ`).

A forked worker dies with the zygote (parent-death signal), and the zygote with the launcher; a
client that goes away (torchrun's SIGKILL after its stop grace) takes its worker with it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmft.agent.command import AGENT_SOCKET_ENV
from slurmft.agent.procs import die_with_parent
from slurmft.agent.warm_start import (
    HEADER,
    STREAMS,
    WARM_START_ENV,
    Target,
    parse_target,
    send_reply,
    signal_group,
    survive_rank_signals,
)

PREFIX = "slurmft zygote:"
# Imported before the script's own: what every torchrun worker of a slurmft run pays for.
# torch._dynamo is what the first optimizer step imports (0.6 s here).
BASE_IMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo")
REQUEST_TIMEOUT_S = 10.0
REGISTRY = "warm-workers"  # beside the socket: each warm worker's environment, by pid
MAX_REQUEST_BYTES = 16 << 20
# torch.cuda.is_available() asks NVML, not the driver, whose initialisation a fork cannot keep.
NVML_CUDA_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
# The zygote's name in `ps -e`, top and /proc/PID/comm, where its command line is the
# launcher's (it is forked from it); each worker takes back the interpreter's name.
PROCESS_NAME = "slurmft-zygote"


def say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)


# --- what to import ---------------------------------------------------------------------------


def script_source(target: Target) -> Path | None:
    """The file the target runs: the script, or the module's source (found without importing
    it: its package's __init__ runs, as the cold start would run it)."""
    if not target.module:
        return Path(target.name)
    try:
        spec = importlib.util.find_spec(target.name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def top_level_imports(source: str) -> list[str]:
    """Absolute modules the source imports at its top level (also inside top-level try/if
    blocks): what runs before the script's own code. `from a import b` names `a`, and `a.b`
    as `a:b` (b may be a submodule, or a name `a` defines); relative imports are left to the
    script."""
    names: list[str] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.append(node.module)
                names.extend(f"{node.module}:{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.If) and not _is_main_guard(node):
                visit(node.body)
                visit(node.orelse)

    try:
        visit(ast.parse(source).body)
    except SyntaxError:
        return []
    return list(dict.fromkeys(names))


def _is_main_guard(node: ast.If) -> bool:
    return "__main__" in ast.unparse(node.test)


@dataclass
class Preloaded:
    imported: list[str]
    failed: dict[str, str]
    seconds: float


def preload(names: list[str]) -> Preloaded:
    """Import each name that imports; a module that fails is the script's to fail on. `a:b`
    is `a.b` when that is a submodule, and nothing when `a` defines b itself."""
    started = time.monotonic()
    imported, failed = [], {}
    os.environ.setdefault(NVML_CUDA_CHECK_ENV, "1")
    for entry in names:
        parent, _, attribute = entry.partition(":")
        if attribute:
            module = sys.modules.get(parent)
            if module is None or hasattr(module, attribute):
                continue  # a name it defines, or a module that did not import
            name = f"{parent}.{attribute}"
            try:
                if importlib.util.find_spec(name) is None:
                    continue
            except (ImportError, ValueError):  # `parent` is no package
                continue
        else:
            name = entry
        if name in sys.modules:
            imported.append(name)
            continue
        try:
            importlib.import_module(name)
            imported.append(name)
        except BaseException as error:  # a module may raise anything, even SystemExit
            if isinstance(error, KeyboardInterrupt):
                raise
            failed[name] = f"{type(error).__name__}: {error}"
    return Preloaded(imported, failed, time.monotonic() - started)


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


# --- staleness --------------------------------------------------------------------------------


def source_stamps(extra: list[Path]) -> dict[str, int]:
    """mtime (ns) of every loaded module's file and of `extra`: what a fork would run."""
    files = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
    files |= {str(path) for path in extra}
    stamps = {}
    for name in files:
        if name:
            with contextlib.suppress(OSError):
                stamps[name] = os.stat(name).st_mtime_ns
    return stamps


def changed_since(stamps: dict[str, int]) -> str | None:
    for name, mtime in stamps.items():
        try:
            if os.stat(name).st_mtime_ns != mtime:
                return name
        except OSError:
            return name
    return None


# --- serving ----------------------------------------------------------------------------------


@dataclass
class Job:
    """One worker to run, in the forked child."""

    target: Target
    env: dict[str, str]
    cwd: str
    streams: list[int]
    cpus: list[int]


def read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(REQUEST_TIMEOUT_S)
    header, fds, _flags, _addr = socket.recv_fds(conn, HEADER.size, len(STREAMS))
    while len(header) < HEADER.size:
        more = conn.recv(HEADER.size - len(header))
        if not more:
            raise ConnectionError("request cut short")
        header += more
    (size,) = HEADER.unpack(header)
    try:
        if size > MAX_REQUEST_BYTES or len(fds) != len(STREAMS):
            raise ConnectionError(f"bad request: {size} bytes, {len(fds)} streams")
        body = bytearray()
        while len(body) < size:
            chunk = conn.recv(min(1 << 20, size - len(body)))
            if not chunk:
                raise ConnectionError("request cut short")
            body += chunk
        return json.loads(body), fds
    except (OSError, ValueError):
        close_all(fds)
        raise


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Zygote:
    def __init__(self, listener: socket.socket, stamps: dict[str, int], registry: Path):
        self.listener = listener
        self.stamps = stamps
        self.registry = registry
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        self.children: dict[int, socket.socket] = {}  # worker pid -> its client

    def serve(self) -> Job:
        """Answer clients until one request is forked: returns only in that child."""
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the pipe
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")
        while True:
            for key, _events in self.selector.select():
                if key.data == "accept":
                    job = self._accept()
                    if job is not None:
                        return job
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                    self._reap()
                else:
                    self._client_left(key.fileobj)  # type: ignore[arg-type]
            self._reap()

    def _accept(self) -> Job | None:
        conn, _ = self.listener.accept()
        try:
            request, fds = read_request(conn)
        except (OSError, ValueError) as error:
            say(f"dropped a request: {error}")
            conn.close()
            return None
        try:  # read before the fork: a malformed request must not crash a forked child
            job = Job(
                Target(str(request["name"]), bool(request["module"]), tuple(request["args"])),
                {str(k): str(v) for k, v in dict(request["env"]).items()},
                str(request["cwd"]),
                fds,
                [int(cpu) for cpu in request.get("cpus", [])],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            say(f"dropped a malformed request: {type(error).__name__}: {error}")
            close_all(fds)
            conn.close()
            return None
        changed = changed_since(self.stamps)
        if changed is not None:
            close_all(fds)
            with contextlib.suppress(OSError):
                send_reply(conn, {"refused": f"{changed} changed since the zygote imported it"})
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._close_in_child(conn)
            return job
        close_all(fds)
        self.children[pid] = conn
        try:
            send_reply(conn, {"pid": pid})
        except OSError:
            signal_group(pid, signal.SIGKILL)  # the client is gone already
        conn.setblocking(True)
        self.selector.register(conn, selectors.EVENT_READ, pid)
        return None

    def _close_in_child(self, conn: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        self.selector.close()
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for other in self.children.values():
            other.close()
        conn.close()

    def _client_left(self, conn: socket.socket) -> None:
        """A client's socket is readable only when it closed: its worker goes too."""
        pid = next((p for p, c in self.children.items() if c is conn), None)
        with contextlib.suppress(OSError):
            if conn.recv(1):
                return  # clients send nothing after the request; ignore stray bytes
        self.selector.unregister(conn)
        if pid is not None:
            signal_group(pid, signal.SIGKILL)


    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            with contextlib.suppress(OSError):
                (self.registry / str(pid)).unlink()
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(OSError):
                send_reply(conn, {"status": status})
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            conn.close()


# --- the forked worker ------------------------------------------------------------------------


def register(registry: Path, env: dict[str, str]) -> None:
    """This worker's environment where `warm_environ` finds it (see the module docstring)."""
    entry = registry / str(os.getpid())
    partial = entry.with_suffix(".partial")
    partial.write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    partial.rename(entry)


def warm_environ(pid: int) -> bytes:
    """A process's environment as /proc shows it, or, for a warm worker, the one it runs with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    for entry in raw.split(b"\0"):
        if entry.startswith(AGENT_SOCKET_ENV.encode() + b"="):
            folder = Path(os.fsdecode(entry.split(b"=", 1)[1])).parent
            with contextlib.suppress(OSError):
                return (folder / REGISTRY / str(pid)).read_bytes()
    return raw


def rename_process(name: str) -> str:
    """Set this process's name (/proc/self/comm, up to 15 bytes); returns the one it had."""
    comm = Path("/proc/self/comm")
    try:
        old = comm.read_text().rstrip("\n")
        comm.write_text(name)
    except OSError:  # not Linux: the name stays
        return name
    return old


def become_worker(job: Job, zygote_pid: int, registry: Path, name: str) -> None:
    """Take on the client's session, streams, environment and arguments, and the interpreter's
    process name, as a fresh `python -u script` started by torchrun would have them."""
    os.setsid()
    rename_process(name)
    die_with_parent(signal.SIGKILL, expected_parent=zygote_pid)
    for signum in (signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, received in zip(STREAMS, job.streams, strict=True):
        os.dup2(received, fd)
        if received not in STREAMS:
            os.close(received)
    if job.cpus:
        with contextlib.suppress(OSError):  # a CPU the zygote may not use: keep its own
            os.sched_setaffinity(0, job.cpus)
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    os.environ[WARM_START_ENV] = str(zygote_pid)
    with contextlib.suppress(OSError):  # an unreadable environment is no reason not to train
        register(registry, dict(os.environ))
    sys.argv = [job.target.name, *job.target.args]  # run_module puts the module's file first
    sys.path[0] = job.target.search_root(job.cwd)
    _fresh_library_state(job.env)


def forget_own_modules() -> None:
    """A script that imports nothing of slurmft finds nothing of slurmft loaded, as under a
    cold start: the zygote's own modules leave sys.modules (what runs keeps its references)."""
    for name in [m for m in sys.modules if m == "slurmft" or m.startswith("slurmft.")]:
        del sys.modules[name]


def _fresh_library_state(env: dict[str, str]) -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # a fresh process seeds it from the OS
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # read at torch's first parallel call otherwise


def run_job(job: Job) -> None:
    if job.target.module:
        runpy.run_module(job.target.name, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(job.target.name, run_name="__main__")


# --- main -------------------------------------------------------------------------------------


def listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket is this user's only
    try:
        listener.bind(path)
    finally:
        os.umask(old_umask)
    listener.listen(256)
    return listener


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Target]:
    if "--" not in argv:
        raise SystemExit(f"{PREFIX} usage: --socket PATH -- SCRIPT|-m MODULE [ARGS]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m slurmft.agent.zygote")
    parser.add_argument("--socket", required=True)
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        help=f"a module to import before the script's own (repeat; default: {BASE_IMPORTS})",
    )
    return parser.parse_args(argv[:split]), parse_target(argv[split + 1 :])


def imports_for(target: Target, base: tuple[str, ...]) -> tuple[list[str], list[Path]]:
    """The modules to import, and the files whose change makes a fork stale."""
    source = script_source(target)
    names = list(base)
    if source is None:
        return names, []
    with contextlib.suppress(OSError, UnicodeDecodeError):
        names += top_level_imports(source.read_text())
    return list(dict.fromkeys(names)), [source]


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGKILL)
    survive_rank_signals()
    options, target = parse_args(sys.argv[1:] if argv is None else argv)
    interpreter_name = rename_process(PROCESS_NAME)
    # Clients queue on the socket while the imports run.
    listener = listen(options.socket)
    sys.path.insert(0, target.search_root(os.getcwd()))
    names, sources = imports_for(target, tuple(options.imports or BASE_IMPORTS))
    loaded = preload(names)
    if cuda_initialised():
        say("an import initialised CUDA, which a fork cannot keep: workers start cold")
        listener.close()
        os.unlink(options.socket)
        return 0
    failed = "".join(f"; {name} not imported ({why})" for name, why in loaded.failed.items())
    say(f"ready in {loaded.seconds:.2f} s: {len(loaded.imported)} imports{failed}")
    del sys.path[0]
    zygote_pid = os.getpid()
    registry = Path(options.socket).parent / REGISTRY
    registry.mkdir(mode=0o700, exist_ok=True)
    job = Zygote(listener, source_stamps(sources), registry).serve()
    become_worker(job, zygote_pid, registry, interpreter_name)
    if not any(name.partition(":")[0].split(".")[0] == "slurmft" for name in names):
        forget_own_modules()
    run_job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
