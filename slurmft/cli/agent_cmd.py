"""`slurmft agent`: the node agent (one per node) and the rendezvous store host (batch step)."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from slurmft.cli.context import state
from slurmft.config import ConfigError, PolicySection

if TYPE_CHECKING:
    from slurmft.agent.agent import NodeAgent
    from slurmft.agent.reporter import Reporter

# Each command imports the part of the node side it runs (and logging, socket and tempfile), so
# that `slurmft --version`, `--help` and the other command groups start without loading them.

app = typer.Typer(
    help="Run on compute nodes: the node agent and the rendezvous store.", no_args_is_help=True
)


def _default_node_index() -> int:
    return int(os.environ.get("SLURM_NODEID", "0"))


def _default_node_name() -> str:
    import socket

    # Under Slurm every node of the local test cluster has the same host name.
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


# `--nproc-per-node gpu`: as many workers as GPUs Slurm gave this node's step.
NPROC_HELP = "Worker processes per node: a number, or gpu (the GPUs Slurm gave this node's step)."


def resolve_nproc_per_node(value: str, environ: Mapping[str, str]) -> int:
    """A number, or `gpu`: SLURM_GPUS_ON_NODE, which Slurm sets for a step given GPUs."""
    if value == "gpu":
        gpus = environ.get("SLURM_GPUS_ON_NODE", "")
        if not gpus.isdigit() or int(gpus) < 1:
            raise ConfigError(
                "--nproc-per-node gpu: Slurm gave this step no GPUs (SLURM_GPUS_ON_NODE is "
                f"{gpus or 'unset'}); submit with --gpus-per-node N, or give a number"
            )
        return int(gpus)
    if not value.isascii() or not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--nproc-per-node {value!r}: a number of at least 1, or gpu")
    return int(value)


def _step_agents(nodes: int) -> int:
    """The agents of this step (one a node, spares included): Slurm's node count of the step,
    else the training nodes."""
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        value = os.environ.get(name, "")
        if value.isascii() and value.isdigit() and int(value) > 0:
            return int(value)
    return nodes


def _setup_logging(node: str, level: str) -> None:
    import logging

    logging.basicConfig(
        level=level,
        format=f"%(asctime)s slurmft agent[{node}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )


@app.command(
    "run",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def run(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    nodes: Annotated[int, typer.Option(help="Training nodes N (agents beyond N are spares).")],
    rdzv_endpoint: Annotated[str, typer.Option(help="host:port of the standalone store.")],
    run_id: Annotated[str, typer.Option(help="The run's id (also the rendezvous id).")],
    nproc_per_node: Annotated[str, typer.Option(help=NPROC_HELP)] = "1",
    node_index: Annotated[
        int | None, typer.Option(help="This node's index in the step; default $SLURM_NODEID.")
    ] = None,
    node_name: Annotated[
        str | None, typer.Option(help="Default $SLURMD_NODENAME, else the host name.")
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option(help="File holding the run's token for the controller.")
    ] = None,
    work_dir: Annotated[
        Path | None, typer.Option(help="Node-local directory for the socket and stack dumps.")
    ] = None,
    local_addr: Annotated[str, typer.Option(help="This node's address on the job network.")] = "",
    outcome_dir: Annotated[
        str,
        typer.Option(help="Shared directory where this agent writes how it ended (batch step)."),
    ] = "",
) -> None:
    """Run torchrun for this node: `slurmft agent run --nodes 3 ... -- train.py --lr 0.1`."""
    config = state(ctx).config
    script = tuple(ctx.args)
    if not script:
        raise ConfigError("no training script: add `-- train.py [args]` or `-- -m pkg.train`")
    index = _default_node_index() if node_index is None else node_index
    node = node_name or _default_node_name()
    _setup_logging(node, config.settings.log.level)
    import tempfile

    from slurmft.agent.agent import AgentSettings, NodeAgent
    from slurmft.agent.batch import write_step_outcome
    from slurmft.agent.command import TorchrunSpec
    from slurmft.agent.probe import NodeGpuProbe
    from slurmft.agent.reporter import report_interval_s
    from slurmft.gpu.probe import GpuProbe

    agent_section = config.settings.agent
    spec = TorchrunSpec(
        nodes=nodes,
        nproc_per_node=resolve_nproc_per_node(nproc_per_node, os.environ),
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=run_id,
        script=script,
        rdzv_timeout_s=agent_section.rdzv_timeout_s,
        keep_alive_interval_s=agent_section.keep_alive_interval_s,
        keep_alive_max_attempts=agent_section.keep_alive_max_attempts,
        max_restarts=agent_section.max_restarts,
        local_addr=local_addr,
        wait_list_fix=agent_section.rdzv_wait_list_fix,
        spare_candidate=index >= nodes,
        warm_workers=agent_section.warm_workers,
        peer_dead_after_s=agent_section.peer_dead_after_s,
        peer_heartbeat_s=agent_section.peer_heartbeat_s,
    )
    token = token_file.read_text().strip() if token_file else ""
    settings = AgentSettings(
        spec=spec,
        node=node,
        run_id=run_id,
        work_dir=work_dir or Path(tempfile.mkdtemp(prefix="slurmft-agent-")),
        controller_url=agent_section.controller_url,
        ca_file=agent_section.ca_file,
        token=token,
        report_interval_s=report_interval_s(agent_section.report_interval_s, _step_agents(nodes)),
        max_buffered=agent_section.report_buffer_max,
        max_clock_skew_s=agent_section.max_clock_skew_s,
        stop_grace_s=agent_section.stop_grace_s,
        stack_wait_s=agent_section.stack_dump_wait_s,
        gpu_poll_s=config.settings.gpu.poll_interval_s,
        step_dir=outcome_dir,
    )
    gpu = GpuProbe.from_config(config, since_monotonic_s=time.monotonic())
    agent = NodeAgent(settings, probe=NodeGpuProbe(gpu))
    _install_stop_signals(agent)
    code = agent.run()
    if outcome_dir:
        try:
            write_step_outcome(outcome_dir, node, agent.outcome(code), agent.state.stop_reason)
        except OSError as error:  # a full or read-only checkpoint filesystem: exit as decided
            logging.getLogger("slurmft.agent").error(
                "could not write this agent's outcome in %s: %s", outcome_dir, error
            )
    raise typer.Exit(int(code))


def _install_stop_signals(agent: NodeAgent) -> None:
    def stop(signum: int, _frame: object) -> None:
        agent.request_stop(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    # `scancel --signal=USR1` on the agent step (the batch step's answer to its own USR1).
    signal.signal(signal.SIGUSR1, lambda *_: agent.request_save())
    # USR2 asks ranks for stacks; a Slurm-delivered one must not end the agent.
    signal.signal(signal.SIGUSR2, lambda *_: None)


@app.command("store")
def store(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="The job network's address (never 0.0.0.0).")],
    port: Annotated[int, typer.Option(help="TCP port of the rendezvous store.")],
) -> None:
    """Host the standalone rendezvous store and restart it when it dies or stops answering."""
    _setup_logging(host, state(ctx).config.settings.log.level)
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    from slurmft.agent.store import StoreSupervisor

    supervisor = StoreSupervisor(host, port).start()
    typer.echo(f"rendezvous store on {supervisor.endpoint}", err=True)
    try:
        stopped.wait()
    finally:
        supervisor.stop()


@app.command(
    "batch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def batch(  # noqa: PLR0917 (typer: one parameter per option)
    ctx: typer.Context,
    run_id: Annotated[str, typer.Option(help="The run's id (also the rendezvous id).")],
    nodes: Annotated[int, typer.Option(help="Training nodes N.")],
    ckpt_dir: Annotated[str, typer.Option(help="Shared checkpoint directory (progress, budget).")],
    spares: Annotated[int, typer.Option(help="Hot spare nodes S.")] = 0,
    store_port: Annotated[int, typer.Option(help="Port of the rendezvous store.")] = 29400,
    store_host: Annotated[
        str, typer.Option(help="This node's address on the job network; default: its host name's.")
    ] = "",
    nproc_per_node: Annotated[str, typer.Option(help=NPROC_HELP)] = "1",
    step_gres: Annotated[
        str, typer.Option(help="GRES every agent step asks for on each node, e.g. gpu:8.")
    ] = "",
    cpus_per_task: Annotated[
        int | None, typer.Option(help="CPUs each agent (one per node) gets.")
    ] = None,
    max_restarts_without_progress: Annotated[
        int, typer.Option(help="The restart budget.")
    ] = PolicySection.max_restarts_without_progress,
    save_timeout_s: Annotated[float, typer.Option(help="Time limit: time to save.")] = 120.0,
    token_file: Annotated[str, typer.Option(help="The run's token for the agents.")] = "",
    agent_python: Annotated[
        str, typer.Option(help="The agents' interpreter (inside their container); default: this.")
    ] = "",
    agent_wrapper: Annotated[
        str, typer.Option(help="The command every agent runs under, as shell words.")
    ] = "",
    setup: Annotated[
        list[str] | None, typer.Option(help="A shell line run before every agent (repeatable).")
    ] = None,
    srun_arg: Annotated[
        list[str] | None, typer.Option(help="An option for every agent step's srun (repeatable).")
    ] = None,
) -> None:
    """The batch step: host the store, run and relaunch the agent step, requeue, keep the budget."""
    from slurmft.agent.batch import BatchSpec
    from slurmft.agent.batch_step import BatchStep, store_address
    from slurmft.agent.command import CKPT_DIR_ENV
    from slurmft.slurm.cli_backend import CliSlurmClient

    config = state(ctx).config
    _setup_logging("batch", config.settings.log.level)
    spec = BatchSpec(
        run_id=run_id,
        nodes=nodes,
        spares=spares,
        script=tuple(ctx.args),
        ckpt_dir=ckpt_dir,
        store_port=store_port,
        nproc_per_node=nproc_per_node,
        step_gres=step_gres,
        cpus_per_task=cpus_per_task,
        max_restarts_without_progress=max_restarts_without_progress,
        save_timeout_s=save_timeout_s,
        slurmft=sys.argv[0],
        token_file=token_file,
        # Started as `python -m slurmft` (submit --python): the agents are started so too.
        python=sys.executable if Path(sys.argv[0]).name == "__main__.py" else "",
        agent_python=agent_python,
        agent_wrapper=tuple(shlex.split(agent_wrapper)),
        setup=tuple(setup or ()),
        srun_args=_checked_srun_args(srun_arg or ()),
    )
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id:
        raise ConfigError("`slurmft agent batch` runs inside a Slurm batch job (no SLURM_JOB_ID)")
    # srun passes the batch step's environment on: every agent, torchrun and rank gets it.
    os.environ[CKPT_DIR_ENV] = ckpt_dir
    slurm = config.settings.slurm
    client = CliSlurmClient(slurm_conf=slurm.conf or None, timeout_s=slurm.command_timeout_s)
    try:
        host = store_address(store_host)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    url = config.settings.agent.controller_url
    reporter = _allocation_reporter(url, token_file, run_id, job_id)
    step = BatchStep(
        spec,
        client,
        job_id,
        host,
        confirm_s=config.settings.policy.confirm_s,
        report_allocation=reporter.report_allocation if reporter else None,
        report_event=reporter.add_event if reporter else None,
    )
    signal.signal(signal.SIGUSR1, lambda *_: step.request_save_and_requeue())
    if reporter is not None:
        reporter.start()
    try:
        code = step.run()
    finally:
        if reporter is not None:
            reporter.stop(flush_timeout_s=5.0)
    raise typer.Exit(int(code))


def _checked_srun_args(words: Sequence[str]) -> tuple[str, ...]:
    """The batch script's srun options held to the submit-time table again (it is the user's
    file: a hand-edited one gets the same refusals)."""
    from slurmft.slurm import passthrough
    from slurmft.slurm.api import SlurmBadRequest

    try:
        return passthrough.check("srun", words)
    except SlurmBadRequest as error:
        raise ConfigError(f"--srun-arg: {error}") from None


def _allocation_reporter(
    controller_url: str, token_file: str, run_id: str, job_id: str
) -> Reporter | None:
    """The batch step's own reporter to the daemon (its allocation only: no keep-alives, and
    the commands in its replies are the agents', not its own); None without a daemon."""
    if not controller_url or not token_file:
        return None
    import logging
    import uuid

    from slurmft.agent.reporter import HttpTransport, Reporter
    from slurmft.protocol import BATCH_STEP_AGENT

    token = Path(token_file).read_text().strip()
    return Reporter(
        HttpTransport(controller_url, token),
        run_id=run_id,
        node=_default_node_name(),
        on_command=lambda command: logging.getLogger("slurmft.batch").debug(
            "command %s for the agents, not the batch step", command.kind
        ),
        keepalive_s=float("inf"),
        agent_id=f"{BATCH_STEP_AGENT}{job_id}-{uuid.uuid4().hex[:8]}",
    )
