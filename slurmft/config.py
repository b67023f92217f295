"""One typed configuration for every slurmft process.

Precedence, lowest to highest: built-in defaults < ``/etc/slurmft/slurmft.toml`` < the file named
by ``SLURMFT_CONFIG`` (or ``--config``) < ``SLURMFT_<SECTION>_<KEY>`` environment variables <
command-line ``--set section.key=value``. Every effective value remembers where it came from so
``slurmft config show`` can say why a value is what it is.

The schema is one frozen, dataclass-like class per ``[section]`` below (``PolicySection``, ...),
gathered in ``Settings``: adding a setting is one field there, its default written nowhere else.
The ``SETTINGS`` table (environment variable names, validation, ``slurmft config show``) and the
docs' config reference are derived from those fields; code reads the values typed, as
``config.settings.policy.max_restarts_without_progress``, and code that needs a setting's
default names the field (``PolicySection.max_restarts_without_progress``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar, cast, dataclass_transform

from slurmft.core.defaults import MAX_RESTARTS_WITHOUT_PROGRESS
from slurmft.errors import SlurmftError

SYSTEM_CONFIG = Path("/etc/slurmft/slurmft.toml")
ENV_CONFIG = "SLURMFT_CONFIG"
ENV_PREFIX = "SLURMFT_"
# Variables slurmft sets for its own processes; they share a prefix with settings but are none.
PROCESS_VARIABLES = frozenset({ENV_CONFIG, "SLURMFT_AGENT_SOCKET"})

# Filesystems on which SQLite's locking is unreliable: a database there corrupts silently.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.sshfs",
        "fuse.ceph",
        "9p",
        "afs",
        "panfs",
        "wekafs",
        "fuse.beegfs",
        "fuse.juicefs",
        "fuse.s3fs",
        "davfs",
    }
)


class ConfigError(SlurmftError, ValueError):
    """A configuration value is missing or wrong; the message names the key and the fix."""

    exit_code = 2


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected true or false")


class Setting(NamedTuple):
    """One configuration key: its type, default and meaning."""

    key: str  # "section.name"
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None

    @property
    def name(self) -> str:
        """The key within its section: the section's field."""
        return self.key.split(".", 1)[1]

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.key.replace(".", "_").upper()

    def coerce(self, value: Any) -> Any:
        """Turn a TOML value or an environment string into this setting's type, or raise."""
        try:
            converted = self._convert(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{exc}; expected {self.describe_type()}") from None
        if self.choices and converted not in self.choices:
            raise ValueError(f"expected one of {', '.join(self.choices)}")
        if self.minimum is not None and converted < self.minimum:
            raise ValueError(f"must be at least {self.minimum}")
        if self.maximum is not None and converted > self.maximum:
            raise ValueError(f"must be at most {self.maximum}")
        return converted

    def _convert(self, value: Any) -> Any:
        if self.kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str):
                return _parse_bool(value)
            raise ValueError(f"{value!r} is not a boolean")
        if self.kind is int:
            if isinstance(value, bool | float):
                raise ValueError(f"{value!r} is not a whole number")
            return int(value)
        if self.kind is float:
            if isinstance(value, bool):
                raise ValueError(f"{value!r} is not a number")
            return float(value)
        if not isinstance(value, str):
            raise ValueError(f"{value!r} is not a string")
        return value

    def describe_type(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return {bool: "true or false", int: "a whole number", float: "a number"}.get(
            self.kind, "a string"
        )


# --- the schema: one frozen dataclass-like class per [section] ----------------------------------

T = TypeVar("T")


class _FieldSpec:
    """What ``setting_field`` leaves in a section's body; the section keeps it and puts the
    default in its place."""

    __slots__ = ("choices", "default", "help", "maximum", "minimum")

    def __init__(
        self,
        default: Any,
        help: str,
        choices: tuple[str, ...],
        minimum: float | None,
        maximum: float | None,
    ) -> None:
        self.default, self.help, self.choices = default, help, choices
        self.minimum, self.maximum = minimum, maximum


def setting_field(
    default: T,
    help: str,
    *,
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
    maximum: float | None = None,
) -> T:
    """A section's field: the setting's one default, and what its checks and docs say."""
    return cast(T, _FieldSpec(default, help, choices, minimum, maximum))


# The annotations a setting may have (strings: this module postpones annotations).
_KINDS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


class _Frozen:
    """Read-only attributes, and equality, hash and repr by the attributes ``_names`` lists:
    what a frozen dataclass generates, shared by ``Section`` and ``Settings``."""

    def _names(self) -> Iterable[str]:
        raise NotImplementedError

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._names())

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Frozen) or type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names())
        return f"{type(self).__name__}({values})"


