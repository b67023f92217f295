"""Warm workers: the zygote (slurmft.agent.zygote) and the client torchrun runs in place of the
script (slurmft.agent.warm_start), as real processes. The zygote imports only `json` here (the
agent imports torch); what is checked is that a forked worker runs as the cold one would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import wait_for

from slurmft.agent.warm_start import HEADER, STREAMS
from slurmft.agent.zygote import REGISTRY, top_level_imports, warm_environ

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    out = Path(os.environ["OUT"])
    out.write_text(json.dumps({
        "argv": sys.argv, "pid": os.getpid(), "cwd": os.getcwd(), "name": __name__,
        "warm": os.environ.get("SLURMFT_WARM_START"), "rank": os.environ.get("RANK"),
        "json_preloaded": "json" in sys.modules, "path0": sys.path[0],
        "cpus": sorted(os.sched_getaffinity(0)),
    }))
    print("hello out", flush=True)
    print("hello err", file=sys.stderr, flush=True)
    mode = sys.argv[1]
    if mode == "sleep":
        time.sleep(60)
    if mode == "raise":
        raise RuntimeError("boom")
    sys.exit(int(mode))
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job" / "train.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


@pytest.fixture
def zygote(tmp_path: Path, script: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    # A short folder: unix socket paths are limited to 107 bytes.
    socket_path = tmp_path / "z.sock"
    # Under the agent the zygote's environment names the agent's socket, beside its own.
    env = {**os.environ, "SLURMFT_AGENT_SOCKET": str(tmp_path / "ranks.sock")}
    process = subprocess.Popen(
        [
            *(sys.executable, "-u", "-m", "slurmft.agent.zygote"),
            *("--socket", str(socket_path), "--import", "json", "--", str(script), "0"),
        ],
        stderr=subprocess.PIPE,
        env=env,
    )
    wait_for(socket_path.exists, 20, "the zygote's socket")
    yield process, socket_path
    process.kill()
    process.wait()


def client(
    socket_path: Path | None, out: Path, *args: str, cwd: Path, **popen: object
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMFT_")}
    env.update({"OUT": str(out), "RANK": "3"})
    if socket_path is not None:
        env["SLURMFT_ZYGOTE_SOCKET"] = str(socket_path)
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-u", "-m", "slurmft.agent.warm_start", *args],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen,
    )  # fmt: skip


def test_a_warm_worker_runs_the_script_with_the_clients_arguments_environment_and_streams(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    process, socket_path = zygote
    out = tmp_path / "out.json"
    done = client(socket_path, out, str(script), "7", cwd=tmp_path)
    stdout, stderr = done.communicate(timeout=30)
    assert done.returncode == 7
    assert stdout == b"hello out\n"
    assert b"hello err\n" in stderr
    seen = json.loads(out.read_text())
    assert seen["warm"] == str(process.pid)  # forked by the zygote...
    assert seen["json_preloaded"]
    assert seen["argv"] == [str(script), "7"]  # ...yet as `python -u train.py 7` would run
    assert seen["cwd"] == str(tmp_path)
    assert seen["name"] == "__main__"
    assert seen["rank"] == "3"
    assert seen["path0"] == str(script.parent)
    assert seen["pid"] != done.pid
    assert seen["cpus"] == sorted(os.sched_getaffinity(0))


def test_a_warm_worker_runs_on_the_cpus_its_client_was_bound_to(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    """torchrun's NUMA binding wraps the client in numactl: the worker must keep that binding."""
    _, socket_path = zygote
    out = tmp_path / "out.json"
    one = sorted(os.sched_getaffinity(0))[-1]
    done = client(
        socket_path, out, str(script), "0", cwd=tmp_path,
        preexec_fn=lambda: os.sched_setaffinity(0, {one}),
    )  # fmt: skip
    done.communicate(timeout=30)
    seen = json.loads(out.read_text())
    assert seen["warm"] is not None and seen["cpus"] == [one]


