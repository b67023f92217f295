#!/usr/bin/env python3
"""Ingest throughput of the store, in the batch shape the daemon uses.

Each batch is one agent-report transaction for a whole run: the newest heartbeat of every rank
(an upsert, plus a history sample when one is due) and the step times of every rank for the steps
since the last report. Prints rows/s per backend; the last line is

    ingest sqlite_rows_per_s=N postgres_rows_per_s=M

PostgreSQL: --postgres-url, else $SLURMFT_TEST_POSTGRES_URL, else a throwaway server is started
with scripts/postgres-throwaway (and stopped afterwards).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import create_engine, make_url, text

from slurmft.db import Database
from slurmft.db.ingest import HeartbeatReport, StepTimeReport, record_heartbeats, record_step_times
from slurmft.db.models import Run

REPO = Path(__file__).resolve().parents[2]


def bench(database: Database, *, ranks: int, steps_per_batch: int, batches: int) -> float:
    database.upgrade()
    with database.session() as s:
        s.add(Run(id="rbench", name="bench", owner_uid=0, owner_name="bench", nodes=ranks // 8,
                  command=["train.py"]))
    start_at = datetime(2026, 11, 1, tzinfo=UTC)
    rows = 0
    elapsed = 0.0
    for batch in range(batches):
        now = start_at + timedelta(seconds=batch * steps_per_batch)
        beats = [HeartbeatReport(rank=r, node=f"node{r // 8:04d}", phase="step",
                                 step=(batch + 1) * steps_per_batch, seq=batch + 1, sent_at=now)
                 for r in range(ranks)]
        steps = [StepTimeReport(rank=r, step=batch * steps_per_batch + k, compute_s=0.8 + r * 1e-5,
                                wait_s=0.2, ended_at=now + timedelta(seconds=k))
                 for k in range(steps_per_batch) for r in range(ranks)]
        began = time.perf_counter()
        with database.session() as s:
            sampled = record_heartbeats(s, "rbench", None, beats,
                                        sample_every=timedelta(seconds=60))
            written = record_step_times(s, "rbench", None, steps)
        elapsed += time.perf_counter() - began
        rows += len(beats) + sampled + written
    return rows / elapsed


@contextmanager
def postgres_server(url: str | None, durable: bool = False):
    """``url``, else a throwaway server's (durable: fsync and synchronous commit on)."""
    if url:
        yield url
        return
    pg_dir = Path(tempfile.mkdtemp(prefix="slurmft-bench-pg-"))
    env = {**os.environ, "SLURMFT_PG_PORT": "55433", "SLURMFT_PG_DURABLE": "1" if durable else "0"}
    script = REPO / "scripts" / "postgres-throwaway"
    out = subprocess.run([str(script), "up", str(pg_dir)], check=True, capture_output=True,
                         text=True, env=env).stdout
    try:
        yield out.strip().split("=", 1)[1]
    finally:
        subprocess.run([str(script), "down", str(pg_dir)], check=False, env=env)


@contextmanager
def fresh_postgres_database(server_url: str):
    server = make_url(server_url).set(drivername="postgresql+psycopg")
    name = f"bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps-per-batch", type=int, default=10)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--postgres-url", default=os.environ.get("SLURMFT_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    shape = dict(ranks=args.ranks, steps_per_batch=args.steps_per_batch, batches=args.batches)
    print(f"batch shape: {args.ranks} heartbeats + {args.ranks} x {args.steps_per_batch} step "
          f"times per transaction, {args.batches} batches", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        database = Database(f"sqlite:///{tmp}/bench.db")
        sqlite_rate = bench(database, **shape)
        database.dispose()
    print(f"sqlite: {sqlite_rate:,.0f} rows/s")

    with postgres_server(args.postgres_url) as server, fresh_postgres_database(server) as url:
        database = Database(url)
        postgres_rate = bench(database, **shape)
        database.dispose()
    print(f"postgres: {postgres_rate:,.0f} rows/s")
    print(f"ingest sqlite_rows_per_s={sqlite_rate:.0f} postgres_rows_per_s={postgres_rate:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