@dataclass_transform(kw_only_default=True, frozen_default=True)
class Section(_Frozen):
    """A ``[section]`` of the configuration: one field per key, declared as in a frozen
    dataclass (``name: int = setting_field(5, "What it does.", minimum=1)``); the class
    attribute is the default, an instance holds effective values, read-only.

    Not ``@dataclass``: generating a dataclass's methods compiles code at import, about 1 ms a
    class, and every slurmft process (each CLI start, each node agent) imports the sections;
    these share one set of methods. ``dataclass_transform`` has type checkers treat a section as
    the frozen, keyword-only dataclass it behaves as. Built in code (a test, a bench), a section
    holds to the same types and bounds as one read from a file: each value is checked."""

    __section_fields__: ClassVar[dict[str, tuple[type, _FieldSpec]]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        declared: dict[str, tuple[type, _FieldSpec]] = {}
        for name, annotation in vars(cls).get("__annotations__", {}).items():
            spec = vars(cls).get(name)
            kind = _KINDS.get(annotation)
            if not isinstance(spec, _FieldSpec) or kind is None or type(spec.default) is not kind:
                raise TypeError(
                    f"{cls.__name__}.{name}: declare a setting as `{name}: <str, int, float or "
                    f"bool> = setting_field(<a default of that type>, <help>)`"
                )
            declared[name] = (kind, spec)
            setattr(cls, name, spec.default)
        cls.__section_fields__ = declared

    def __init__(self, **values: Any) -> None:
        unknown = sorted(values.keys() - self.__section_fields__.keys())
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r}"
            )
        for name, (_, spec) in self.__section_fields__.items():
            object.__setattr__(self, name, values.get(name, spec.default))
        self._check()

    def _check(self) -> None:
        for setting in SECTION_SETTINGS[type(self)]:
            value = getattr(self, setting.name)
            try:
                setting.coerce(value)
            except ValueError as exc:
                raise _bad_value_error(setting, value, type(self).__name__, str(exc)) from None

    def _names(self) -> Iterable[str]:
        return self.__section_fields__


class PathsSection(Section):
    """[paths]: where slurmft keeps its state and its socket."""

    state_dir: str = setting_field(
        "",
        "Directory for the SQLite store and daemon state. Empty: /var/lib/slurmft for root, "
        "$XDG_STATE_HOME/slurmft (~/.local/state/slurmft) otherwise. Must be on local disk.",
    )
    runtime_dir: str = setting_field(
        "",
        "Directory for the CLI's unix socket. Empty: /run/slurmft for root, "
        "$XDG_RUNTIME_DIR/slurmft (or the state directory) otherwise.",
    )


class DatabaseSection(Section):
    """[database]: the store."""

    url: str = setting_field(
        "",
        "SQLAlchemy URL of the store. Empty: a SQLite file slurmft.db in the state directory. "
        "PostgreSQL: postgresql://user@host/db (driven by psycopg 3).",
    )
    busy_timeout_ms: int = setting_field(
        5000, "SQLite: how long a writer waits for a lock before failing.", minimum=0
    )
    pool_size: int = setting_field(5, "PostgreSQL connection pool size.", minimum=1)


class LogSection(Section):
    """[log]: the log lines of every slurmft process."""

    level: str = setting_field("INFO", "Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    format: str = setting_field(
        "text", "Log line format: text (journald-friendly) or json.", choices=("text", "json")
    )


