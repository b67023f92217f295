from __future__ import annotations

from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from slurmft.config import (
    SECTIONS,
    SETTINGS,
    SETTINGS_BY_KEY,
    Config,
    ConfigError,
    LogSection,
    PolicySection,
    Section,
    Settings,
    check_sqlite_location,
    filesystem_type,
    load_config,
    parse_mountinfo,
    setting_field,
)

MOUNTINFO = """\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:40 / /home rw,relatime shared:20 - nfs4 srv:/export/home rw,vers=4.2
31 22 0:41 / /scratch rw,relatime shared:21 - lustre 10.0.0.1@o2ib:/scratch rw
32 22 0:42 / /var/lib rw,relatime shared:22 - xfs /dev/vdb rw
33 30 0:43 / /home/local\\040disk rw,relatime shared:23 - ext4 /dev/vdc rw
"""


def _load(tmp_path: Path, **kwargs: object) -> Config:
    kwargs.setdefault("environ", {})
    kwargs.setdefault("system_file", tmp_path / "absent.toml")
    return load_config(**kwargs)  # type: ignore[arg-type]


def _typed_value(config: Config, key: str) -> object:
    """The value of ``section.name`` as the typed settings hold it."""
    section, name = key.split(".")
    return getattr(getattr(config.settings, section), name)


def test_defaults_come_from_the_settings_table(tmp_path: Path) -> None:
    config = _load(tmp_path)
    for setting in SETTINGS:
        assert _typed_value(config, setting.key) == setting.default
        assert config.source(setting.key) == "default"
    assert config.settings == Settings()
    assert config.settings.policy.max_restarts_without_progress == 5
    assert config.settings.policy.straggler_threshold == pytest.approx(0.2)


def test_precedence_system_file_user_file_env_flags(tmp_path: Path) -> None:
    system = tmp_path / "system.toml"
    system.write_text(
        '[log]\nlevel = "DEBUG"\nformat = "json"\n[daemon]\npoll_interval_s = 2\n'
        "[policy]\nstraggler_window_s = 60\n"
    )
    user = tmp_path / "user.toml"
    user.write_text('[log]\nlevel = "WARNING"\n[daemon]\npoll_interval_s = 3\n')
    config = load_config(
        system_file=system,
        environ={
            "SLURMFT_CONFIG": str(user),
            "SLURMFT_DAEMON_POLL_INTERVAL_S": "4",
            "SLURMFT_LOG_LEVEL": "ERROR",
        },
        overrides=["log.level=INFO"],
    )
    settings = config.settings
    assert (settings.log.format, config.source("log.format")) == ("json", str(system))
    assert (settings.policy.straggler_window_s, config.source("policy.straggler_window_s")) == (
        60.0,
        str(system),
    )
    assert settings.daemon.poll_interval_s == 4.0
    assert config.source("daemon.poll_interval_s") == "env SLURMFT_DAEMON_POLL_INTERVAL_S"
    assert (settings.log.level, config.source("log.level")) == ("INFO", "flag --set")


def test_explicit_config_file_wins_over_the_environment_variable(tmp_path: Path) -> None:
    env_file = tmp_path / "env.toml"
    env_file.write_text('[log]\nlevel = "ERROR"\n')
    flag_file = tmp_path / "flag.toml"
    flag_file.write_text('[log]\nlevel = "DEBUG"\n')
    config = _load(tmp_path, config_file=flag_file, environ={"SLURMFT_CONFIG": str(env_file)})
    assert config.settings.log.level == "DEBUG"


