"""The one rule for which run a caller may see: their own, or any run for an admin. A run that
exists but belongs to someone else gets the same answer as one that does not exist."""

from __future__ import annotations

from sqlalchemy.orm import Session

from slurmft.controller.admins import Admins
from slurmft.controller.rpc import RpcError
from slurmft.db.models import Run


def visible_run(session: Session, uid: int, run_id: object, admins: Admins) -> Run:
    if not isinstance(run_id, str):
        raise RpcError("a run id is required")
    run = session.get(Run, run_id)
    if run is None or (uid != run.owner_uid and uid not in admins):
        raise RpcError(f"no run {run_id} visible to you (see `slurmft runs`)")
    return run