class SlurmSection(Section):
    """[slurm]: how slurmft runs the Slurm commands."""

    conf: str = setting_field(
        "",
        "Path to slurm.conf for the Slurm commands. Empty: Slurm's own default (SLURM_CONF or "
        "/etc/slurm/slurm.conf).",
    )
    command_timeout_s: float = setting_field(
        30.0,
        "Timeout of one Slurm command; past it the call fails as 'Slurm unreachable'.",
        minimum=1.0,
    )


class DaemonSection(Section):
    """[daemon]: the daemon's endpoints and main loop."""

    agents_url: str = setting_field(
        "",
        "The URL agents on compute nodes report to, e.g. http://login1:8787. Empty: "
        "agent.controller_url, else the ingest endpoint as bound (daemon.ingest_listen; a "
        "wildcard bind is named by this host's fully qualified name). The daemon refuses to start "
        "with a URL that names no host, or a loopback one while a node's NodeAddr is another host.",
    )
    ingest_listen: str = setting_field(
        "127.0.0.1:8787", "host:port where the daemon receives agent reports over HTTP."
    )
    metrics_listen: str = setting_field(
        "127.0.0.1:9787", "host:port of the Prometheus /metrics and /healthz endpoint."
    )
    poll_interval_s: float = setting_field(
        5.0,
        "How often the daemon queries Slurm for all tracked jobs (one batched call).",
        minimum=0.5,
    )
    ingest_tls_cert: str = setting_field(
        "",
        "PEM certificate (chain) the ingest endpoint serves over TLS; with ingest_tls_key, agents "
        "report over https. Empty: plain HTTP (a trusted network only; see docs/install.md).",
    )
    ingest_tls_key: str = setting_field(
        "", "PEM private key of ingest_tls_cert (readable by the daemon only)."
    )
    agents_ca_file: str = setting_field(
        "",
        "CA certificate file, as a path on the compute nodes, that agents verify the ingest "
        "certificate against; given to each run's agents as agent.ca_file. Empty: the nodes' "
        "system CAs.",
    )
    ingest_max_connections: int = setting_field(
        4096,
        "Connections the ingest endpoint holds at once (arriving, queued, answered, or kept "
        "between an agent's posts); past it the kept connection idle longest is closed to make "
        "room, and with none to close a new one is answered 503 with Retry-After. Each agent "
        "keeps one. Keep LimitNOFILE in the unit above it.",
        minimum=1,
    )
    ingest_workers: int = setting_field(
        256,
        "Threads answering complete ingest requests (each waits for its batch's commit); idle "
        "and slow connections hold none. Keep TasksMax in the unit above it.",
        minimum=1,
    )
    socket_max_connections: int = setting_field(
        2048,
        "Connections the CLI's unix socket holds at once; past it the CLI is told to retry. "
        "Keep LimitNOFILE in the unit above it.",
        minimum=1,
    )
    socket_max_per_user: int = setting_field(
        128,
        "Connections one user (root exempt) may hold to the CLI's socket, so that no user can "
        "keep the others out. 0: no such cap.",
        minimum=0,
    )
    socket_workers: int = setting_field(16, "Threads answering complete CLI requests.", minimum=1)
    header_timeout_s: float = setting_field(
        10.0,
        "The whole request head (HTTP headers, the CLI's request line) must arrive within this "
        "long of the connection, on every endpoint, or the connection is closed.",
        minimum=0.05,
    )
    body_timeout_s: float = setting_field(
        30.0,
        "A request body must arrive, and the answer be taken, within this long once its head "
        "is read.",
        minimum=0.05,
    )
    idle_timeout_s: float = setting_field(
        5.0,
        "A connection that sends nothing for this long before its request is complete is closed.",
        minimum=0.05,
    )
    observe_only: bool = setting_field(False, "Decide and record actions but execute none of them.")
    admin_group: str = setting_field(
        "",
        "A Unix group whose members are the daemon's admins, as root is: they see every run and "
        "may cancel any (docs/install.md, 'Security model'). Empty: root only.",
    )
    stuck_after_passes: int = setting_field(
        24,
        "The main loop counts as stuck when no control pass has ended for this many poll "
        "intervals: /healthz fails and the systemd watchdog pings stop (systemd then restarts "
        "the daemon). Keep it above the Slurm calls of one slow pass (slurm.command_timeout_s).",
        minimum=2,
    )
    max_active_runs_per_user: int = setting_field(
        50,
        "Runs one user may have pending or running at once; `slurmft submit` past it is "
        "refused, naming this setting. Root and the users in daemon.quota_exempt_users are "
        "exempt. 0: no quota.",
        minimum=0,
    )
    quota_exempt_users: str = setting_field(
        "",
        "Comma-separated user names exempt from daemon.max_active_runs_per_user (a site's test "
        "or CI accounts, whose test runs come in numbers).",
    )
    ingest_batches_per_run_s: float = setting_field(
        4096.0,
        "Agent batches one run may post per second (a token bucket per run; past it the agent "
        "is answered 429 and retries later, losing nothing). The default is twice what a run "
        "of 2,048 agents posting once a second sends. 0: no limit.",
        minimum=0.0,
    )
    ingest_events_per_run_s: float = setting_field(
        1000.0,
        "Agent events (failures, hangs, checkpoints: what actions are decided on) one run may "
        "post per second, beyond the burst. 0: no limit.",
        minimum=0.0,
    )
    ingest_burst_s: float = setting_field(
        10.0,
        "How many seconds' worth of the two ingest rates a run may post at once (a whole run "
        "reporting a failure together).",
        minimum=1.0,
    )