@pytest.mark.parametrize(
    ("environ", "overrides", "needle"),
    [
        ({"SLURMFT_POLICY_STRAGGLER_THRESHOLD": "fast"}, [], "policy.straggler_threshold"),
        ({"SLURMFT_POLICY_STRAGGLER_THRESHOLD": "-1"}, [], "must be at least 0.01"),
        ({"SLURMFT_LOG_FORMAT": "xml"}, [], "one of text, json"),
        ({}, ["daemon.observe_only=maybe"], "true or false"),
        ({}, ["policy.max_restarts_without_progress=2.5"], "a whole number"),
        ({}, ["log.level"], "section.key=value"),
        ({}, ["policy.straggler_treshold=0.3"], "Did you mean policy.straggler_threshold"),
        ({"SLURMFT_DATABASE_URLL": "x"}, [], "Did you mean SLURMFT_DATABASE_URL"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(
    tmp_path: Path, environ: dict[str, str], overrides: list[str], needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, environ=environ, overrides=overrides)
    assert needle in str(info.value)


def test_bad_value_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[database]\nbusy_timeout_ms = "soon"\n')
    with pytest.raises(ConfigError, match=r"database\.busy_timeout_ms.*c\.toml"):
        _load(tmp_path, config_file=path)


@pytest.mark.parametrize(
    ("text", "needle"),
    [("[log\nlevel=1", "not valid TOML"), ('level = "INFO"\n', "must be a [section] table")],
)
def test_malformed_files_are_clear_errors(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        _load(tmp_path, config_file=path)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        _load(tmp_path, environ={"SLURMFT_CONFIG": str(tmp_path / "nope.toml")})


def test_default_database_is_sqlite_in_the_state_dir(tmp_path: Path) -> None:
    config = _load(tmp_path, overrides=[f"paths.state_dir={tmp_path}/state"])
    assert config.database_url == f"sqlite:///{tmp_path}/state/slurmft.db"


def test_mountinfo_finds_the_longest_mount() -> None:
    mounts = parse_mountinfo(MOUNTINFO)
    assert ("/home/local disk", "ext4") in mounts
    assert filesystem_type(Path("/home/alice/db.sqlite"), mounts) == "nfs4"
    assert filesystem_type(Path("/home/local disk/db.sqlite"), mounts) == "ext4"
    assert filesystem_type(Path("/scratch/x"), mounts) == "lustre"
    assert filesystem_type(Path("/var/lib/slurmft/slurmft.db"), mounts) == "xfs"
    assert filesystem_type(Path("/var/library"), mounts) == "ext4"


@pytest.mark.parametrize("path", ["/home/alice/slurmft.db", "/scratch/run/slurmft.db"])
def test_sqlite_on_a_network_filesystem_is_refused(path: str) -> None:
    with pytest.raises(ConfigError, match=r"network filesystem.*local disk"):
        check_sqlite_location(Path(path), MOUNTINFO)


def test_sqlite_on_local_disk_is_accepted() -> None:
    check_sqlite_location(Path("/var/lib/slurmft/slurmft.db"), MOUNTINFO)


def test_docs_config_reference_is_generated_from_the_settings() -> None:
    from slurmft.config import reference_markdown

    docs = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert docs.read_text() == reference_markdown(), (
        "docs/config.md is stale: run `slurmft config reference > docs/config.md`"
    )
    for setting in SETTINGS:
        assert f"`{setting.env_var}`" in docs.read_text()


def test_variables_that_are_not_settings_are_left_alone(tmp_path: Path) -> None:
    env = {
        "SLURMFT_CLUSTER_ROOT": "/tmp/c",
        "SLURMFT_AGENT_SOCKET": "/tmp/s",
        "SLURMFT_TEST_POSTGRES_URL": "postgresql://x",
        "SLURMFT_STACKS_DIR": "/tmp/x",
    }
    assert _load(tmp_path, environ=env).settings.log.level == "INFO"


# --- the typed sections ----------------------------------------------------------------------


def test_the_settings_table_is_derived_from_the_sections() -> None:
    """Every field of every section is one row of SETTINGS, in order, with the field's own
    default, help and bounds: the table is not written a second time."""
    declared = [
        (f"{name}.{field}", kind, spec)
        for name, section in SECTIONS.items()
        for field, (kind, spec) in section.__section_fields__.items()
    ]
    assert [key for key, _, _ in declared] == [s.key for s in SETTINGS]
    assert list(SECTIONS) == list(Settings.__annotations__)
    for key, kind, spec in declared:
        setting = SETTINGS_BY_KEY[key]
        assert setting.default is spec.default
        assert setting.help is spec.help
        assert (setting.kind, setting.choices, setting.minimum, setting.maximum) == (
            kind,
            spec.choices,
            spec.minimum,
            spec.maximum,
        )
        section, name = key.split(".")
        assert getattr(SECTIONS[section], name) is spec.default  # the class attribute


def test_a_section_is_a_frozen_value() -> None:
    policy = PolicySection(max_restarts_without_progress=7)
    assert policy == PolicySection(max_restarts_without_progress=7) != PolicySection()
    assert hash(policy) == hash(PolicySection(max_restarts_without_progress=7))
    assert repr(LogSection()) == "LogSection(level='INFO', format='text')"
    settings = Settings(policy=policy)
    assert settings.policy is policy and settings.trust == Settings().trust
    assert settings != Settings() and hash(settings) == hash(Settings(policy=policy))
    with pytest.raises(TypeError, match="'polcy'"):
        Settings(polcy=policy)
    with pytest.raises(FrozenInstanceError):
        policy.max_restarts_without_progress = 3  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        settings.policy = policy


def test_a_setting_of_another_type_is_refused_where_it_is_declared() -> None:
    with pytest.raises(TypeError, match="declare a setting as"):

        class _Bad(Section):  # pyright: ignore[reportUnusedClass]
            retries: int = setting_field(2.5, "A float default for an int.")  # type: ignore[assignment]


def test_typed_settings_hold_the_effective_values(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[trust]\ndrain_gpu_faults = false\n")
    config = _load(
        tmp_path,
        config_file=path,
        environ={"SLURMFT_AGENT_MAX_RESTARTS": "9"},
        overrides=["policy.max_restarts_without_progress=7"],
    )
    assert config.settings.policy.max_restarts_without_progress == 7
    assert config.settings.trust.drain_gpu_faults is False
    assert config.settings.agent.max_restarts == 9
    for key, value in config.items():
        assert _typed_value(config, key) == value.value


def test_code_takes_its_defaults_from_the_sections() -> None:
    """The policy, the agent, its torchrun and the batch step default to the sections' values."""
    from slurmft.agent.agent import AgentSettings
    from slurmft.agent.batch import BatchSpec
    from slurmft.agent.command import TorchrunSpec
    from slurmft.controller.decide import Policy, TrustPolicy

    defaults = Settings()
    policy = Policy()
    assert (
        policy.straggler_threshold,
        policy.straggler_window_s,
        policy.silent_after_s,
        policy.unresponsive_after_s,
    ) == (
        defaults.policy.straggler_threshold,
        defaults.policy.straggler_window_s,
        defaults.policy.silent_after_s,
        defaults.policy.unresponsive_after_s,
    )
    trust = defaults.trust
    assert TrustPolicy() == TrustPolicy(
        trust.drain_gpu_faults,
        trust.straggler_drain_after_windows,
        trust.drains_per_hour,
        trust.max_drained_fraction,
    )
    spec = TorchrunSpec(nodes=2, nproc_per_node=1, rdzv_endpoint="h:1", rdzv_id="r", script=("t",))
    agent = defaults.agent
    assert (
        spec.rdzv_timeout_s,
        spec.keep_alive_interval_s,
        spec.keep_alive_max_attempts,
        spec.max_restarts,
        spec.wait_list_fix,
    ) == (
        agent.rdzv_timeout_s,
        agent.keep_alive_interval_s,
        agent.keep_alive_max_attempts,
        agent.max_restarts,
        agent.rdzv_wait_list_fix,
    )
    settings = AgentSettings(spec=spec, node="n", run_id="r", work_dir=Path("/tmp"))
    assert (
        settings.controller_url,
        settings.report_interval_s,
        settings.max_buffered,
        settings.max_clock_skew_s,
        settings.stop_grace_s,
        settings.stack_wait_s,
        settings.gpu_poll_s,
    ) == (
        agent.controller_url,
        agent.report_interval_s,
        agent.report_buffer_max,
        agent.max_clock_skew_s,
        agent.stop_grace_s,
        agent.stack_dump_wait_s,
        defaults.gpu.poll_interval_s,
    )
    batch = BatchSpec(run_id="r", nodes=2, spares=0, script=("t",), ckpt_dir="/c")
    assert batch.max_restarts_without_progress == defaults.policy.max_restarts_without_progress


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: PolicySection(max_restarts_without_progress=0), "must be at least 1"),
        (lambda: PolicySection(straggler_threshold=11.0), "must be at most 10.0"),
        (lambda: PolicySection(max_restarts_without_progress=2.5), "a whole number"),  # type: ignore[arg-type]
        (lambda: LogSection(format="xml"), "one of text, json"),
        (lambda: LogSection(level=3), "a string"),  # type: ignore[arg-type]
    ],
)
def test_a_section_built_in_code_is_held_to_the_bounds(build: object, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()  # type: ignore[operator]
    assert needle in str(info.value)
    assert "Section" in str(info.value)  # the message names where the value came from


def test_a_misspelt_key_in_a_file_names_the_key_it_meant(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[policy]\nmax_restarts_without_progres = 3\n")
    with pytest.raises(ConfigError, match=r"Did you mean policy\.max_restarts_without_progress"):
        _load(tmp_path, config_file=path)
    with pytest.raises(TypeError, match="max_restarts_without_progres"):
        PolicySection(max_restarts_without_progres=3)  # type: ignore[call-arg]
