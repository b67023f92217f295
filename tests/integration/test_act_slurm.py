"""The executor's drain on the real local Slurm cluster: as root (SlurmUser here), and as an
unprivileged user, which must end as a recorded "drain requested", not a failure."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from slurmft.controller import views as v
from slurmft.controller.act import Executor
from slurmft.db import Database
from slurmft.db.models import ActionStatus, EventKind, Run
from slurmft.db.records import record_event
from slurmft.slurm import CliSlurmClient
from slurmft.slurm.runner import CommandResult, SubprocessRunner

pytestmark = pytest.mark.slurm
NODE = "n6"
RUN = "r1"
REASON = "slurmft: Xid 79 GPU has fallen off the bus (GPU 3)"


class AsUser(SubprocessRunner):
    """Runs the Slurm commands as another (unprivileged) user."""

    def __init__(self, user: str) -> None:
        super().__init__({"SLURM_CONF": os.environ.get("SLURM_CONF", "")})
        self._user = user

    def run(
        self, argv: Sequence[str], timeout: float, *, stdin: str | None = None
    ) -> CommandResult:
        return super().run(["runuser", "-u", self._user, "--", *argv], timeout, stdin=stdin)


@pytest.fixture
def slurm() -> Iterator[CliSlurmClient]:
    client = CliSlurmClient(slurm_conf=os.environ["SLURM_CONF"])
    try:
        yield client
    finally:
        if client.node(NODE).status.drain_requested:
            client.resume(NODE)


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    """A store with run r1, whose own (not foreign) evidence names NODE: the only ground on
    which the daemon drains a node for everyone."""
    database = Database(f"sqlite:///{tmp_path}/slurmft.db")
    database.upgrade()
    with database.session() as s:
        s.add(Run(id=RUN, name=RUN, owner_uid=0, owner_name="root", nodes=1, command=["x"]))
        s.flush()
        record_event(
            s, EventKind.GPU_FAULT, REASON, run_id=RUN, node=NODE, xid=79, source="agent",
            foreign=False,
        )  # fmt: skip
    yield database
    database.dispose()


def test_drain_reaches_slurm_with_its_reason(slurm: CliSlurmClient, sqlite_db: Database) -> None:
    (outcome,) = Executor(sqlite_db, slurm).execute([v.DrainNode(RUN, REASON, node=NODE)])
    assert outcome.status is ActionStatus.DONE
    node = slurm.node(NODE)
    assert node.reason == REASON
    assert node.status.drain_requested


def test_drain_without_privilege_becomes_drain_requested(
    slurm: CliSlurmClient, sqlite_db: Database
) -> None:
    unprivileged = CliSlurmClient(AsUser("nobody"))
    (outcome,) = Executor(sqlite_db, unprivileged).execute([v.DrainNode(RUN, REASON, node=NODE)])
    assert outcome.status is ActionStatus.SKIPPED
    assert outcome.error is not None and outcome.error.startswith("drain requested")
    assert slurm.node(NODE).reason != REASON  # nothing changed in Slurm
