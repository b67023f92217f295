"""The interpreter a run's job uses (`slurmft submit --python`), found and checked on the login
node, as the submitting user, before anything reaches Slurm.

The job runs slurmft's agent, torchrun and the training workers with one interpreter. Which one
used to be whichever `slurmft` the user typed; with the documented layout (slurmft in its own
venv on the login node) that venv has no torch, and the run failed on the nodes. So the default
is the active environment's interpreter, the check runs it, and its torch version (not the
login venv's) decides whether hot spares can work.

The check imports slurmft.train but only finds torch (its module and its package metadata): a
cold `import torch` costs 1.5-2.5 s of CPU on a quiet host and far longer from a network
filesystem, on every submit, and it proves little more. Where torch is missing, the environment
has no slurmft, or the interpreter is not there, the check says so as before; a torch installed
without metadata is imported for its version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slurmft.controller.spec import SpecError

CHECK_TIMEOUT_S = 180.0  # an interpreter's first start from a network filesystem takes a while
# What the interpreter must import and find, and what it says back.
_CHECK = (
    "import importlib.metadata, importlib.util, json, sys\n"
    "import slurmft.train\n"
    "if importlib.util.find_spec('torch') is None:\n"
    "    raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    "try:\n"
    "    version = importlib.metadata.version('torch')\n"
    "except importlib.metadata.PackageNotFoundError:  # a torch without metadata\n"
    "    import torch\n"
    "    version = torch.__version__\n"
    "print(json.dumps({'executable': sys.executable, 'torch': version}))\n"
)
CONTAINER_PYTHON = "python3"  # inside an image: found on the image's PATH


def default_python(environ: Mapping[str, str] | None = None) -> str:
    """The active venv's interpreter, else the active conda env's, else this one's."""
    environ = os.environ if environ is None else environ
    for variable in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        prefix = environ.get(variable)
        if prefix and (Path(prefix) / "bin" / "python").exists():
            return str(Path(prefix) / "bin" / "python")
    return sys.executable


@dataclass(frozen=True)
class Checked:
    """What the check found: the torch version (None when it could not run here)."""

    torch: str | None
    warning: str = ""


def check_python(python: str, wrapper: Sequence[str] = (), *, pyxis: bool = False) -> Checked:
    """Run ``python`` (under ``wrapper``, a container command) and see that it imports
    slurmft.train and torch. A pyxis image, or a wrapper whose program this host lacks, cannot
    be entered here: the check is skipped with a warning."""
    if pyxis:
        return Checked(None, f"note: --python {python} is not checked: it runs inside the pyxis "
                       "image, which only srun on the nodes can enter")  # fmt: skip
    argv = [*wrapper, python, "-c", _CHECK]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        if wrapper:
            return Checked(None, f"note: --python {python} is not checked: {wrapper[0]} is not "
                           "installed here (the nodes run it)")  # fmt: skip
        raise SpecError(_missing(python)) from None
    except PermissionError:
        raise SpecError(_missing(python)) from None
    except subprocess.TimeoutExpired:
        raise SpecError(
            f"--python {python} did not import slurmft.train and find torch within "
            f"{CHECK_TIMEOUT_S:g} s; is its filesystem reachable?"
        ) from None
    if done.returncode != 0:
        raise SpecError(_failed(python, done.stderr))
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return Checked(str(found["torch"]))
    except (ValueError, IndexError, KeyError, TypeError):
        raise SpecError(f"--python {python} said {done.stdout[-300:]!r}, not its torch") from None


def _missing(python: str) -> str:
    return (
        f"--python {python}: no such interpreter (or not executable). Give the python of the "
        "environment that has torch and slurmft[train], e.g. --python /shared/venv/bin/python, "
        "or activate that environment before slurmft submit"
    )


def _failed(python: str, stderr: str) -> str:
    last = stderr.strip().splitlines()[-1] if stderr.strip() else "(no error output)"
    if "No module named 'slurmft" in stderr or 'No module named "slurmft' in stderr:
        fix = f"install it there: {python} -m pip install 'slurmft[train]'"
    elif "No module named 'torch'" in stderr:
        fix = f"install torch there: {python} -m pip install torch (your site's build)"
    else:
        fix = "fix that environment, or give another with --python"
    return f"--python {python} cannot import slurmft.train and torch: {last}; {fix}"
