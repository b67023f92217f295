from __future__ import annotations

import pytest

from slurmft.train.batching import plan_batches
from slurmft.train.resume import ResumeRefused
from slurmft.train.sampler import GlobalOrderSampler, ResumableSampler

# The sampler uses numpy, which comes with the train extra.
pytestmark = pytest.mark.torch


def consume(sampler: GlobalOrderSampler, world: int, max_micro: int, steps: int) -> list[list[int]]:
    """Per step, the sorted union of what every rank reads."""
    plan = plan_batches(12, world, max_micro)
    steps_seen = []
    for _ in range(steps):
        union = [i for r in range(world) for mb in sampler.rank_micro_batches(plan, r) for i in mb]
        steps_seen.append(sorted(union))
        sampler.advance(plan)
    return steps_seen


def test_the_global_batches_do_not_depend_on_the_world_size() -> None:
    three = consume(GlobalOrderSampler(50, seed=7), world=3, max_micro=4, steps=9)
    two = consume(GlobalOrderSampler(50, seed=7), world=2, max_micro=4, steps=9)
    four = consume(GlobalOrderSampler(50, seed=7), world=4, max_micro=1, steps=9)
    assert three == two == four


def test_ranks_read_disjoint_samples_that_cover_the_global_batch() -> None:
    sampler = GlobalOrderSampler(1000, seed=3)
    plan = plan_batches(24, 3, 4)  # micro 4, accumulation 2
    flat = [i for r in range(3) for batch in sampler.rank_micro_batches(plan, r) for i in batch]
    assert len(flat) == len(set(flat)) == 24
    assert sorted(flat) == sorted(sampler.global_batch(plan))


def test_a_resume_continues_at_the_exact_sample_even_at_another_world_size() -> None:
    uninterrupted = consume(GlobalOrderSampler(50, seed=1), world=3, max_micro=4, steps=10)
    first = GlobalOrderSampler(50, seed=1)
    before = consume(first, world=3, max_micro=4, steps=4)
    resumed = GlobalOrderSampler(50, seed=1)
    resumed.load_state_dict(first.state_dict())
    after = consume(resumed, world=2, max_micro=3, steps=6)
    assert before + after == uninterrupted


def test_epochs_wrap_with_a_new_permutation_and_every_sample_once_per_epoch() -> None:
    sampler = GlobalOrderSampler(10, seed=5)
    first, second = sampler.indices(0, 10), sampler.indices(10, 10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert sampler.indices(8, 4) == first[8:] + second[:2]


def test_a_different_sample_order_is_refused() -> None:
    saved = GlobalOrderSampler(50, seed=1, consumed=24).state_dict()
    with pytest.raises(ResumeRefused, match="replay or skip"):
        GlobalOrderSampler(50, seed=2).load_state_dict(saved)


def _global_batches(world: int, batch: int, consumed: int, steps: int) -> list[list[int]]:
    """The next ``steps`` global batches as the ranks of a ``world``-size run read them (each
    rank its own ResumableSampler resumed at ``consumed``)."""
    ranks = []
    for rank in range(world):
        sampler = ResumableSampler(100, batch, seed=7, rank=rank, world_size=world)
        sampler.load_state_dict({**sampler.state_dict(), "consumed": consumed, "epoch": 0})
        ranks.append(list(sampler))
    return [
        sorted(i for rank in ranks for i in rank[step * batch : (step + 1) * batch])
        for step in range(steps)
    ]


def test_resumable_sampler_shards_each_step_across_ranks_without_overlap() -> None:
    shares = [list(ResumableSampler(100, 4, seed=7, rank=r, world_size=3)) for r in range(3)]
    assert [len(s) for s in shares] == [32, 32, 32]  # 8 whole steps of 12; 4 samples left out
    taken = [i for share in shares for i in share]
    assert len(set(taken)) == 96 and set(taken) <= set(range(100))


def test_resumable_sampler_resumes_at_the_same_samples_at_another_world_size() -> None:
    """A global batch of 8: 2 ranks x 4 before the restart, 4 ranks x 2 after."""
    whole = _global_batches(2, 4, 0, 12)
    assert _global_batches(4, 2, 5 * 8, 7) == whole[5:]
    assert _global_batches(2, 4, 5 * 8, 7) == whole[5:]


def test_resumable_sampler_counts_what_was_trained_not_what_was_read() -> None:
    sampler = ResumableSampler(100, 4, seed=7, rank=0, world_size=2)
    first = list(sampler)  # a DataLoader reads ahead; only advance() moves the position
    sampler.advance(3)
    assert sampler.state_dict()["consumed"] == 24
    assert list(sampler) == first[12:]
    sampler.set_epoch(0)  # the same epoch again (a resume): where it stood
    assert sampler.consumed == 24
    sampler.set_epoch(1)  # the next epoch: from its start, in its own order
    assert sampler.consumed == 0 and list(sampler) != first


def test_resumable_sampler_refuses_another_sample_order() -> None:
    saved = ResumableSampler(100, 4, seed=7, rank=0, world_size=2).state_dict()
    with pytest.raises(ResumeRefused, match="sample order"):
        ResumableSampler(100, 4, seed=8, rank=0, world_size=2).load_state_dict(saved)
