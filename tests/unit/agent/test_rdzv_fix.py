"""The wait-list fix and the shorter state poll: their effect on torch's own rendezvous code,
and the version gate."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from slurmft.agent import peer_detector, rdzv_fix
from slurmft.agent.exits import AgentExit

pytestmark = pytest.mark.torch

# Run in a child: the fix patches torch's classes in place, for the whole process.
DECISIONS = textwrap.dedent(
    """
    import time
    from datetime import timedelta
    from slurmft.agent import rdzv_fix
    d = rdzv_fix.load_module()

    def node(i):
        return d._NodeDesc(f"n{i}", 1, 0)

    settings = d.RendezvousSettings("r", 3, 3, d.RendezvousTimeout(), timedelta(seconds=1), 4)
    state = d._RendezvousState()
    state.complete = True
    state.participants = {node(0): 0, node(1): 1, node(2): 2}
    state.wait_list = {node(3)}                    # left over from the previous round
    now = d.datetime.now(d.timezone.utc)
    state.last_heartbeats = {n: now for n in [*state.participants, node(3)]}
    ctx = d._RendezvousContext(node(3), state, settings)
    print("join", d._RendezvousJoinOp()(ctx, time.monotonic() + 60).name)

    class Holder:
        def sync(self):
            return None
    handler = d.DynamicRendezvousHandler.__new__(d.DynamicRendezvousHandler)
    handler._heartbeat_lock = __import__("threading").Lock()
    handler._state_holder = Holder()
    handler._state_holder.state = state
    handler._settings = settings
    print("waiting", handler.num_nodes_waiting())
    """
)


def decisions(with_fix: bool) -> list[str]:
    script = (
        "from slurmft.agent import rdzv_fix; rdzv_fix.apply(rdzv_fix.load_module())\n"
        if with_fix
        else ""
    ) + DECISIONS
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_torch_alone_keeps_a_leftover_node_waiting_which_restarts_everyone() -> None:
    assert decisions(with_fix=False) == ["join", "SYNC", "waiting", "1"]


def test_with_the_fix_the_leftover_becomes_a_spare_and_nobody_restarts() -> None:
    assert decisions(with_fix=True) == ["join", "ADD_TO_REDUNDANCY_LIST", "waiting", "0"]


def test_the_gate_knows_this_torch() -> None:
    assert rdzv_fix.check_internals(rdzv_fix.load_module()) == []


def copy_of_torch_module() -> types.ModuleType:
    real = rdzv_fix.load_module()
    fake = types.ModuleType(real.__name__)
    fake.__dict__.update(real.__dict__)
    return fake


def test_the_gate_refuses_a_missing_internal() -> None:
    module = copy_of_torch_module()
    del module._RendezvousJoinOp
    problems = rdzv_fix.check_internals(module)
    assert "_RendezvousJoinOp.__call__ is missing" in problems


def test_the_gate_refuses_a_changed_function(monkeypatch: pytest.MonkeyPatch) -> None:
    module = copy_of_torch_module()

    class Handler(module.DynamicRendezvousHandler):  # type: ignore[name-defined,misc]
        def num_nodes_waiting(self) -> int:  # what a future torch might do instead
            return 0

    module.DynamicRendezvousHandler = Handler
    (problem,) = rdzv_fix.check_internals(module)
    assert problem.startswith("DynamicRendezvousHandler.num_nodes_waiting changed")


def test_the_gate_refuses_a_changed_state() -> None:
    module = copy_of_torch_module()

    class State:
        def __init__(self) -> None:
            self.complete, self.closed, self.participants = False, False, {}

    module._RendezvousState = State
    assert rdzv_fix.check_internals(module) == [
        "_RendezvousState.wait_list is missing",
        "_RendezvousState.redundancy_list is missing",
    ]


def test_launcher_refuses_spares_on_unknown_torch_and_runs_the_first_n_without_the_fix() -> None:
    script = textwrap.dedent(
        """
        import enum
        from slurmft.agent import launcher, rdzv_fix
        d = rdzv_fix.load_module()
        # A torch whose internals the fix does not know: an action it relies on is gone.
        d._Action = enum.Enum("_Action", ["KEEP_ALIVE", "SYNC", "FINISH"])
        spare = launcher.prepare_rendezvous(wait_list_fix=True, spare_candidate=True)
        active = launcher.prepare_rendezvous(wait_list_fix=True, spare_candidate=False)
        print(int(spare), active, rdzv_fix.is_applied(d))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(int(AgentExit.SPARE_REFUSED)), "None", "False"]
    assert "does not know torch" in done.stderr and "_Action.ADD_TO_REDUNDANCY_LIST" in done.stderr
    assert "not joining (spares need the fix)" in done.stderr


