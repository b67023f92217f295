"""A tiny data-parallel training run that uses all of slurmft.train.

    torchrun --standalone --nproc-per-node=3 -m slurmft.train.examples.tiny \
        --ckpt-dir /shared/ckpt --out-dir /tmp/out --steps 20 --ckpt-every 5

Synthetic deterministic regression data, an MLP with dropout (so RNG state matters), SGD with
momentum and a warmup-then-linear LR schedule, gradients all-reduced by hand with the telemetry
slots piggy-backed. Rank 0 appends one JSON line per step to `<out-dir>/losses.jsonl` (loss, LR,
a fingerprint of the samples of the global batch) and events to `<out-dir>/events.jsonl`; at the
end it writes `<out-dir>/final_weights.pt`. Flags inject faults for tests: a slow rank or node,
a crash at a step, a hang, a kill in the middle of a save, a long save. `--work-ms` simulates
per-step device compute with a sleep, so timing tests do not depend on CPU contention between
ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from slurmft.errors import SlurmftError
from slurmft.train import (
    BatchPlan,
    CheckpointManager,
    DistInfo,
    GlobalOrderSampler,
    Heartbeat,
    PeerGroups,
    Phase,
    ReportChannel,
    SaveRequest,
    StepTimer,
    StragglerDetector,
    StragglerNotices,
    TrainingContract,
    all_reduce_with_telemetry,
    check_resume,
    exchange_telemetry,
    exit_on_collective_error,
    exit_without_teardown,
    init_distributed,
    install_stack_dump,
    plan_batches,
    restore_rng_state,
)
from slurmft.train.numerical import NUMERICAL_STOP_EXIT_CODE, NumericalGuard, NumericalVerdict
from slurmft.train.report import rdzv_round
from slurmft.train.snapshot import MemorySnapshots, Restored

DATASET_SIZE = 600
FEATURES = 16
# How long a crashing rank waits for its node's writer to finish the step's snapshot.
SNAPSHOT_WRITE_WAIT_S = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, help="shared directory; {rank} is substituted")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=0, help="steps between evaluations; 0: none")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--max-micro-batch", type=int, default=4)
    p.add_argument("--no-accumulation", action="store_true", help="naive: micro batch fixed")
    # 0.01 trains at every world size and global batch tried (1,000 steps: the last 50 steps'
    # mean loss 3-5 % of the first 50's); at 0.05 the loss went NaN from about step 40.
    p.add_argument("--lr", type=float, default=0.01, help="peak learning rate (SGD, momentum 0.9)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--allow-global-batch-change", action="store_true")
    p.add_argument("--allow-lr-schedule-change", action="store_true")
    p.add_argument("--telemetry", choices=["piggyback", "gather"], default="piggyback")
    p.add_argument("--telemetry-every", type=int, default=5, help="steps between gathers")
    p.add_argument("--straggler-window", type=int, default=10)
    p.add_argument("--pg-timeout-s", type=float, default=60.0)
    p.add_argument("--heartbeat-interval-s", type=float, default=5.0)
    p.add_argument("--step-deadline-s", type=float, default=300.0)
    p.add_argument("--work-ms", type=float, default=0.0, help="simulated compute per step")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=0.3)
    p.add_argument("--slow-from-step", type=int, default=0)
    p.add_argument(
        "--slow-nodes-file",
        default="",
        help="a file of node names, one a line, read every step: a rank on a listed node\n"
        "($SLURMD_NODENAME) is slowed by --slow-factor from --slow-from-step on. The\n"
        "slowdown follows the node, not the rank: a rank that moves off it runs at speed",
    )
    p.add_argument("--slow-save-s", type=float, default=0.0, help="extra seconds per save")
    p.add_argument("--crash-at-step", default="", help="STEP[@ATTEMPT|*]: SIGKILL --fault-rank")
    p.add_argument("--kill-during-save", default="", help="STEP[@ATTEMPT]: SIGKILL mid-save")
    p.add_argument("--hang-at-step", default="", help="STEP[@ATTEMPT]: stop calling collectives")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument(
        "--numerical-policy",
        choices=["off", "record", "stop", "skip"],
        default=None,
        help="what a non-finite loss that a re-run reproduces does (slurmft.train.numerical;\n"
        "default: $SLURMFT_NUMERICAL_POLICY, else record)",
    )
    p.add_argument(
        "--snapshots",
        action="store_true",
        help="in-memory snapshots (slurmft.train.snapshot) in --snapshot-dir, else\n"
        "$SLURMFT_SNAPSHOT_DIR (the agent's tmpfs folder); a restart resumes from the newest",
    )
    p.add_argument("--snapshot-dir", default=None, help="{rank} is substituted")
    p.add_argument("--snapshot-every", type=int, default=0, help="0: from the measured cost")
    p.add_argument(
        "--corrupt-snapshots-at-crash",
        action="store_true",
        help="--crash-at-step first flips a byte of every snapshot this node holds",
    )
    p.add_argument("--check-grads", action="store_true", help="also check local gradients")
    p.add_argument("--poison-index", type=int, default=-1, help="a dataset sample made NaN")
    p.add_argument(
        "--nan-once-at-step",
        default="",
        help="STEP[@ATTEMPT]: --fault-rank's loss is NaN once (its re-run is finite)",
    )
    return p.parse_args(argv)


def torchrun_attempt() -> int:
    """Which start of the workers this is: under slurmft's launcher the rendezvous round, the
    same on every node; under a plain torchrun, TORCHELASTIC_RESTART_COUNT, which counts only
    the restarts of this node's own failed workers (a rank that moves to a node whose workers
    were stopped for a change of members would see its old attempt number again)."""
    round_ = rdzv_round()
    if round_ is not None:
        return round_
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def fault_due(spec: str, step: int, rank: int, fault_rank: int) -> bool:
    """`STEP[@ATTEMPT]` matches this step on the fault rank in that attempt of the workers
    (`torchrun_attempt`; 0 when left out); `STEP@*` in every attempt: a script that always
    fails there."""
    if not spec or rank != fault_rank:
        return False
    at_step, _, attempt = spec.partition("@")
    if int(at_step) != step:
        return False
    return attempt == "*" or int(attempt or 0) == torchrun_attempt()


def on_slow_node(nodes_file: str) -> bool:
    """This process's node is listed in the file (a missing file lists nobody)."""
    if not nodes_file:
        return False
    try:
        listed = Path(nodes_file).read_text().split()
    except FileNotFoundError:
        return False
    return os.environ.get("SLURMD_NODENAME", "") in listed


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hang_forever() -> None:
    """A rank that stops calling collectives: its peers must time out, not wait forever."""
    threading.Event().wait()


