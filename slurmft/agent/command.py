"""The torchrun command line and environment an agent runs (pure; golden-tested).

Every value here is a measured choice (docs/measured/torchrun.md):
- c10d rendezvous on the batch step's standalone store (`is_host=false`): an agent-hosted store
  dies with its node and takes every agent with it.
- `--nnodes=N:N`: exactly N nodes train; agents beyond N wait in the rendezvous redundancy list
  as hot spares (no worker, no join timeout) and take a free rank when a node leaves.
- slurmft's dead-peer detector (peer_detector, peer_watch): each launcher writes a counter to
  the store every 0.1 s and watches two peers; one silent for 1.5 s (by the watcher's clock and
  polls) is evicted from the rendezvous, seconds before torch's keep-alive would expire it.
- keep-alive 1 s × 4 attempts: a dead node is noticed in about 4 s. Heartbeats land up to two
  intervals apart, so 1 × 2 and 1 × 1 remove live nodes; 1 × 3 was stable on loopback; expiry
  compares wall clocks across nodes, so a real cluster starts at 1 × 4.
- rendezvous state poll 0.1 s up to 32 nodes instead of torch's hard-coded 1 s (rdzv_fix,
  behind its version gate): a recovery waits for several polls in a row. Measured
  (scripts/bench/rendezvous_scale.py, docs/agent.md "The rendezvous at scale"): the store is
  not the limit (under 5 % of a core at 800 requests/s); every agent's own reads and writes of
  the one state are. At 31 nodes the 0.1 s poll completed the round after a loss 1.3 s sooner
  than torch's; at 63 nodes it gained nothing on 2 cores. So the poll lengthens linearly from
  32 nodes to torch's 1 s at 64 nodes and stays there.
- `--max-restarts` high: every peer-node loss costs each survivor one torchrun restart, so
  torchrun's counter must not be the cap (slurmft counts restarts without progress).
- workers started warm (`-m slurmft.agent.warm_start` before the script, `--warm-workers` for
  the launcher): a zygote started by the launcher imports torch and the script's imports once
  and forks each new worker, so a restart skips 2-3 s of imports (slurmft.agent.zygote).
- `--tee=3` into a node-local folder, with a line prefix naming the global rank: the job's
  output labels each worker line with its rank (slurmft.core.output), which `slurmft logs
  --rank` selects by. Untee'd, workers write to the job's output directly, unlabelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

from slurmft.agent.rdzv_fix import TORCH_POLL_S
from slurmft.config import AgentSection
from slurmft.core.output import RANK_LABEL_TEMPLATE
from slurmft.train.report import FENCE_FILE_ENV, SNAPSHOT_DIR_ENV

LAUNCHER_MODULE = "slurmft.agent.launcher"
# What torchrun runs in place of the script when workers start warm (slurmft.agent.zygote).
WARM_START_MODULE = "slurmft.agent.warm_start"

# torch 2.13 defect: with the agent's store shared with the workers, a joining spare never got
# the new MASTER_ADDR and survivors restarted in a loop on different MASTER_PORTs.
REQUIRED_ENV: dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

# NCCL error handling, timeouts and flight recorder; a user's own value wins. Untestable on
# the CPU build here (gloo): the values follow torch's documentation in ProcessGroupNCCL.hpp.
NCCL_ENV: dict[str, str] = {
    # 1 = on a collective error or timeout, abort the communicators and end the process, so
    # torchrun sees a dead worker and restarts (2 only cleans up, 3 skips the clean-up).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # A monitor thread aborts the process when the NCCL watchdog itself is stuck (a CUDA or
    # NCCL call that never returns) for TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC.
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    # 3 minutes instead of torch's 8: a stuck watchdog is a hung node; the step deadline of
    # slurmft.train is the finer detector.
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "180",
    # On a collective timeout, dump the flight recorder (needs monitoring and a buffer > 0).
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # Flight recorder: the last 2000 collectives per process group (torch's default size;
    # TORCH_FR_BUFFER_SIZE is 2.13's name for TORCH_NCCL_TRACE_BUFFER_SIZE).
    "TORCH_FR_BUFFER_SIZE": "2000",
    # Give the dump up to 15 s before the process exits on a timeout.
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000",
}
# Where the flight recorder writes (prefix + rank): the agent's evidence directory.
FLIGHT_RECORDER_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"
NCCL_DEBUG_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"

# The training library's node-local channel and stack-dump directory (slurmft.train).
AGENT_SOCKET_ENV = "SLURMFT_AGENT_SOCKET"
STACKS_DIR_ENV = "SLURMFT_STACKS_DIR"
# Touching this file asks every rank for a coordinated save at the next step boundary.
SAVE_REQUEST_FILE_ENV = "SLURMFT_SAVE_REQUEST_FILE"
# The run's checkpoint directory, for any script (the batch step exports it to the job's steps).
CKPT_DIR_ENV = "SLURMFT_CKPT_DIR"
# Written by the launcher when its node was declared dead by its peers (peer_detector).
FENCE_FILE_NAME = "fenced"
# torchrun's prefix of each tee'd worker line (read by torchrun itself, not a flag).
LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"

FASTEST_RDZV_POLL_S = 0.1
# Up to this many nodes the fastest poll was measured to pay (31 nodes: the round after a loss
# 1.3 s sooner); from RDZV_POLL_NODES_AT_TORCH_RATE on (63 nodes: no gain) torch's own 1 s.
RDZV_POLL_FASTEST_UP_TO_NODES = 32
RDZV_POLL_NODES_AT_TORCH_RATE = 64


def default_rdzv_poll_s(nodes: int) -> float:
    """The rendezvous state poll for a job of `nodes` nodes (see the module docstring)."""
    fast, slow = RDZV_POLL_FASTEST_UP_TO_NODES, RDZV_POLL_NODES_AT_TORCH_RATE
    fraction = min(1.0, max(0.0, (nodes - fast) / (slow - fast)))
    return round(FASTEST_RDZV_POLL_S + fraction * (TORCH_POLL_S - FASTEST_RDZV_POLL_S), 2)


@dataclass(frozen=True)
class TorchrunSpec:
    """What one agent's torchrun needs to know; `script` is the user's command after torchrun's
    own flags: `("train.py", "--lr", "0.1")` or `("-m", "pkg.train", ...)`."""

    nodes: int
    nproc_per_node: int
    rdzv_endpoint: str  # host:port of the standalone store
    rdzv_id: str
    script: tuple[str, ...]
    # The [agent] section's defaults (slurmft.config); `slurmft agent run` passes the effective
    # values.
    rdzv_timeout_s: int = AgentSection.rdzv_timeout_s
    keep_alive_interval_s: int = AgentSection.keep_alive_interval_s
    keep_alive_max_attempts: int = AgentSection.keep_alive_max_attempts
    max_restarts: int = AgentSection.max_restarts
    local_addr: str = ""
    wait_list_fix: bool = AgentSection.rdzv_wait_list_fix
    # An agent beyond the first N: without the wait-list fix it must not join at all.
    spare_candidate: bool = False
    rdzv_poll_s: float | None = None  # None: default_rdzv_poll_s(nodes)
    # Node-local folder torchrun tees worker output through (rank-labelled lines); "": none.
    worker_log_dir: str = ""
    # Workers forked from a zygote that imported torch and the script's imports once.
    warm_workers: bool = AgentSection.warm_workers
    # slurmft's dead-peer detector (peer_detector); 0: torch's keep-alive alone.
    peer_dead_after_s: float = AgentSection.peer_dead_after_s
    peer_heartbeat_s: float = AgentSection.peer_heartbeat_s

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc_per_node < 1:
            raise ValueError("nodes and nproc_per_node must be at least 1")
        if not self.script:
            raise ValueError("no training script given")
        if self.keep_alive_interval_s < 1 or self.keep_alive_max_attempts < 1:
            raise ValueError("keep-alive interval and attempts must be at least 1")
        if 0 < self.peer_dead_after_s <= self.peer_heartbeat_s:
            raise ValueError("agent.peer_heartbeat_s must be below agent.peer_dead_after_s")
        if self.rdzv_poll_s is not None and not 0 < self.rdzv_poll_s <= TORCH_POLL_S:
            raise ValueError(f"rendezvous poll must be in (0, {TORCH_POLL_S}] s")

    @property
    def poll_s(self) -> float:
        return default_rdzv_poll_s(self.nodes) if self.rdzv_poll_s is None else self.rdzv_poll_s


def rdzv_conf(spec: TorchrunSpec) -> str:
    return ",".join(
        [
            "is_host=false",
            f"join_timeout={spec.rdzv_timeout_s}",
            f"keep_alive_interval={spec.keep_alive_interval_s}",
            f"keep_alive_max_attempt={spec.keep_alive_max_attempts}",
        ]
    )


def torchrun_args(spec: TorchrunSpec) -> list[str]:
    """torchrun's own argv (what follows `torchrun`)."""
    args = [
        f"--nnodes={spec.nodes}:{spec.nodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={spec.rdzv_endpoint}",
        f"--rdzv-id={spec.rdzv_id}",
        f"--rdzv-conf={rdzv_conf(spec)}",
        f"--max-restarts={spec.max_restarts}",
    ]
    if spec.local_addr:
        args.append(f"--local-addr={spec.local_addr}")
    if spec.worker_log_dir:
        args += ["--tee=3", f"--log-dir={spec.worker_log_dir}"]
    if spec.warm_workers:
        args += ["-m", WARM_START_MODULE]
    return [*args, *spec.script]