# What the poll patch changes, seen in a child: torch's sleeps (recorded, not slept) and the
# state holder's cache.
POLL = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    from slurmft.agent import rdzv_fix
    d = rdzv_fix.load_module()
    inside = []  # the state cache while a rendezvous is in progress
    def next_rendezvous(self):
        inside.append(self._state_holder._cache_duration)
    d.DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # before apply wraps it
    if len(sys.argv) > 1:
        rdzv_fix.apply(d, float(sys.argv[1]))
    slept = []
    time.sleep = slept.append
    d._delay(seconds=1)  # the SYNC poll in _DistributedRendezvousOpExecutor.run
    d._delay(seconds=(0.2, 0.2))  # the first round's skew
    settings = d.RendezvousSettings("r", 3, 3, d.RendezvousTimeout(), timedelta(seconds=1), 4)
    holder = d._BackendRendezvousStateHolder(None, settings)
    handler = d.DynamicRendezvousHandler.__new__(d.DynamicRendezvousHandler)
    handler._state_holder = holder
    handler.next_rendezvous()
    # sleeps, the cache inside a rendezvous, the cache while training, the poll
    print(*slept, *inside, holder._cache_duration, rdzv_fix.poll_interval(d))
    """
)


def poll_seen(*poll_s: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", POLL, *poll_s],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_torch_alone_polls_and_caches_the_state_for_one_second() -> None:
    assert poll_seen() == ["1", "0.2", "1", "1", "1.0"]


def test_the_shorter_poll_shortens_the_sync_sleep_and_the_cache_inside_a_rendezvous_only() -> None:
    # While the workers train, the monitor loop's num_nodes_waiting() keeps torch's cache.
    assert poll_seen("0.1") == ["0.1", "0.2", "0.1", "1", "0.1"]


def test_a_poll_of_torchs_own_second_changes_nothing() -> None:
    assert poll_seen("1") == ["1", "0.2", "1", "1", "1.0"]


@pytest.mark.parametrize("poll_s", [0.0, -1.0, 1.5])
def test_a_poll_outside_zero_to_one_second_is_refused(poll_s: float) -> None:
    with pytest.raises(ValueError, match="poll_s"):
        rdzv_fix.apply(copy_of_torch_module(), poll_s)


def test_the_gate_refuses_a_changed_state_cache() -> None:
    module = copy_of_torch_module()

    class Holder(module._BackendRendezvousStateHolder):  # type: ignore[name-defined,misc]
        def sync(self) -> bool | None:  # a torch that caches differently
            return None

    module._BackendRendezvousStateHolder = Holder
    (problem,) = rdzv_fix.check_internals(module)
    assert problem.startswith("_BackendRendezvousStateHolder.sync changed")


def test_the_gate_refuses_a_new_one_second_delay_elsewhere() -> None:
    source = "\n".join(["x = 1", *rdzv_fix.KNOWN_DELAY_CALLS, "        _delay(seconds=1)"])
    (problem,) = rdzv_fix.check_delay_calls(source)
    assert problem.startswith("_delay calls changed")
    assert rdzv_fix.check_delay_calls("\n".join(rdzv_fix.KNOWN_DELAY_CALLS)) == []


def test_launcher_applies_the_poll_it_is_given() -> None:
    script = textwrap.dedent(
        """
        from slurmft.agent import launcher, rdzv_fix
        print(launcher.prepare_rendezvous(True, False, 0.1),
              rdzv_fix.poll_interval(rdzv_fix.load_module()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "0.1"]
    assert "rendezvous state poll 0.1 s" in done.stderr


def test_the_gate_refuses_the_rendezvous_module_with_one_change(tmp_path: Path) -> None:
    """The fingerprint fixture: this torch's own dynamic_rendezvous.py, loaded from a file with
    one no-op line added at the end of `_RendezvousJoinOp.__call__`. The gate names exactly that
    function, so a torch release that touches it runs without the fix (and without spares)."""
    real = rdzv_fix.load_module()
    source = inspect.getsource(real)
    function = inspect.getsource(real._RendezvousJoinOp.__call__)
    last = function.rstrip("\n").splitlines()[-1]
    indent = last[: len(last) - len(last.lstrip())]
    changed = source.replace(function, function.rstrip("\n") + f"\n{indent}pass\n", 1)
    assert changed != source
    # Outside its package: its relative imports become absolute (no function changes).
    changed = changed.replace("from .", "from torch.distributed.elastic.rendezvous.")
    path = tmp_path / "dynamic_rendezvous_one_change.py"
    path.write_text(changed)
    spec = importlib.util.spec_from_file_location("dynamic_rendezvous_one_change", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (problem,) = rdzv_fix.check_internals(module)
    assert problem.startswith("_RendezvousJoinOp.__call__ changed (source fingerprint ")


def test_the_dead_peer_eviction_gate_knows_this_torch_and_refuses_a_changed_sanitize() -> None:
    """slurmft.agent.peer_detector backdates keep-alives inside `_sanitize`: a torch whose
    `_sanitize` differs runs without the detector (torch's keep-alive alone)."""
    assert peer_detector.check_internals(rdzv_fix.load_module()) == []
    module = copy_of_torch_module()

    class Holder(module._BackendRendezvousStateHolder):  # type: ignore[name-defined,misc]
        def _sanitize(self) -> None:  # what a future torch might do instead
            return None

    module._BackendRendezvousStateHolder = Holder
    (problem,) = peer_detector.check_internals(module)
    assert problem.startswith("_BackendRendezvousStateHolder._sanitize changed")
    del module.DynamicRendezvousHandler
    assert "DynamicRendezvousHandler.next_rendezvous is missing" in peer_detector.check_internals(
        module
    )
