from __future__ import annotations

import pytest

from slurmft.train.resume import ResumeRefused, TrainingContract, check_resume

SCHEDULE = {"kind": "cosine", "lr": 0.1, "warmup": 10, "total": 1000}
SAVED = TrainingContract(96, SCHEDULE).to_json()


def test_an_unchanged_contract_resumes_silently() -> None:
    assert check_resume(SAVED, TrainingContract(96, dict(SCHEDULE)), checkpoint="c") == []


def test_a_changed_global_batch_is_refused_with_what_to_do() -> None:
    with pytest.raises(ResumeRefused) as refused:
        check_resume(SAVED, TrainingContract(64, SCHEDULE), checkpoint="/ckpt/step-000000010")
    message = str(refused.value)
    assert "/ckpt/step-000000010" in message
    assert "global batch would change from 96 to 64" in message
    assert "allow_global_batch_change" in message


def test_a_changed_lr_schedule_is_refused() -> None:
    with pytest.raises(ResumeRefused, match="LR schedule would change"):
        check_resume(SAVED, TrainingContract(96, {**SCHEDULE, "lr": 0.2}), checkpoint="c")


def test_changes_pass_when_explicitly_allowed_and_are_noted() -> None:
    notes = check_resume(
        SAVED,
        TrainingContract(64, {**SCHEDULE, "total": 2000}),
        checkpoint="c",
        allow_global_batch_change=True,
        allow_lr_schedule_change=True,
    )
    assert len(notes) == 2
    assert all(note.startswith("allowed:") for note in notes)
