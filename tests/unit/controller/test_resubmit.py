"""The recorded submission: what `slurmft submit` sends with attach_job, checked before it is
stored, and turned back into the same job with the day's exclusions."""

from __future__ import annotations

import pytest

from slurmft.controller.resubmit import (
    SubmissionError,
    check_record,
    request_from_record,
    submission_record,
)
from slurmft.slurm.api import SubmitRequest

REQUEST = SubmitRequest(
    script="#!/bin/bash\nexec slurmft agent batch\n",
    job_name="slurmft-demo",
    run_id="r1",
    nodes=3,
    spare_nodes=1,
    exclude=("n9",),
    signal="B:USR1@300",
    time_limit="1:00:00",
)


def test_a_record_is_the_same_job_with_the_days_exclusions() -> None:
    record = check_record(submission_record(REQUEST, workdir="/home/u", path="/usr/bin"))
    assert record["exclude"] == [] and (record["workdir"], record["path"]) == (
        "/home/u",
        "/usr/bin",
    )
    again = request_from_record(record, ["n5", "n2"])
    assert again.exclude == ("n2", "n5")
    assert again == SubmitRequest(
        **{**vars(REQUEST), "exclude": ("n2", "n5"), "workdir": "/home/u"}
    )


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ([], "a submission record is a JSON object"),
        ({"script": "#!/bin/bash\n"}, "the recorded submission is incomplete"),
        (
            {"script": "echo hi", "job_name": "x", "run_id": "r1", "nodes": 1},
            "the recorded submission has no batch script",
        ),
    ],
)
def test_a_malformed_record_is_refused_with_the_reason(record: object, message: str) -> None:
    with pytest.raises(SubmissionError, match=message):
        check_record(record)


_GOOD = {"script": "#!/bin/bash\n", "job_name": "x", "run_id": "r1", "nodes": 1}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("nodes", "2", "'nodes' is str '2', expected int"),
        ("nodes", True, "'nodes' is bool True, expected int"),
        ("no_kill", "yes", "'no_kill' is str 'yes', expected bool"),
        ("time_limit", 60, "'time_limit' is int 60, expected str"),
        ("exclude", "n1", "'exclude' is str 'n1', expected a list"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_with_its_name(
    field: str, value: object, message: str
) -> None:
    """Issue 14, item 3: a mistyped record is a SubmissionError (its run waits for the owner),
    never an exception deep in sbatch's argv that stops the pass for every run."""
    with pytest.raises(SubmissionError, match=message):
        request_from_record({**_GOOD, field: value}, ())
    assert request_from_record({**_GOOD, "time_limit": None}, ()).time_limit is None


def test_every_submit_request_field_has_its_recorded_type() -> None:
    from dataclasses import fields

    from slurmft.controller.resubmit import _RECORD_TYPES

    # action_id is never the record's: each resubmission is tagged with its own action.
    assert {f.name for f in fields(SubmitRequest)} - {"action_id"} == set(_RECORD_TYPES)
