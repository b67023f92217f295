"""What a training script imports: heartbeats, step timing, verified checkpoints, exact resume.

A torchrun script works without this package; with it, its ranks report to the node agent and
restarts lose at most one checkpoint interval and change nothing about the training. Full guide
and message schema: docs/train.md. Example: `slurmft/train/examples/tiny.py`.

Process and reports
    init_distributed(timeout_s) -> DistInfo     process group with a collective timeout
    exit_on_collective_error(channel)           context: collective error -> os._exit(75)
    exit_without_teardown(code)                 flush and os._exit: no destructor, no atexit
    ReportChannel()                             non-blocking datagrams to $SLURMFT_AGENT_SOCKET
    Heartbeat(channel, interval_s, deadlines_s) phase heartbeats (Phase.INIT/STEP/CHECKPOINT/EVAL)
    install_stack_dump(rank)                    SIGUSR2 -> stacks in $SLURMFT_STACKS_DIR
Step timing and stragglers
    StepTimer(device)                           own compute apart from collective wait
    all_reduce_with_telemetry(flat, compute_s, save_requested)   piggy-back on the grad reduce
    exchange_telemetry(compute_s, save_requested)                 or a 2-float all_gather
    PeerGroups, StragglerDetector               name ranks > 20 % over their peers' median
    StragglerNotices(channel, detector, speaks) tell the agent when the named set changes
Checkpoints and exact resume
    CheckpointManager(root, keep_last)          check_shared_directory, save, latest_verified, load
    SaveRequest()                               SIGUSR1 / request file -> coordinated save
    GlobalOrderSampler(dataset_size, seed)      one global sample order; state = samples consumed
    ResumableSampler(dataset_size, batch, seed) one rank's share of it, for a DataLoader
    plan_batches(global_batch, world, max_micro) -> BatchPlan   constant global batch
    TrainingContract, check_resume              refuse a changed global batch or LR schedule
    capture_rng_state, restore_rng_state        python/numpy/torch CPU+CUDA RNG as JSON
PyTorch Lightning (slurmft.train.lightning, the `lightning` extra; not loaded from here)
    SlurmftCallback(), ResumableLoader(dataset, batch_size, seed)

The torch-free parts (report, heartbeat, stacks, manifest, sampler, batching, resume, straggler,
save_request) can be imported by the node agent without torch: names from the torch modules are
loaded on first use.
"""

from __future__ import annotations

from slurmft._lazy import lazy_exports

_EXPORTS = {
    "BatchPlan": "batching",
    "BatchPlanError": "batching",
    "plan_batches": "batching",
    "CheckpointDirNotShared": "checkpoint",
    "CheckpointManager": "checkpoint",
    "CheckpointSaveFailed": "checkpoint",
    "VerifiedCheckpoint": "checkpoint",
    "COLLECTIVE_ERROR_EXIT_CODE": "distributed",
    "DistInfo": "distributed",
    "exit_on_collective_error": "distributed",
    "exit_without_teardown": "distributed",
    "init_distributed": "distributed",
    "Heartbeat": "heartbeat",
    "Phase": "heartbeat",
    "is_overdue": "heartbeat",
    "CheckpointInvalid": "manifest",
    "ReportChannel": "report",
    "ResumeRefused": "resume",
    "TrainingContract": "resume",
    "check_resume": "resume",
    "capture_rng_state": "rng",
    "restore_rng_state": "rng",
    "GlobalOrderSampler": "sampler",
    "ResumableSampler": "sampler",
    "SaveRequest": "save_request",
    "install_stack_dump": "stacks",
    "PeerGroups": "straggler",
    "Straggler": "straggler",
    "StragglerDetector": "straggler",
    "StragglerNotices": "straggler",
    "StepExchange": "timing",
    "StepTimer": "timing",
    "StepTiming": "timing",
    "all_reduce_with_telemetry": "timing",
    "exchange_telemetry": "timing",
}

__all__ = [
    "COLLECTIVE_ERROR_EXIT_CODE",
    "BatchPlan",
    "BatchPlanError",
    "CheckpointDirNotShared",
    "CheckpointInvalid",
    "CheckpointManager",
    "CheckpointSaveFailed",
    "DistInfo",
    "GlobalOrderSampler",
    "Heartbeat",
    "PeerGroups",
    "Phase",
    "ReportChannel",
    "ResumableSampler",
    "ResumeRefused",
    "SaveRequest",
    "StepExchange",
    "StepTimer",
    "StepTiming",
    "Straggler",
    "StragglerDetector",
    "StragglerNotices",
    "TrainingContract",
    "VerifiedCheckpoint",
    "all_reduce_with_telemetry",
    "capture_rng_state",
    "check_resume",
    "exchange_telemetry",
    "exit_on_collective_error",
    "init_distributed",
    "install_stack_dump",
    "is_overdue",
    "plan_batches",
    "restore_rng_state",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