class NotifySection(Section):
    """[notify]: telling a person when one is needed."""

    webhook_url: str = setting_field(
        "",
        "When a person is needed (a run stopped at the crash cap, spares exhausted, a drain "
        "refused, a resubmission waiting for its owner), POST a JSON message here; its `text` "
        "field suits Slack/Mattermost-style incoming webhooks. Empty: only `slurmft status` "
        "shows it. Undelivered messages wait in the store and are retried in order.",
    )
    webhook_timeout_s: float = setting_field(
        5.0, "How long one webhook POST may take before it is retried later.", minimum=0.1
    )
    webhook_interval_s: float = setting_field(
        10.0, "How often waiting webhook messages are sent.", minimum=0.5
    )


class RetentionSection(Section):
    """[retention]: how long the store keeps fine-grained history."""

    step_times_raw_hours: float = setting_field(
        6.0,
        "Raw per-step times are kept this long, then folded into per-rank per-minute "
        "aggregates (kept for good).",
        minimum=0.0,
    )
    heartbeat_history_hours: float = setting_field(
        24.0,
        "Sampled heartbeat history is kept this long; the latest heartbeat per rank is "
        "always kept.",
        minimum=0.0,
    )
    heartbeat_sample_s: float = setting_field(
        60.0,
        "At most one heartbeat per rank per this many seconds goes into the history.",
        minimum=0.0,
    )


class PolicySection(Section):
    """[policy]: when the controller restarts, flags or stops a run."""

    max_restarts_without_progress: int = setting_field(
        MAX_RESTARTS_WITHOUT_PROGRESS,  # the budget's own (slurmft.core.defaults)
        "Stop a run after this many restarts in a row without a newer verified checkpoint.",
        minimum=1,
    )
    straggler_threshold: float = setting_field(
        0.20,
        "A rank whose own compute time exceeds the median of its peers by more than this "
        "fraction, sustained over the window, is a straggler.",
        minimum=0.01,
        maximum=10.0,
    )
    straggler_window_s: float = setting_field(
        300.0, "How long a straggler margin must be sustained before it is flagged.", minimum=1.0
    )
    silent_after_s: float = setting_field(
        30.0,
        "A rank whose heartbeats stop this long while its peers' still arrive is frozen (a "
        "hang); all ranks silent together is a report-channel problem, never a hang.",
        minimum=1.0,
    )
    unresponsive_after_s: float = setting_field(
        60.0,
        "A node whose agent stops reporting this long while the run's other agents report is "
        "unresponsive: out of the run, drained (within the drain limits) and set DOWN, which "
        "evicts it from a --no-kill job. Agents report at least every 2 s (a keep-alive).",
        minimum=5.0,
    )
    confirm_s: float = setting_field(
        10.0,
        "A Slurm fact that changes a job's fate (a node or the batch host lost) is acted on once "
        "it has held this long (two polls at the default poll interval), or at once when the "
        "node's agent has been silent this long too (the second source): a node that reads "
        "not-responding for a moment costs no requeue, exclusion or DOWN.",
        minimum=0.0,
    )
    restart_command_ttl_s: float = setting_field(
        120.0,
        "A worker restart decided for a node (a hang, a restart-class GPU fault) waits for the "
        "node's agent to fetch it with its next report; not fetched within this many seconds, "
        "it expires (recorded as skipped, 'expired') and is never delivered late.",
        minimum=5.0,
    )