def test_a_failing_script_fails_the_client_with_its_traceback(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    _, socket_path = zygote
    done = client(socket_path, tmp_path / "out.json", str(script), "raise", cwd=tmp_path)
    _, stderr = done.communicate(timeout=30)
    assert done.returncode == 1
    assert b"RuntimeError: boom" in stderr


def test_torchruns_stop_signal_reaches_the_worker_and_its_death_reaches_torchrun(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    """torchrun stops a worker with SIGTERM to its process group: the client forwards it, the
    worker dies of it, and the client dies of the same signal, as the worker would have."""
    _, socket_path = zygote
    out = tmp_path / "out.json"
    running = client(socket_path, out, str(script), "sleep", cwd=tmp_path, start_new_session=True)
    wait_for(out.exists, 20, "the worker to start")
    worker = json.loads(out.read_text())["pid"]
    registered = tmp_path / REGISTRY / str(worker)
    assert b"RANK=3" in registered.read_bytes().split(b"\0")
    # /proc shows the zygote's environment; the registry the one the worker runs with.
    assert b"RANK=3" not in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
    assert b"RANK=3" in warm_environ(worker).split(b"\0")
    os.killpg(running.pid, signal.SIGTERM)
    running.wait(timeout=30)
    assert running.returncode == -signal.SIGTERM
    wait_for(lambda: not Path(f"/proc/{worker}").exists(), 10, "the worker to be gone")
    wait_for(lambda: not registered.exists(), 10, "its registry entry to be removed")


def test_a_killed_client_takes_its_worker_with_it(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    """torchrun's SIGKILL after its stop grace cannot be forwarded: the zygote sees the client's
    connection close and kills the worker."""
    _, socket_path = zygote
    out = tmp_path / "out.json"
    running = client(socket_path, out, str(script), "sleep", cwd=tmp_path)
    wait_for(out.exists, 20, "the worker to start")
    worker = json.loads(out.read_text())["pid"]
    running.kill()
    running.wait(timeout=10)
    wait_for(lambda: not _alive(worker), 10, "the worker to be killed")


def test_a_changed_source_is_never_forked_the_worker_starts_cold(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    _, socket_path = zygote
    time.sleep(0.01)
    script.write_text(SCRIPT.replace("hello out", "hello new"))
    out = tmp_path / "out.json"
    done = client(socket_path, out, str(script), "0", cwd=tmp_path)
    stdout, stderr = done.communicate(timeout=60)
    assert done.returncode == 0
    assert stdout == b"hello new\n"
    assert b"changed since the zygote imported it; starting the worker cold" in stderr
    assert json.loads(out.read_text())["warm"] is None


def test_without_a_zygote_the_worker_starts_cold(script: Path, tmp_path: Path) -> None:
    for socket_path in (None, tmp_path / "absent.sock"):
        out = tmp_path / "out.json"
        done = client(socket_path, out, str(script), "4", cwd=tmp_path)
        stdout, _ = done.communicate(timeout=60)
        assert done.returncode == 4
        assert stdout == b"hello out\n"
        assert json.loads(out.read_text())["warm"] is None


def test_a_module_target_runs_as_python_dash_m(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    _, socket_path = zygote
    out = tmp_path / "out.json"
    done = client(socket_path, out, "-m", "train", "5", cwd=script.parent)
    done.communicate(timeout=30)
    assert done.returncode == 5
    seen = json.loads(out.read_text())
    assert seen["warm"] is not None
    assert seen["argv"] == [str(script), "5"]
    assert seen["path0"] == str(script.parent)


def test_the_scripts_top_level_imports_are_what_the_zygote_imports() -> None:
    source = textwrap.dedent(
        """
        import os, numpy as np
        from torch import nn
        from . import sibling
        try:
            import apex
        except ImportError:
            pass
        if TYPE_CHECKING:
            import typing_only
        def f():
            import inside_a_function
        if __name__ == "__main__":
            import only_when_run
        """
    )
    assert top_level_imports(source) == [
        "os", "numpy", "torch", "torch:nn", "apex", "typing_only",
    ]  # fmt: skip
    assert top_level_imports("def broken(:") == []


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_script_that_imports_nothing_of_slurmft_finds_none_of_it_loaded(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path
) -> None:
    """As under a cold start (slurmft/train/examples/plain.py reports what it finds)."""
    _, socket_path = zygote
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'slurmft']\n"
        "warm = os.environ.get('SLURMFT_WARM_START')\n"
        "open(os.environ['OUT'], 'w').write(json.dumps([warm, loaded]))\n"
    )
    out = tmp_path / "out.json"
    # The zygote was started for `script`, which imports nothing of slurmft either.
    done = client(socket_path, out, str(probe), cwd=tmp_path)
    done.communicate(timeout=30)
    warm, loaded = json.loads(out.read_text())
    assert warm is not None and loaded == []


@pytest.mark.parametrize("body", [b'{"name": "x.py"}', b"not json", b'{"name": 1, "module": false, '
                                  b'"args": 5, "env": [], "cwd": "/"}'])  # fmt: skip
def test_a_malformed_request_is_dropped_and_the_zygote_serves_the_next(
    zygote: tuple[subprocess.Popen[bytes], Path], script: Path, tmp_path: Path, body: bytes
) -> None:
    process, socket_path = zygote
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
        bad.connect(str(socket_path))
        socket.send_fds(bad, [HEADER.pack(len(body))], list(STREAMS))
        bad.sendall(body)
        bad.settimeout(10)
        assert bad.recv(100) == b""  # closed without a fork
    out = tmp_path / "out.json"
    done = client(socket_path, out, str(script), "0", cwd=tmp_path)
    done.communicate(timeout=30)
    assert done.returncode == 0 and json.loads(out.read_text())["warm"] == str(process.pid)


@pytest.mark.torch
def test_the_launcher_forks_the_zygote_after_its_torch_import_and_the_workers_start_warm(
    script: Path, tmp_path: Path
) -> None:
    """torchrun (the launcher, `--warm-workers`) runs one worker through a zygote it forked:
    the worker runs warm with torchrun's rank and unbuffered streams, the zygote is named, the
    launcher's environment keeps no trace of the zygote's CUDA guard, and no zygote outlives
    the launcher."""
    out = tmp_path / "out.json"
    probe = tmp_path / "probe.py"  # what the worker sees of its own process and its parent's
    probe.write_text(SCRIPT.replace(
        '"cpus": sorted(os.sched_getaffinity(0)),',
        '"cpus": [], "comm": Path("/proc/self/comm").read_text().strip(),'
        ' "parent": os.getppid(), "cuda_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),'
        ' "stdout_buffered": hasattr(sys.stdout.buffer, "raw"),'
        ' "zygote_comm": Path(f"/proc/{os.getppid()}/comm").read_text().strip(),'
        ' "zygote_argv": Path(f"/proc/{os.getppid()}/cmdline").read_text().split(chr(0)),',
    ))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURMFT_", "PYTORCH_NVML"))}
    env.update({"OUT": str(out), "SLURMFT_AGENT_SOCKET": str(tmp_path / "ranks.sock")})
    launcher = subprocess.run(
        [
            *(sys.executable, "-m", "slurmft.agent.launcher", "--no-wait-list-fix"),
            *("--warm-workers", "--", "--standalone", "--nproc-per-node=1"),
            *("-m", "slurmft.agent.warm_start", str(probe), "5"),
        ],
        env=env, cwd=tmp_path, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    stderr = launcher.stderr.decode(errors="replace")
    assert launcher.returncode == 1, stderr  # the worker's exit 5 fails torchrun
    assert "hello out" in launcher.stdout.decode()
    seen = json.loads(out.read_text())
    zygote = int(seen["warm"])  # forked by the zygote, and the zygote by the launcher
    assert seen["parent"] == zygote
    assert seen["zygote_comm"] == "slurmft-zygote"
    assert seen["zygote_argv"][1:3] == ["-m", "slurmft.agent.launcher"]  # forked, not exec'd
    assert "slurmft zygote: ready in" in stderr
    assert seen["rank"] == "0"
    assert seen["argv"] == [str(probe), "5"]
    assert seen["comm"] == Path(f"/proc/{os.getpid()}/comm").read_text().strip()  # python's
    assert seen["cuda_check"] is None
    assert not seen["stdout_buffered"]  # as under `python -u`
    wait_for(lambda: not Path(f"/proc/{zygote}").exists(), 10, "the zygote to go")