def launcher_argv(spec: TorchrunSpec, python: str) -> list[str]:
    """`python -m slurmft.agent.launcher [flags] -- <torchrun args>`: torchrun's main, run after
    the launcher has applied (or refused) the wait-list fix and the shorter poll."""
    flags = ["--wait-list-fix" if spec.wait_list_fix else "--no-wait-list-fix"]
    if spec.spare_candidate:
        flags.append("--spare-candidate")
    flags.append(f"--rdzv-poll-s={spec.poll_s:g}")
    if spec.warm_workers:
        flags.append("--warm-workers")
    if spec.peer_dead_after_s > 0:
        flags += [
            f"--peer-dead-after-s={spec.peer_dead_after_s:g}",
            f"--peer-heartbeat-s={spec.peer_heartbeat_s:g}",
        ]
    return [python, "-m", LAUNCHER_MODULE, *flags, "--", *torchrun_args(spec)]


def torchrun_env(
    base: Mapping[str, str],
    *,
    agent_socket: str,
    stacks_dir: str,
    save_request_file: str,
    snapshot_dir: str = "",
) -> dict[str, str]:
    """torchrun's environment: the user's, NCCL defaults under it, slurmft's requirements over it.
    torchrun passes it on to the workers."""
    env = {**NCCL_ENV, FLIGHT_RECORDER_FILE_ENV: f"{stacks_dir}/nccl-trace-rank-"}
    env[NCCL_DEBUG_FILE_ENV] = env[FLIGHT_RECORDER_FILE_ENV]
    env.update(base)
    env.update(REQUIRED_ENV)
    env[LINE_PREFIX_ENV] = RANK_LABEL_TEMPLATE
    env[AGENT_SOCKET_ENV] = agent_socket
    env[STACKS_DIR_ENV] = stacks_dir
    env[SAVE_REQUEST_FILE_ENV] = save_request_file
    env[FENCE_FILE_ENV] = str(PurePath(agent_socket).with_name(FENCE_FILE_NAME))
    if snapshot_dir:
        env[SNAPSHOT_DIR_ENV] = snapshot_dir
    return env