class TrustSection(Section):
    """[trust]: when evidence from one run drains a node in Slurm for everyone."""

    drain_gpu_faults: bool = setting_field(
        True,
        "Drain a node in Slurm (for everyone) on a drain-class GPU fault. Off: the node only "
        "leaves the run that saw the fault.",
    )
    straggler_drain_after_windows: int = setting_field(
        3,
        "Drain a straggler node only after it was flagged in this many windows; before that it "
        "only leaves the run.",
        minimum=1,
    )
    lemon_min_runs: int = setting_field(
        2,
        "Restart-class Xids (13, 31, 43) make a node a lemon only when they repeat on it in this "
        "many different runs.",
        minimum=2,
    )
    drains_per_hour: int = setting_field(
        4,
        "At most this many drains per hour; past it a drain becomes a notice to a human.",
        minimum=0,
    )
    max_drained_fraction: float = setting_field(
        0.1,
        "Never drain past this fraction of the partition (at least one drain is allowed).",
        minimum=0.0,
        maximum=1.0,
    )


class GpuSection(Section):
    """[gpu]: the node's GPU fault probe."""

    poll_interval_s: float = setting_field(
        5.0,
        "How often a node's GPU probe looks for new faults (NVML counters, kernel-log Xids, "
        "DCGM, injection). NVML Xid events arrive on their own thread in between.",
        minimum=0.5,
    )
    kernel_log_file: str = setting_field(
        "",
        "Read kernel-log Xid lines from this file instead of /dev/kmsg or dmesg: for sites "
        "with kernel.dmesg_restrict=1, where a root prolog or HealthCheckProgram writes what "
        "it sees (see docs/gpu.md). Empty: the ring buffer.",
    )
    dcgm: bool = setting_field(True, "Ask DCGM (`dcgmi health -c -j`) where it is installed.")
    inject: str = setting_field(
        "",
        "Fault injection for tests and drills: a file of faults, or the faults themselves "
        "('xid=79,gpu=3;kind=ecc_uncorrected,gpu=1'). Empty: none. See docs/gpu.md.",
    )


