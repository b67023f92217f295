"""A user's script that submits a run through the Python API and follows it to its end
(test_submit_e2e): prints the run's and job's ids as soon as Slurm has the job, then the
timeline it followed and the final status, one JSON object per line."""

from __future__ import annotations

import json
import sys

import slurmft


def main() -> None:
    run = slurmft.submit(json.loads(sys.argv[1]))
    print(json.dumps({"run_id": run.run_id, "job_id": run.job_id}), flush=True)
    entries = [entry.to_dict() for entry in run.follow(interval_s=1.0)]
    final = run.wait(timeout_s=60, poll_s=1.0)
    assert run.spec is not None
    print(json.dumps({"entries": entries, "final": final.to_dict(), "spares": run.spec.spares}))


if __name__ == "__main__":
    main()
