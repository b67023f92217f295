"""The Python API: submit training runs and follow them from Python.

::

    import slurmft

    run = slurmft.submit({"nodes": 2, "spares": 1, "ckpt_dir": "/shared/ck",
                          "script": ["train.py", "--epochs", "10"]})
    print(run.status().doing)
    final = run.wait()
    print(final.state, final.effective_ratio)

The command line is built on it: `slurmft submit` turns its flags into a spec and calls
`submit`; `runs`, `status`, `events` and `cancel` print what `runs` and `Run` return. Results
are typed (`RunStatus`, `EventPage`, ...) and ``to_dict()`` gives the structure of the matching
``--json`` output. docs/python-api.md has the whole of it.
"""

from slurmft.api.records import (
    ActionRecord,
    Checkpoint,
    EffectiveTime,
    EventPage,
    RunStatus,
    RunSummary,
    TimelineEntry,
)
from slurmft.api.run import Run, WaitTimeout, runs
from slurmft.api.submission import SubmissionPlan, SubmitNote, plan_submission, submit
from slurmft.controller.rpc import DaemonUnreachable, RpcError
from slurmft.controller.spec import RunSpec, SpecError
from slurmft.core.states import RunState

__all__ = [
    "ActionRecord",
    "Checkpoint",
    "DaemonUnreachable",
    "EffectiveTime",
    "EventPage",
    "RpcError",
    "Run",
    "RunSpec",
    "RunState",
    "RunStatus",
    "RunSummary",
    "SpecError",
    "SubmissionPlan",
    "SubmitNote",
    "TimelineEntry",
    "WaitTimeout",
    "plan_submission",
    "runs",
    "submit",
]