class AgentSection(Section):
    """[agent]: the node agent and the torchrun it runs."""

    controller_url: str = setting_field(
        "",
        "Base URL where agents send rank reports (the daemon's ingest, http://host:port). "
        "Empty: agents report nothing and skip the clock check.",
    )
    ca_file: str = setting_field(
        "",
        "CA certificate file the agent verifies an https controller_url against (set for each "
        "run from daemon.agents_ca_file). Empty: the system's CAs.",
    )
    rdzv_timeout_s: int = setting_field(
        600,
        "torchrun rendezvous join timeout: how long agents wait for all N nodes to join a round "
        "when no spare is left.",
        minimum=1,
    )
    keep_alive_interval_s: int = setting_field(
        1,
        "Rendezvous keep-alive interval. A node is dead after interval x attempts without one.",
        minimum=1,
    )
    keep_alive_max_attempts: int = setting_field(
        4,
        "Missed keep-alives before a node counts as dead. Below 3, live nodes get removed "
        "(heartbeats land up to two intervals apart); expiry compares wall clocks across nodes.",
        minimum=3,
    )
    max_restarts: int = setting_field(
        1_000_000,
        "torchrun --max-restarts. High on purpose: every peer-node loss costs each survivor one "
        "restart; slurmft's own budget (policy.max_restarts_without_progress) stops crash loops.",
        minimum=0,
    )
    rdzv_wait_list_fix: bool = setting_field(
        True,
        "Apply the fix for torch's wait-list restart loop (needed for hot spares). Turn off only "
        "to reproduce the defect.",
    )
    warm_workers: bool = setting_field(
        True,
        "Start workers warm: a zygote on each node imports torch and the training script's "
        "top-level imports once, and forks every new worker from there, so a restart skips the "
        "imports (2-3 s here). A worker starts cold when the zygote is not there, refuses (an "
        "import initialised CUDA, a source file changed) or does not answer in 120 s. See "
        "docs/agent.md.",
    )
    peer_dead_after_s: float = setting_field(
        1.5,
        "slurmft's dead-peer detector: a node whose launcher has written no rendezvous "
        "heartbeat for this long (by the watching node's clock and its own polls) is evicted "
        "from the rendezvous, and fenced if it runs again. 0: torch's keep-alive alone "
        "(keep_alive_interval_s x keep_alive_max_attempts). See docs/agent.md.",
        minimum=0.0,
    )
    peer_heartbeat_s: float = setting_field(
        0.1,
        "How often each launcher writes its rendezvous heartbeat and reads the two peers it "
        "watches (must be below peer_dead_after_s).",
        minimum=0.01,
    )
    report_interval_s: float = setting_field(
        1.0,
        "How often an agent sends a batch of rank reports (events go at once). The agents of a "
        "run of more than 1,024 nodes send less often, so that the run sends at most 1,024 "
        "batches a second (what the daemon's ingest was measured to keep up with).",
        minimum=0.05,
    )
    report_buffer_max: int = setting_field(
        10_000,
        "Reports an agent keeps while the controller is away; past it the oldest heartbeats, "
        "then step times are dropped (events never).",
        minimum=100,
    )
    max_clock_skew_s: float = setting_field(
        1.0,
        "Clock difference to the controller above which preflight reports a skew event.",
        minimum=0.0,
    )
    stop_grace_s: float = setting_field(
        15.0,
        "How long an agent that leaves waits for torchrun to stop its workers before killing them.",
        minimum=0.0,
    )
    stack_dump_wait_s: float = setting_field(
        3.0,
        "How long an agent waits for a hung worker's stack dump before killing it.",
        minimum=0.1,
    )


class Settings(_Frozen):
    """Every section, typed. The attribute names are the sections' names in the config file, in
    ``SLURMFT_<SECTION>_<KEY>`` and in ``--set section.key=value``; a section not given has its
    defaults."""

    paths: PathsSection
    database: DatabaseSection
    log: LogSection
    slurm: SlurmSection
    daemon: DaemonSection
    notify: NotifySection
    retention: RetentionSection
    policy: PolicySection
    trust: TrustSection
    gpu: GpuSection
    agent: AgentSection

    def __init__(self, **sections: Section) -> None:
        unknown = sorted(sections.keys() - SECTIONS.keys())
        if unknown:
            raise TypeError(f"Settings() got an unexpected keyword argument {unknown[0]!r}")
        for name, section in SECTIONS.items():
            object.__setattr__(self, name, sections[name] if name in sections else section())

    def _names(self) -> Iterable[str]:
        return SECTIONS


def _section_classes() -> dict[str, type[Section]]:
    # Each annotation is the name of its section's class, defined above in this module.
    return {name: globals()[annotation] for name, annotation in Settings.__annotations__.items()}


def _settings_of(section_name: str, section: type[Section]) -> tuple[Setting, ...]:
    return tuple(
        Setting(
            f"{section_name}.{name}",
            kind,
            spec.default,
            spec.help,
            choices=spec.choices,
            minimum=spec.minimum,
            maximum=spec.maximum,
        )
        for name, (kind, spec) in section.__section_fields__.items()
    )


SECTIONS: dict[str, type[Section]] = _section_classes()
SECTION_SETTINGS: dict[type[Section], tuple[Setting, ...]] = {
    section: _settings_of(name, section) for name, section in SECTIONS.items()
}
# The table by key, in the sections' order: what the environment, files, `--set`,
# `slurmft config show` and the reference go by.
SETTINGS: tuple[Setting, ...] = tuple(s for rows in SECTION_SETTINGS.values() for s in rows)
SETTINGS_BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


