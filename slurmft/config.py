"""One typed configuration for every slurmft process.

Precedence, lowest to highest: built-in defaults < ``/etc/slurmft/slurmft.toml`` < the file named
by ``SLURMFT_CONFIG`` (or ``--config``) < ``SLURMFT_<SECTION>_<KEY>`` environment variables <
command-line ``--set section.key=value``. Every effective value remembers where it came from so
``slurmft config show`` can say why a value is what it is.

The schema is the ``SETTINGS`` table below: adding a setting is one line there, and the docs'
config reference is generated from it.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Setting:
    """One configuration key: its type, default and meaning."""

    key: str  # "section.name"
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None

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


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "paths.state_dir",
        str,
        "",
        "Directory for the SQLite store and daemon state. Empty: /var/lib/slurmft for root, "
        "$XDG_STATE_HOME/slurmft (~/.local/state/slurmft) otherwise. Must be on local disk.",
    ),
    Setting(
        "paths.runtime_dir",
        str,
        "",
        "Directory for the CLI's unix socket. Empty: /run/slurmft for root, "
        "$XDG_RUNTIME_DIR/slurmft (or the state directory) otherwise.",
    ),
    Setting(
        "database.url",
        str,
        "",
        "SQLAlchemy URL of the store. Empty: a SQLite file slurmft.db in the state directory. "
        "PostgreSQL: postgresql://user@host/db (driven by psycopg 3).",
    ),
    Setting(
        "database.busy_timeout_ms",
        int,
        5000,
        "SQLite: how long a writer waits for a lock before failing.",
        minimum=0,
    ),
    Setting("database.pool_size", int, 5, "PostgreSQL connection pool size.", minimum=1),
    Setting("log.level", str, "INFO", "Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR")),
    Setting(
        "log.format",
        str,
        "text",
        "Log line format: text (journald-friendly) or json.",
        choices=("text", "json"),
    ),
    Setting(
        "slurm.conf",
        str,
        "",
        "Path to slurm.conf for the Slurm commands. Empty: Slurm's own default (SLURM_CONF or "
        "/etc/slurm/slurm.conf).",
    ),
    Setting(
        "slurm.command_timeout_s",
        float,
        30.0,
        "Timeout of one Slurm command; past it the call fails as 'Slurm unreachable'.",
        minimum=1.0,
    ),
    Setting(
        "daemon.agents_url",
        str,
        "",
        "The URL agents on compute nodes report to, e.g. http://login1:8787. Empty: the ingest "
        "endpoint as bound (daemon.ingest_listen), which suits a single machine.",
    ),
    Setting(
        "daemon.ingest_listen",
        str,
        "127.0.0.1:8787",
        "host:port where the daemon receives agent reports over HTTP.",
    ),
    Setting(
        "daemon.metrics_listen",
        str,
        "127.0.0.1:9787",
        "host:port of the Prometheus /metrics and /healthz endpoint.",
    ),
    Setting(
        "daemon.poll_interval_s",
        float,
        5.0,
        "How often the daemon queries Slurm for all tracked jobs (one batched call).",
        minimum=0.5,
    ),
    Setting(
        "daemon.observe_only", bool, False, "Decide and record actions but execute none of them."
    ),
    Setting(
        "daemon.stuck_after_passes",
        int,
        24,
        "The main loop counts as stuck when no control pass has ended for this many poll "
        "intervals: /healthz fails and the systemd watchdog pings stop (systemd then restarts "
        "the daemon). Keep it above the Slurm calls of one slow pass (slurm.command_timeout_s).",
        minimum=2,
    ),
    Setting(
        "notify.webhook_url",
        str,
        "",
        "When a person is needed (a run stopped at the crash cap, spares exhausted, a drain "
        "refused, a resubmission waiting for its owner), POST a JSON message here; its `text` "
        "field suits Slack/Mattermost-style incoming webhooks. Empty: only `slurmft status` "
        "shows it. Undelivered messages wait in the store and are retried in order.",
    ),
    Setting(
        "notify.webhook_timeout_s",
        float,
        5.0,
        "How long one webhook POST may take before it is retried later.",
        minimum=0.1,
    ),
    Setting(
        "notify.webhook_interval_s",
        float,
        10.0,
        "How often waiting webhook messages are sent.",
        minimum=0.5,
    ),
    Setting(
        "retention.step_times_raw_hours",
        float,
        6.0,
        "Raw per-step times are kept this long, then folded into per-rank per-minute "
        "aggregates (kept for good).",
        minimum=0.0,
    ),
    Setting(
        "retention.heartbeat_history_hours",
        float,
        24.0,
        "Sampled heartbeat history is kept this long; the latest heartbeat per rank is "
        "always kept.",
        minimum=0.0,
    ),
    Setting(
        "retention.heartbeat_sample_s",
        float,
        60.0,
        "At most one heartbeat per rank per this many seconds goes into the history.",
        minimum=0.0,
    ),
    Setting(
        "policy.max_restarts_without_progress",
        int,
        5,
        "Stop a run after this many restarts in a row without a newer verified checkpoint.",
        minimum=1,
    ),
    Setting(
        "policy.straggler_threshold",
        float,
        0.20,
        "A rank whose own compute time exceeds the median of its peers by more than this "
        "fraction, sustained over the window, is a straggler.",
        minimum=0.01,
        maximum=10.0,
    ),
    Setting(
        "policy.straggler_window_s",
        float,
        300.0,
        "How long a straggler margin must be sustained before it is flagged.",
        minimum=1.0,
    ),
    Setting(
        "policy.silent_after_s",
        float,
        30.0,
        "A rank whose heartbeats stop this long while its peers' still arrive is frozen (a "
        "hang); all ranks silent together is a report-channel problem, never a hang.",
        minimum=1.0,
    ),
    Setting(
        "policy.unresponsive_after_s",
        float,
        60.0,
        "A node whose agent stops reporting this long while the run's other agents report is "
        "unresponsive: out of the run, drained (within the drain limits) and set DOWN, which "
        "evicts it from a --no-kill job. Agents report at least every 2 s (a keep-alive).",
        minimum=5.0,
    ),
    Setting(
        "trust.drain_gpu_faults",
        bool,
        True,
        "Drain a node in Slurm (for everyone) on a drain-class GPU fault. Off: the node only "
        "leaves the run that saw the fault.",
    ),
    Setting(
        "trust.straggler_drain_after_windows",
        int,
        3,
        "Drain a straggler node only after it was flagged in this many windows; before that it "
        "only leaves the run.",
        minimum=1,
    ),
    Setting(
        "trust.lemon_min_runs",
        int,
        2,
        "Restart-class Xids (13, 31, 43) make a node a lemon only when they repeat on it in this "
        "many different runs.",
        minimum=2,
    ),
    Setting(
        "trust.drains_per_hour",
        int,
        4,
        "At most this many drains per hour; past it a drain becomes a notice to a human.",
        minimum=0,
    ),
    Setting(
        "trust.max_drained_fraction",
        float,
        0.1,
        "Never drain past this fraction of the partition (at least one drain is allowed).",
        minimum=0.0,
        maximum=1.0,
    ),
    Setting(
        "gpu.poll_interval_s",
        float,
        5.0,
        "How often a node's GPU probe looks for new faults (NVML counters, kernel-log Xids, "
        "DCGM, injection). NVML Xid events arrive on their own thread in between.",
        minimum=0.5,
    ),
    Setting(
        "gpu.kernel_log_file",
        str,
        "",
        "Read kernel-log Xid lines from this file instead of /dev/kmsg or dmesg: for sites "
        "with kernel.dmesg_restrict=1, where a root prolog or HealthCheckProgram writes what "
        "it sees (see docs/gpu.md). Empty: the ring buffer.",
    ),
    Setting("gpu.dcgm", bool, True, "Ask DCGM (`dcgmi health -c -j`) where it is installed."),
    Setting(
        "gpu.inject",
        str,
        "",
        "Fault injection for tests and drills: a file of faults, or the faults themselves "
        "('xid=79,gpu=3;kind=ecc_uncorrected,gpu=1'). Empty: none. See docs/gpu.md.",
    ),
    Setting(
        "agent.controller_url",
        str,
        "",
        "Base URL where agents send rank reports (the daemon's ingest, http://host:port). "
        "Empty: agents report nothing and skip the clock check.",
    ),
    Setting(
        "agent.rdzv_timeout_s",
        int,
        600,
        "torchrun rendezvous join timeout: how long agents wait for all N nodes to join a round "
        "when no spare is left.",
        minimum=1,
    ),
    Setting(
        "agent.keep_alive_interval_s",
        int,
        1,
        "Rendezvous keep-alive interval. A node is dead after interval x attempts without one.",
        minimum=1,
    ),
    Setting(
        "agent.keep_alive_max_attempts",
        int,
        4,
        "Missed keep-alives before a node counts as dead. Below 3, live nodes get removed "
        "(heartbeats land up to two intervals apart); expiry compares wall clocks across nodes.",
        minimum=3,
    ),
    Setting(
        "agent.max_restarts",
        int,
        1_000_000,
        "torchrun --max-restarts. High on purpose: every peer-node loss costs each survivor one "
        "restart; slurmft's own budget (policy.max_restarts_without_progress) stops crash loops.",
        minimum=0,
    ),
    Setting(
        "agent.rdzv_wait_list_fix",
        bool,
        True,
        "Apply the fix for torch's wait-list restart loop (needed for hot spares). Turn off only "
        "to reproduce the defect.",
    ),
    Setting(
        "agent.report_interval_s",
        float,
        1.0,
        "How often an agent sends a batch of rank reports (events go at once).",
        minimum=0.05,
    ),
    Setting(
        "agent.report_buffer_max",
        int,
        10_000,
        "Reports an agent keeps while the controller is away; past it the oldest heartbeats, "
        "then step times are dropped (events never).",
        minimum=100,
    ),
    Setting(
        "agent.max_clock_skew_s",
        float,
        1.0,
        "Clock difference to the controller above which preflight reports a skew event.",
        minimum=0.0,
    ),
    Setting(
        "agent.stop_grace_s",
        float,
        15.0,
        "How long an agent that leaves waits for torchrun to stop its workers before killing them.",
        minimum=0.0,
    ),
    Setting(
        "agent.stack_dump_wait_s",
        float,
        3.0,
        "How long an agent waits for a hung worker's stack dump before killing it.",
        minimum=0.1,
    ),
)
SETTINGS_BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


@dataclass(frozen=True)
class Value:
    """An effective setting and the source it came from."""

    value: Any
    source: str  # "default", a file path, "env SLURMFT_X", "flag --set"


class Config:
    """Effective configuration: typed lookup by key, plus where each value came from."""

    def __init__(self, values: Mapping[str, Value]) -> None:
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key].value

    def source(self, key: str) -> str:
        return self._values[key].source

    def items(self) -> list[tuple[str, Value]]:
        return sorted(self._values.items())

    @property
    def state_dir(self) -> Path:
        configured = self["paths.state_dir"]
        if configured:
            return Path(configured).expanduser()
        if os.geteuid() == 0:
            return Path("/var/lib/slurmft")
        xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(xdg) / "slurmft"

    @property
    def runtime_dir(self) -> Path:
        configured = self["paths.runtime_dir"]
        if configured:
            return Path(configured).expanduser()
        if os.geteuid() == 0:
            return Path("/run/slurmft")
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        return Path(xdg) / "slurmft" if xdg else self.state_dir / "run"

    @property
    def database_url(self) -> str:
        """The store's URL; the default SQLite file lives in the state directory."""
        return self["database.url"] or f"sqlite:///{self.state_dir / 'slurmft.db'}"

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {key: {"value": v.value, "source": v.source} for key, v in self.items()}


def _unknown_key_error(key: str, where: str) -> ConfigError:
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
        _apply(values, layer, where, lambda _key, w=where: w)
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
