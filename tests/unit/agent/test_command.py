"""The torchrun command line and environment an agent runs (golden)."""

from __future__ import annotations

import pytest

from slurmft.agent.command import (
    NCCL_ENV,
    TorchrunSpec,
    default_rdzv_poll_s,
    launcher_argv,
    torchrun_args,
    torchrun_env,
)


def spec(**overrides: object) -> TorchrunSpec:
    base: dict[str, object] = {
        "nodes": 3,
        "nproc_per_node": 8,
        "rdzv_endpoint": "10.0.0.1:29400",
        "rdzv_id": "r1234",
        "script": ("train.py", "--lr", "0.1"),
    }
    base.update(overrides)
    return TorchrunSpec(**base)  # type: ignore[arg-type]


def test_golden_launcher_argv() -> None:
    assert launcher_argv(spec(), "/venv/bin/python") == [
        "/venv/bin/python",
        "-m",
        "slurmft.agent.launcher",
        "--wait-list-fix",
        "--rdzv-poll-s=0.1",
        "--warm-workers",
        "--peer-dead-after-s=1.5",
        "--peer-heartbeat-s=0.1",
        "--",
        "--nnodes=3:3",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=r1234",
        "--rdzv-conf=is_host=false,join_timeout=600,keep_alive_interval=1,keep_alive_max_attempt=4",
        "--max-restarts=1000000",
        "-m",
        "slurmft.agent.warm_start",
        "train.py",
        "--lr",
        "0.1",
    ]


def test_cold_workers_run_the_script_itself() -> None:
    argv = launcher_argv(spec(warm_workers=False, script=("-m", "pkg.train", "-x")), "py")
    assert "--warm-workers" not in argv
    assert argv[-4:] == ["--max-restarts=1000000", "-m", "pkg.train", "-x"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"rdzv_timeout_s": 120}, "join_timeout=120"),
        (
            {"keep_alive_interval_s": 2, "keep_alive_max_attempts": 5},
            "keep_alive_interval=2,keep_alive_max_attempt=5",
        ),
        ({"max_restarts": 7}, "--max-restarts=7"),
        ({"local_addr": "10.0.0.9"}, "--local-addr=10.0.0.9"),
        ({"script": ("-m", "pkg.train")}, "-m pkg.train"),
        (
            {"worker_log_dir": "/tmp/a/worker-logs"},
            "--tee=3 --log-dir=/tmp/a/worker-logs -m slurmft.agent.warm_start train.py",
        ),
    ],
)
def test_settings_reach_torchrun(overrides: dict[str, object], expected: str) -> None:
    assert expected in " ".join(torchrun_args(spec(**overrides)))


def test_spare_candidate_and_disabled_fix_reach_the_launcher() -> None:
    argv = launcher_argv(
        spec(spare_candidate=True, wait_list_fix=False, peer_dead_after_s=0), "py"
    )
    assert argv[3:8] == [
        "--no-wait-list-fix",
        "--spare-candidate",
        "--rdzv-poll-s=0.1",
        "--warm-workers",
        "--",
    ]


def test_a_heartbeat_no_faster_than_the_dead_peer_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="peer_heartbeat_s must be below"):
        spec(peer_dead_after_s=0.5, peer_heartbeat_s=0.5)


@pytest.mark.parametrize(
    ("nodes", "poll_s"),
    [(1, 0.1), (4, 0.1), (32, 0.1), (33, 0.13), (48, 0.55), (64, 1.0), (2048, 1.0)],
)
def test_rendezvous_poll_lengthens_with_the_node_count_up_to_torchs_second(
    nodes: int, poll_s: float
) -> None:
    assert default_rdzv_poll_s(nodes) == pytest.approx(poll_s)
    assert f"--rdzv-poll-s={poll_s:g}" in launcher_argv(spec(nodes=nodes), "py")


def test_a_chosen_rendezvous_poll_wins_and_must_be_within_a_second() -> None:
    assert "--rdzv-poll-s=0.25" in launcher_argv(spec(rdzv_poll_s=0.25), "py")
    with pytest.raises(ValueError, match="poll"):
        spec(rdzv_poll_s=2.0)


def test_env_forces_store_fix_and_channel_but_keeps_users_nccl_choice() -> None:
    env = torchrun_env(
        {
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
            "PATH": "/bin",
        },
        agent_socket="/tmp/a/ranks.sock",
        stacks_dir="/tmp/a/stacks",
        save_request_file="/tmp/a/save-request",
    )
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's value wins
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == NCCL_ENV["TORCH_NCCL_ENABLE_MONITORING"]
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/a/stacks/nccl-trace-rank-"
    assert env["SLURMFT_AGENT_SOCKET"] == "/tmp/a/ranks.sock"
    assert env["SLURMFT_STACKS_DIR"] == "/tmp/a/stacks"
    assert env["SLURMFT_SAVE_REQUEST_FILE"] == "/tmp/a/save-request"
    assert env["PATH"] == "/bin"
    # torchrun labels each tee'd worker line with its global rank (slurmft logs --rank).
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]: "


@pytest.mark.parametrize(
    "overrides",
    [{"nodes": 0}, {"nproc_per_node": 0}, {"script": ()}, {"keep_alive_max_attempts": 0}],
)
def test_bad_specs_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        spec(**overrides)