class Value(NamedTuple):
    """An effective setting and the source it came from."""

    value: Any
    source: str  # "default", a file path, "env SLURMFT_X", "flag --set"


class Config:
    """Effective configuration: the typed ``settings``, plus where each value came from."""

    def __init__(self, values: Mapping[str, Value]) -> None:
        self._values = dict(values)
        self.settings = _typed_settings(self._values)

    def source(self, key: str) -> str:
        return self._values[key].source

    def items(self) -> list[tuple[str, Value]]:
        return sorted(self._values.items())

    @property
    def state_dir(self) -> Path:
        configured = self.settings.paths.state_dir
        if configured:
            return Path(configured).expanduser()
        if os.geteuid() == 0:
            return Path("/var/lib/slurmft")
        xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(xdg) / "slurmft"

    @property
    def runtime_dir(self) -> Path:
        configured = self.settings.paths.runtime_dir
        if configured:
            return Path(configured).expanduser()
        if os.geteuid() == 0:
            return Path("/run/slurmft")
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        return Path(xdg) / "slurmft" if xdg else self.state_dir / "run"

    @property
    def database_url(self) -> str:
        """The store's URL; the default SQLite file lives in the state directory."""
        return self.settings.database.url or f"sqlite:///{self.state_dir / 'slurmft.db'}"

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {key: {"value": v.value, "source": v.source} for key, v in self.items()}


def _typed_settings(values: Mapping[str, Value]) -> Settings:
    sections = {
        name: section(**{s.name: values[s.key].value for s in SECTION_SETTINGS[section]})
        for name, section in SECTIONS.items()
    }
    return Settings(**sections)


def _unknown_key_error(key: str, where: str) -> ConfigError:
    import difflib  # only to explain a typo: the node agent imports this module

    close = difflib.get_close_matches(key, SETTINGS_BY_KEY, n=1)
    hint = f" Did you mean {close[0]}?" if close else " See `slurmft config show` for all keys."
    return ConfigError(f"unknown setting {key!r} in {where}.{hint}")


def _bad_value_error(setting: Setting, raw: Any, where: str, why: str) -> ConfigError:
    return ConfigError(
        f"bad value for {setting.key} = {raw!r} (from {where}): {why}. "
        f"Set it to {setting.describe_type()}, e.g. {setting.key} = {setting.default!r}."
    )


