"""A sampler defined over one global sample order, so a resume starts at the exact sample.

Epoch e visits the samples in the order `permutation(seed, e)`; the run consumes that endless
sequence front to back, one global batch per step. The state is a single number, the count of
samples consumed, which does not depend on the world size: after a restart at any world size the
next global batch is exactly the samples that would have come next, none replayed or skipped.

Within one global batch the positions are laid out micro step by micro step, rank by rank:
micro step j of rank r takes positions [start + (j * world + r) * micro, ... + micro).
"""

from __future__ import annotations

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
