"""The node agent imports the schema and verification parts of slurmft.train without torch."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = [
    "slurmft.train",
    "slurmft.train.report",
    "slurmft.train.heartbeat",
    "slurmft.train.stacks",
    "slurmft.train.manifest",
    "slurmft.train.resume",
    "slurmft.train.straggler",
    "slurmft.train.batching",
    "slurmft.train.save_request",
]


def test_the_agent_side_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in TORCH_FREE)
        + "from slurmft.train import Phase, ReportChannel, is_overdue\n"
        + "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