def _flatten_toml(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(
                f"{where}: top-level key {section!r} must be a [section] table "
                f'(e.g. [database] url = "...")'
            )
        for name, value in body.items():
            flat[f"{section}.{name}"] = value
    return flat


def read_toml(path: Path) -> dict[str, Any]:
    """Read one config file into flat ``section.key`` entries, failing with the file's name."""
    import tomllib  # only where a file is read: the node agent imports this module for defaults

    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable by this user") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return _flatten_toml(data, str(path))


def _parse_overrides(overrides: list[str]) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        parsed[key.strip()] = value
    return parsed


def load_config(
    *,
    config_file: Path | None = None,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    system_file: Path | None = None,
) -> Config:
    """Build the effective configuration from every source, in precedence order."""
    env = os.environ if environ is None else environ
    # Looked up at call time, not bound at import, so a test can point it elsewhere.
    system_file = SYSTEM_CONFIG if system_file is None else system_file
    layers: list[tuple[str, dict[str, Any]]] = []
    if system_file.is_file():
        layers.append((str(system_file), read_toml(system_file)))
    user_file = config_file or (Path(env[ENV_CONFIG]) if env.get(ENV_CONFIG) else None)
    if user_file is not None:
        layers.append((str(user_file), read_toml(user_file)))
    env_layer = {s.key: env[s.env_var] for s in SETTINGS if s.env_var in env}
    _refuse_misspelt_variables(env)

    values = {s.key: Value(s.default, "default") for s in SETTINGS}
    for where, layer in layers:
        _apply(values, layer, where, lambda _key, w=where: w)  # type: ignore[misc]  # mypy cannot type a lambda with a default
    _apply(values, env_layer, "environment", lambda key: f"env {SETTINGS_BY_KEY[key].env_var}")
    _apply(values, _parse_overrides(overrides or []), "--set", lambda _key: "flag --set")
    return Config(values)


def _refuse_misspelt_variables(env: Mapping[str, str]) -> None:
    """A SLURMFT_<SECTION>_* variable that is no setting is a typo (SLURMFT_DATABASE_URLL):
    refuse it rather than silently run with the default. Other SLURMFT_* variables (the test
    cluster's, the agent socket a rank is given) are not settings and are left alone."""
    known = {s.env_var for s in SETTINGS} | PROCESS_VARIABLES
    sections = {ENV_PREFIX + s.key.split(".")[0].upper() + "_" for s in SETTINGS}
    for name in sorted(env):
        if name not in known and any(name.startswith(prefix) for prefix in sections):
            import difflib  # only to explain a typo: the node agent imports this module

            close = difflib.get_close_matches(name, [s.env_var for s in SETTINGS], n=1)
            hint = f" Did you mean {close[0]}?" if close else " See `slurmft config show`."
            raise ConfigError(f"unknown environment variable {name}.{hint}")


def _apply(
    values: dict[str, Value], layer: Mapping[str, Any], where: str, source: Callable[[str], str]
) -> None:
    for key, raw in layer.items():
        setting = SETTINGS_BY_KEY.get(key)
        if setting is None:
            raise _unknown_key_error(key, where)
        try:
            values[key] = Value(setting.coerce(raw), source(key))
        except ValueError as exc:
            raise _bad_value_error(setting, raw, source(key), str(exc)) from None


# --- where the SQLite file may live -------------------------------------------------------------


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, filesystem type) pairs from /proc/self/mountinfo text."""
    mounts: list[tuple[str, str]] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        # Mount points escape spaces and friends as octal (\040).
        mount_point = fields[4].encode().decode("unicode_escape")
        mounts.append((mount_point, right.split()[0]))
    return mounts


def filesystem_type(path: Path, mounts: list[tuple[str, str]]) -> str | None:
    """The filesystem type of the mount that holds ``path`` (longest matching mount point)."""
    resolved = str(path.resolve())
    best: tuple[int, str] | None = None
    for mount_point, fstype in mounts:
        prefix = mount_point.rstrip("/") + "/"
        if (resolved == mount_point or resolved.startswith(prefix) or mount_point == "/") and (
            best is None or len(mount_point) >= best[0]
        ):
            best = (len(mount_point), fstype)
    return best[1] if best else None


def check_sqlite_location(db_path: Path, mountinfo: str | None = None) -> None:
    """Refuse a SQLite database on a network filesystem, where its locking cannot be trusted."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return  # not Linux, or /proc hidden: nothing to check against
    fstype = filesystem_type(db_path, parse_mountinfo(mountinfo))
    if fstype in NETWORK_FILESYSTEMS:
        raise ConfigError(
            f"the SQLite store {db_path} is on a {fstype} network filesystem, where SQLite's "
            f"locking is unreliable and the database can be corrupted. Put it on local disk "
            f"(set paths.state_dir) or use PostgreSQL (set database.url)."
        )


def reference_markdown() -> str:
    """The config reference (docs/config.md), generated from ``SETTINGS`` so it cannot drift."""
    lines = [
        "# Configuration reference",
        "",
        "Generated by `slurmft config reference` from `slurmft/config.py`; do not edit by hand.",
        "",
        "Precedence, lowest to highest: defaults < `/etc/slurmft/slurmft.toml` < the file in "
        "`SLURMFT_CONFIG` (or `--config`) < `SLURMFT_<SECTION>_<KEY>` environment variables < "
        "`--set section.key=value`. `slurmft config show` prints each effective value and its "
        "source.",
        "",
    ]
    section = None
    for setting in SETTINGS:
        name, key = setting.key.split(".", 1)
        if name != section:
            section = name
            lines += [f"## [{name}]", ""]
        lines += [
            f"### `{key}`",
            "",
            setting.help,
            "",
            f"- type: {setting.describe_type()}",
            f"- default: `{setting.default!r}`",
            f"- environment: `{setting.env_var}`",
            "",
        ]
    return "\n".join(lines)
