"""Numerical faults: a non-finite loss found before the gradients are reduced, and told apart.

Following Megatron-Core's rerun state machine: when a rank's loss (or, optionally, its local
gradients) is NaN or Inf, every rank re-runs the step once, in place, on the same data with the
same RNG. The parameters have not changed (the check comes before the optimizer step), so the
re-run starts from exactly the state the step started from.
- Reproduced: the data or the model is at fault (a poisoned sample, a diverging run). The
  user's policy applies:
  - `record`: report it and go on as the script would have (the non-finite steps right after
    it are the same episode, neither re-run nor reported);
  - `stop`: report it and end the run (every rank exits with NUMERICAL_STOP_EXIT_CODE and the
    daemon stops the run);
  - `skip`: report it and drop the global batch (no update; the samples it held are named).
- Not reproduced: the same computation gave another answer, so the rank's node is suspected of
  a hardware fault (silent data corruption); training goes on with the re-run's result, and the
  report counts towards the node's lemon standing in the daemon.
`off` checks nothing.

Cost on a step without a fault: one all-reduce of one float per rank (the ranks must agree
whether to re-run) and a copy of the RNG states at the step's start (docs/train.md gives the
measured figures). A re-run costs one step.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slurmft.train.report import ReportChannel
from slurmft.train.timing import StepTimer

NUMERICAL_STOP_EXIT_CODE = 76  # a reproduced numerical fault under the `stop` policy
POLICY_ENV = "SLURMFT_NUMERICAL_POLICY"  # the policy when the script gives none


class NumericalPolicy(StrEnum):
    OFF = "off"
    RECORD = "record"
    STOP = "stop"
    SKIP = "skip"


@dataclass(frozen=True)
class NumericalVerdict:
    """What one check found, the same on every rank."""

    step: int
    reproduced: bool
    first_ranks: tuple[int, ...]  # ranks whose first computation was non-finite
    ranks: tuple[int, ...]  # ranks whose re-run was non-finite too (reproduced only)
    samples: tuple[int, ...]  # dataset indices non-finite on the re-run, all ranks together
    action: str  # "continue" (not reproduced: the re-run's result), "record", "skip", "stop"

    @property
    def use_rerun(self) -> bool:
        """Train on the re-run's result (its gradients), not the first computation's."""
        return not self.reproduced


class NumericalGuard:
    """Call `begin_step()` before a step's forward, then `check(step, bad, rerun)` after its
    backward and before the gradients are reduced: ``bad`` is the dataset indices whose loss was
    non-finite on this rank (or a non-empty marker for non-finite gradients), ``rerun`` redoes
    the step's forward and backward on the same data (zeroing the gradients first) and returns
    the same for its result. Collective: every rank calls both every step."""

    def __init__(
        self,
        channel: ReportChannel,
        policy: NumericalPolicy | str | None = None,
        device: torch.device | None = None,
        timer: StepTimer | None = None,
    ) -> None:
        chosen = policy if policy is not None else os.environ.get(POLICY_ENV, "record")
        self.policy = NumericalPolicy(chosen)
        self.channel = channel
        self.device = device
        # With the step's timer, the guard's collectives are timed (and named in heartbeats) as
        # wait and its re-run as compute: a rank hung elsewhere leaves its peers waiting here,
        # and they must read as its victims, not as hung themselves.
        self.timer = timer
        self._rng: tuple[Any, ...] | None = None
        # Under `record`, a run that went non-finite usually stays so: the steps after a
        # reproduced fault are the same episode, not re-run or reported again until a step is
        # finite on every rank.
        self._episode: NumericalVerdict | None = None

    def begin_step(self) -> None:
        if self.policy is NumericalPolicy.OFF:
            return
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        self._rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    def _restore_rng(self) -> None:
        assert self._rng is not None, "begin_step() was not called for this step"
        python, numpy_state, cpu, cuda = self._rng
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)

    def check(
        self, step: int, bad: Sequence[int], rerun: Callable[[], Sequence[int]]
    ) -> NumericalVerdict | None:
        """None when every rank's step was finite (or the policy is off); else the verdict,
        reported, after the one re-run."""
        if self.policy is NumericalPolicy.OFF:
            return None
        first = self._ranks_with(bool(bad))
        if not first:
            self._episode = None
            return None
        if self._episode is not None:
            return NumericalVerdict(step, True, first, first, (), self._episode.action)
        self._restore_rng()
        with self._section("compute"):
            again = list(rerun())
        ranks = self._ranks_with(bool(again))
        reproduced = bool(ranks)
        samples = self._all_samples(again) if reproduced else ()
        action = self.policy.value if reproduced else "continue"
        verdict = NumericalVerdict(step, reproduced, first, ranks, samples, action)
        self._report(verdict, first_bad=list(bad))
        if reproduced and self.policy is NumericalPolicy.RECORD:
            self._episode = verdict
        return verdict

    def _section(self, kind: str) -> AbstractContextManager[None]:
        if self.timer is None:
            return nullcontext()
        return self.timer.compute() if kind == "compute" else self.timer.wait()

    def _ranks_with(self, flagged: bool) -> tuple[int, ...]:
        if not (dist.is_available() and dist.is_initialized()):
            return (0,) if flagged else ()
        world, rank = dist.get_world_size(), dist.get_rank()
        flags = torch.zeros(world, dtype=torch.float32, device=self.device)
        flags[rank] = 1.0 if flagged else 0.0
        with self._section("wait"):
            dist.all_reduce(flags)
        return tuple(r for r, f in enumerate(flags.tolist()) if f > 0)

    def _all_samples(self, mine: list[int]) -> tuple[int, ...]:
        """Every rank's non-finite samples (only on a reproduced fault: rare, so an object
        gather is fine). A marker for non-finite gradients (-1) is no sample."""
        if not (dist.is_available() and dist.is_initialized()):
            return tuple(sorted(i for i in set(mine) if i >= 0))
        gathered: list[Any] = [None] * dist.get_world_size()
        with self._section("wait"):
            dist.all_gather_object(gathered, mine)
        return tuple(sorted({i for part in gathered for i in part if i >= 0}))

    def _report(self, verdict: NumericalVerdict, first_bad: list[int]) -> None:
        """Not reproduced: each rank that saw it reports (its node is the suspect).
        Reproduced: the lowest rank whose re-run failed reports once, for the run."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        reporter = (
            rank in verdict.first_ranks if not verdict.reproduced else rank == verdict.ranks[0]
        )
        if not reporter:
            return
        self.channel.send(
            "event",
            event="numerical_fault",
            step=verdict.step,
            reproduced=verdict.reproduced,
            action=verdict.action,
            policy=self.policy.value,
            samples=list(verdict.samples[:64]),
            first_samples=sorted(i for i in set(first_bad) if i >= 0)[:64],
            ranks=list(verdict.ranks or verdict.first_ranks),
            summary=summary(verdict, self.policy),
        )


def summary(verdict: NumericalVerdict, policy: NumericalPolicy) -> str:
    """The verdict in words, for the run's timeline."""
    if not verdict.reproduced:
        ranks = ", ".join(map(str, verdict.first_ranks))
        return (
            f"non-finite loss at step {verdict.step} on rank {ranks}, finite when re-run on the "
            f"same data: a suspected hardware fault of its node; training went on"
        )
    samples = ", ".join(map(str, verdict.samples[:8])) or "none named (gradients)"
    done = {
        NumericalPolicy.RECORD: "recorded; training went on",
        NumericalPolicy.SKIP: "the global batch was skipped",
        NumericalPolicy.STOP: "the run stops",
    }[policy]
    return (
        f"non-finite loss at step {verdict.step}, again when re-run on the same data "
        f"(samples {samples}): numerical or data; policy {policy.value}: {done}"
    )