class Journal:
    """Rank 0's per-step and event lines (other ranks write nothing)."""

    def __init__(self, out_dir: Path, rank: int):
        self.enabled = rank == 0
        self.attempt = torchrun_attempt()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.losses = out_dir / "losses.jsonl"
        self.events = out_dir / "events.jsonl"

    def _append(self, path: Path, record: dict[str, Any]) -> None:
        if self.enabled:
            with path.open("a") as stream:
                stream.write(json.dumps({"attempt": self.attempt, **record}) + "\n")

    def step(self, record: dict[str, Any]) -> None:
        self._append(self.losses, record)

    def event(self, event: str, **fields: Any) -> None:
        self._append(self.events, {"event": event, "time": time.time(), **fields})


def synthetic_dataset(seed: int, poison_index: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(DATASET_SIZE, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator)
    y = x @ w + 0.1 * torch.randn(DATASET_SIZE, 1, generator=generator)
    if poison_index >= 0:  # a corrupt record: every step that reads it has a NaN loss
        x[poison_index] = float("nan")
    return x, y


def build_model(seed: int, dropout: float) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 1))


def lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def seed_rank(seed: int, rank: int, step: int) -> None:
    """Per-rank RNG for a fresh start, or a new world size where old per-rank states don't map."""
    value = seed * 1_000_003 + step * 1009 + rank + 1
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient, there after the first backward (zero_grad keeps it, as zeros)."""
    assert p.grad is not None
    return p.grad


def make_plan(args: argparse.Namespace, world_size: int) -> BatchPlan:
    if args.no_accumulation:
        micro = args.max_micro_batch
        return BatchPlan(world_size * micro, world_size, micro, 1)
    return plan_batches(args.global_batch, world_size, args.max_micro_batch)


class TinyRun:
    def __init__(
        self,
        args: argparse.Namespace,
        info: DistInfo,
        channel: ReportChannel,
        heartbeat: Heartbeat,
    ):
        self.args, self.info, self.channel = args, info, channel
        self.rank, self.world = info.rank, info.world_size
        self.journal = Journal(Path(args.out_dir), self.rank)
        self.plan = make_plan(args, self.world)
        # Data and weights are made on the CPU (identical on every rank and backend), then moved.
        data = synthetic_dataset(args.seed, args.poison_index)
        self.x, self.y = (t.to(info.device) for t in data)
        self.model = build_model(args.seed, args.dropout).to(info.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, args.warmup, args.steps)
        )
        self.sampler = GlobalOrderSampler(DATASET_SIZE, seed=args.seed)
        self.contract = TrainingContract(
            self.plan.global_batch,
            {"kind": "warmup-linear", "lr": args.lr, "warmup": args.warmup, "total": args.steps},
        )
        self.timer = StepTimer(info.device, heartbeat)
        detector = StragglerDetector(PeerGroups.uniform(self.world), args.straggler_window)
        self.stragglers = StragglerNotices(channel, detector, speaks=self.rank == 0)
        self.save_request = SaveRequest()
        self.guard = NumericalGuard(
            channel, args.numerical_policy, device=info.device, timer=self.timer
        )
        self._nan_injected = False
        self.step = 0
        root = args.ckpt_dir.replace("{rank}", str(self.rank))
        self.checkpoints = CheckpointManager(
            root, args.keep_last, channel, on_shards_written=self._maybe_kill_during_save
        )
        self.snapshots: MemorySnapshots | None = None
        self.last_snapshot_step: int | None = None  # the newest snapshot this rank took part in
        if args.snapshots:
            folder = args.snapshot_dir
            self.snapshots = MemorySnapshots(
                folder=None if folder is None else folder.replace("{rank}", str(self.rank)),
                every=args.snapshot_every,
            )

    def _maybe_kill_during_save(self, step: int) -> None:
        if fault_due(self.args.kill_during_save, step, self.rank, self.args.fault_rank):
            kill_self()

    def _state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def resume(self) -> None:
        removed = self.checkpoints.check_shared_directory()
        if removed:
            self.journal.event("removed_unpublished", names=removed)
        checkpoint = self.checkpoints.latest_verified()
        if self.snapshots is not None:
            durable = None if checkpoint is None else checkpoint.resume["global_step"]
            outcome, state = self.snapshots.restore(durable)
            if outcome.restored is not None and state is not None:
                self._resume_from_snapshot(outcome.restored, state)
                return
            self.journal.event("snapshot_not_used", reason=outcome.reason, durable_step=durable)
        if checkpoint is None:
            seed_rank(self.args.seed, self.rank, 0)
            self.journal.event("fresh_start", plan=vars_of(self.plan))
            return
        notes = check_resume(
            checkpoint.resume["contract"],
            self.contract,
            checkpoint=str(checkpoint.path),
            allow_global_batch_change=self.args.allow_global_batch_change,
            allow_lr_schedule_change=self.args.allow_lr_schedule_change,
        )
        state = self._state()
        rng = self.checkpoints.load(checkpoint, state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        resume = checkpoint.resume
        self.scheduler.load_state_dict(resume["lr_scheduler"])
        self.sampler.load_state_dict(resume["sampler"])
        self.step = resume["global_step"]
        if rng is not None:
            restore_rng_state(rng)
        else:
            seed_rank(self.args.seed, self.rank, self.step)
        self.journal.event(
            "resumed",
            step=self.step,
            path=str(checkpoint.path),
            world_size=self.world,
            saved_world_size=checkpoint.manifest["world_size"],
            rng_restored=rng is not None,
            plan=vars_of(self.plan),
            notes=notes,
            skipped=list(checkpoint.skipped),
        )

    def _resume_from_snapshot(self, restored: Restored, state: dict[str, Any]) -> None:
        resume = restored.resume
        notes = check_resume(
            resume["contract"],
            self.contract,
            checkpoint=f"the in-memory snapshot of step {restored.step}",
            allow_global_batch_change=self.args.allow_global_batch_change,
            allow_lr_schedule_change=self.args.allow_lr_schedule_change,
        )
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.scheduler.load_state_dict(resume["lr_scheduler"])
        self.sampler.load_state_dict(resume["sampler"])
        self.step = resume["global_step"]
        restore_rng_state(restored.rng)
        self.journal.event(
            "resumed",
            step=self.step,
            source="snapshot",
            from_rank=restored.source_rank,
            world_size=self.world,
            plan=vars_of(self.plan),
            notes=notes,
        )

    def wait_for_snapshot(self) -> None:
        """Until the newest snapshot this rank took part in is on disk: the node's writer is its
        local rank 0, which may still be writing it in the background when another rank
        crashes. A fault injected after a step comes after that step's snapshot, as a crash in
        the middle of a write is not what the fault tests ask for (that leaves a partial file,
        and the snapshot before serves)."""
        if self.snapshots is None or self.snapshots.folder is None:
            return
        self.snapshots.flush()
        deadline = time.monotonic() + SNAPSHOT_WRITE_WAIT_S
        while self.last_snapshot_step is not None and time.monotonic() < deadline:
            if self.last_snapshot_step in self.snapshots.folder.steps():
                return
            time.sleep(0.02)

    def corrupt_snapshots(self) -> None:
        if self.snapshots is None or self.snapshots.folder is None:
            return
        for path in self.snapshots.folder.path.glob("step-*.pt"):
            try:  # the writer prunes the oldest as it finishes a write
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
            except FileNotFoundError:
                continue

    def _resume_state(self) -> dict[str, Any]:
        return {
            "global_step": self.step,
            "samples_consumed": self.sampler.consumed,
            "sampler": self.sampler.state_dict(),
            "lr_scheduler": self.scheduler.state_dict(),
            "lr_scheduler_step": self.scheduler.last_epoch,
            "lr": self.scheduler.get_last_lr()[0],
            "contract": self.contract.to_json(),
            "world_size": self.world,
            "plan": vars_of(self.plan),
        }

    def save(self, reason: str, heartbeat: Heartbeat) -> None:
        with heartbeat.phase(Phase.CHECKPOINT, self.step):
            time.sleep(self.args.slow_save_s)
            path = self.checkpoints.save(self.step, self._state(), self._resume_state())
        self.save_request.clear()
        self.journal.event("saved", step=self.step, reason=reason, path=str(path))

    def evaluate(self, heartbeat: Heartbeat) -> None:
        """Loss on a fixed slice of the data; eval mode draws no random numbers (exact resume)."""
        with heartbeat.phase(Phase.EVAL, self.step), torch.no_grad():
            self.model.eval()
            loss = ((self.model(self.x[:60]) - self.y[:60]) ** 2).mean().item()
            self.model.train()
        self.journal.event("eval", step=self.step, loss=loss)

    def _forward_backward(self) -> tuple[float, list[int], list[int]]:
        """This rank's share of the step: its loss sum, the samples it read, and those whose
        loss was not finite."""
        loss_sum, seen, bad = 0.0, [], []
        for indices in self.sampler.rank_micro_batches(self.plan, self.rank):
            out = self.model(self.x[indices])
            if self._inject_nan_once():
                out = out * float("nan")
            per_sample = ((out - self.y[indices]) ** 2).sum(dim=1)
            finite = torch.isfinite(per_sample).tolist()
            bad += [i for i, ok in zip(indices, finite, strict=True) if not ok]
            loss = per_sample.sum()
            (loss / self.plan.global_batch).backward()  # grads of the global-batch mean
            loss_sum += loss.item()
            seen.extend(indices)
        work_s = self.args.work_ms / 1000.0
        slow = self.rank == self.args.slow_rank or on_slow_node(self.args.slow_nodes_file)
        if slow and self.step >= self.args.slow_from_step:
            work_s *= 1.0 + self.args.slow_factor
        time.sleep(work_s)
        return loss_sum, seen, bad

    def _inject_nan_once(self) -> bool:
        """A fault of the node, not of the data: one NaN on the fault rank, not again."""
        due = fault_due(self.args.nan_once_at_step, self.step + 1, self.rank, self.args.fault_rank)
        if due and not self._nan_injected:
            self._nan_injected = True
            return True
        return False

    def _checked_step(
        self, params: Sequence[torch.Tensor]
    ) -> tuple[float, list[int], torch.Tensor, NumericalVerdict | None]:
        """Forward and backward, checked for non-finite values before the reduction (and re-run
        once in place when a rank found some: slurmft.train.numerical)."""
        self.guard.begin_step()
        result: dict[str, Any] = {}

        def attempt() -> list[int]:
            self.optimizer.zero_grad(set_to_none=False)
            loss_sum, seen, bad = self._forward_backward()
            flat = torch.cat([grad_of(p).reshape(-1) for p in params])
            if self.args.check_grads and not bool(torch.isfinite(flat).all()):
                bad = [*bad, -1]  # non-finite gradients, no sample to name
            result.update(loss_sum=loss_sum, seen=seen, flat=flat)
            return bad

        with self.timer.compute():
            bad = attempt()
        # Outside the compute section: the guard times its all-reduce as wait, its re-run as
        # compute.
        verdict = self.guard.check(self.step + 1, bad, attempt)
        return result["loss_sum"], result["seen"], result["flat"], verdict

    def _reduce(self, flat: torch.Tensor) -> tuple[torch.Tensor, list[float] | None, bool]:
        pending = self.save_request.pending()
        compute = self.timer.current_compute_s()
        if self.args.telemetry == "piggyback":
            flat, exchange = all_reduce_with_telemetry(flat, compute, pending)
            return flat, exchange.compute_s, exchange.save_requested
        dist.all_reduce(flat)
        if (self.step + 1) % self.args.telemetry_every:
            return flat, None, False
        exchange = exchange_telemetry(compute, pending, device=self.info.device)
        return flat, exchange.compute_s, exchange.save_requested

    def train_step(self) -> tuple[list[float] | None, bool]:
        self.timer.start_step(self.step + 1)
        params = list(self.model.parameters())
        loss_sum, seen, flat, verdict = self._checked_step(params)
        if verdict is not None and verdict.reproduced:
            found = {"action": verdict.action, "samples": list(verdict.samples)}
            self.journal.event("numerical_fault", step=self.step + 1, **found)
            if verdict.action == "stop":
                # As on a collective error: an interpreter exit with the process group alive
                # let gloo's threads abort the process (SIGABRT, "terminate called without an
                # active exception") before its exit code, in one run of many.
                exit_without_teardown(NUMERICAL_STOP_EXIT_CODE)
            if verdict.action == "skip":  # no update; the batch's samples are passed over
                self.sampler.advance(self.plan)
                self.step += 1
                self.timer.end_step()
                return None, False
        elif verdict is not None:
            self.journal.event(
                "numerical_retried", step=self.step + 1, ranks=list(verdict.first_ranks)
            )
        with self.timer.wait():
            flat, compute_times, save_requested = self._reduce(flat)
            stats = torch.tensor(
                [loss_sum, float(sum(seen)), float(sum(i * i for i in seen)), float(len(seen))],
                dtype=torch.float64,
                device=self.info.device,  # NCCL reduces device tensors only
            )
            dist.all_reduce(stats)  # the example's own check that no sample is replayed/skipped
        with self.timer.compute():
            offset = 0
            for p in params:
                grad_of(p).copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
        self.sampler.advance(self.plan)
        self.step += 1
        timing = self.timer.end_step()
        self.journal.step(
            {
                "step": self.step,
                "time": time.time(),  # when it ended: the truth goodput is measured against
                "loss": stats[0].item() / self.plan.global_batch,
                "lr": lr,
                "samples": [int(v) for v in stats[1:].tolist()],
                "world_size": self.world,
                "accumulation": self.plan.accumulation_steps,
                "micro_batch": self.plan.micro_batch,
            }
        )
        if timing is not None:
            self.channel.send(
                "step",
                step=self.step,
                compute_s=timing.compute_s,
                wait_s=timing.wait_s,
                total_s=timing.total_s,
            )
        return compute_times, save_requested

    def observe_stragglers(self, compute_times: list[float]) -> None:
        stragglers = self.stragglers.observe(self.step, compute_times)
        if stragglers is not None:
            self.journal.event(
                "stragglers",
                step=self.step,
                ranks=[{"rank": s.rank, "ratio": s.ratio} for s in stragglers],
                compute_s=compute_times,
            )

    def run(self, heartbeat: Heartbeat) -> None:
        with heartbeat.phase(Phase.INIT):
            self.resume()
        # One line per rank and start: torchrun labels it with the rank in the job's output.
        print(f"rank {self.rank} of {self.world} training from step {self.step}", flush=True)
        heartbeat.enter(Phase.STEP, self.step)
        while self.step < self.args.steps:
            compute_times, save_requested = self.train_step()
            heartbeat.progress(self.step)
            if compute_times is not None:
                self.observe_stragglers(compute_times)
            if self.args.eval_every and self.step % self.args.eval_every == 0:
                self.evaluate(heartbeat)
            if fault_due(self.args.crash_at_step, self.step, self.rank, self.args.fault_rank):
                self.wait_for_snapshot()
                if self.args.corrupt_snapshots_at_crash:
                    self.corrupt_snapshots()
                kill_self()
            if fault_due(self.args.hang_at_step, self.step, self.rank, self.args.fault_rank):
                hang_forever()
            if save_requested:
                self.save("requested", heartbeat)
            elif self.step % self.args.ckpt_every == 0 or self.step == self.args.steps:
                self.save("interval", heartbeat)
            if self.snapshots is not None and self.snapshots.after_step(
                self.step,
                self._state,
                self._resume_state,
                during=lambda: heartbeat.phase(Phase.CHECKPOINT, self.step),
            ):
                self.last_snapshot_step = self.step
        if self.rank == 0:
            weights = {name: t.cpu() for name, t in self.model.state_dict().items()}
            torch.save(weights, Path(self.args.out_dir) / "final_weights.pt")
        self.journal.event("done", step=self.step)


def vars_of(plan: BatchPlan) -> dict[str, int]:
    return {
        "global_batch": plan.global_batch,
        "world_size": plan.world_size,
        "micro_batch": plan.micro_batch,
        "accumulation_steps": plan.accumulation_steps,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = init_distributed(timeout_s=args.pg_timeout_s)
    install_stack_dump(info.rank)
    channel = ReportChannel()
    heartbeat = Heartbeat(
        channel, args.heartbeat_interval_s, {Phase.STEP: args.step_deadline_s}
    ).start()
    try:
        with exit_on_collective_error(channel):
            TinyRun(args, info, channel, heartbeat).run(heartbeat)
            dist.barrier()
    except SlurmftError as error:
        # Every rank reaches the same verdict (the checks are collective or deterministic).
        print(f"slurmft: rank {info.rank}: {error}", file=sys.stderr, flush=True)
        sys.exit(error.exit_code)
    finally:
        heartbeat.stop()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
