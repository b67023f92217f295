"""A sampler defined over one global sample order, so a resume starts at the exact sample.

Epoch e visits the samples in the order `permutation(seed, e)`; the run consumes that endless
sequence front to back, one global batch per step. The state is a single number, the count of
samples consumed, which does not depend on the world size: after a restart at any world size the
next global batch is exactly the samples that would have come next, none replayed or skipped.

Within one global batch the positions are laid out micro step by micro step, rank by rank:
micro step j of rank r takes positions [start + (j * world + r) * micro, ... + micro).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from slurmft.train.batching import BatchPlan
from slurmft.train.resume import ResumeRefused


class GlobalOrderSampler:
    def __init__(self, dataset_size: int, seed: int, shuffle: bool = True, consumed: int = 0):
        if dataset_size <= 0:
            raise ValueError("dataset_size must be positive")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = consumed
        self._cached_epoch = -1
        self._cached_order = np.arange(0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._cached_order = rng.permutation(self.dataset_size)
            else:
                self._cached_order = np.arange(self.dataset_size)
            self._cached_epoch = epoch
        return self._cached_order

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices at global positions [start, start + count), across epoch ends."""
        out: list[int] = []
        position = start
        while len(out) < count:
            epoch, offset = divmod(position, self.dataset_size)
            take = min(count - len(out), self.dataset_size - offset)
            out.extend(int(i) for i in self.epoch_order(epoch)[offset : offset + take])
            position += take
        return out

    def rank_micro_batches(self, plan: BatchPlan, rank: int) -> list[list[int]]:
        """This rank's micro batches of the next global batch (does not advance)."""
        batches = []
        for micro_step in range(plan.accumulation_steps):
            slot = micro_step * plan.world_size + rank
            batches.append(self.indices(self.consumed + slot * plan.micro_batch, plan.micro_batch))
        return batches

    def global_batch(self, plan: BatchPlan) -> list[int]:
        return self.indices(self.consumed, plan.global_batch)

    def advance(self, plan: BatchPlan) -> None:
        self.consumed += plan.global_batch

    @property
    def epoch(self) -> int:
        return self.consumed // self.dataset_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {"dataset_size": self.dataset_size, "seed": self.seed, "shuffle": self.shuffle}
        theirs = {key: state[key] for key in mine}
        if mine != theirs:
            raise ResumeRefused(
                f"the checkpoint's sample order {theirs} differs from this run's {mine}: resuming "
                f"would replay or skip samples. Use the same dataset and seed."
            )
        self.consumed = int(state["consumed"])


class ResumableSampler:
    """One rank's share of one global sample order, for a DataLoader; resumable at the sample.

    Epoch e visits ``permutation(seed, e)`` (as GlobalOrderSampler), cut into steps of
    world size x batch_size samples (an epoch's remainder is left out, so every rank gets as
    many whole batches); rank r takes the r-th slice of batch_size in each step. The position
    is the samples of the epoch consumed by all ranks together, which the training loop
    advances after each batch (a DataLoader reads ahead, so the sampler cannot count for it).
    It does not depend on the world size: a restart with the same global batch at another
    world size goes on at the same sample. Rank and world size are read from torchrun's RANK
    and WORLD_SIZE when iterating, unless given.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if dataset_size <= 0 or batch_size <= 0:
            raise ValueError("dataset_size and batch_size must be positive")
        self.order = GlobalOrderSampler(dataset_size, seed, shuffle)
        self.batch_size = batch_size
        self._rank = rank
        self._world_size = world_size
        self.epoch = 0
        self.consumed = 0  # samples of this epoch, all ranks together

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else int(os.environ.get("RANK", "0"))

    @property
    def world_size(self) -> int:
        if self._world_size is not None:
            return self._world_size
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def step_samples(self) -> int:
        return self.world_size * self.batch_size

    def steps_per_epoch(self) -> int:
        return self.order.dataset_size // self.step_samples

    def __len__(self) -> int:
        return self.steps_per_epoch() * self.batch_size

    def __iter__(self) -> Iterator[int]:
        order = self.order.epoch_order(self.epoch)
        step_samples, rank, batch = self.step_samples, self.rank, self.batch_size
        for step in range(self.consumed // step_samples, self.steps_per_epoch()):
            start = step * step_samples + rank * batch
            yield from (int(i) for i in order[start : start + batch])

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts at its first sample; the same epoch again (a resume) where it
        stood."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def advance(self, batches: int = 1) -> None:
        self.consumed += batches * self.step_samples

    def state_dict(self) -> dict[str, Any]:
        return {**self.order.state_dict(), "consumed": self.consumed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict({**state, "consumed": 0})  # refuses another sample order
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
