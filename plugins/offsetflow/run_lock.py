"""Is a run of an open batch alive? A driver killed with kill -9 (or by the OOM killer) leaves
its batch `running` in the ledger with no `finished_at`: nothing marks it failed. Each run
holds a session-level shared advisory lock on its batch for as long as it works on it, on a
connection of its own: PostgreSQL releases it the moment that connection goes (a killed
process's socket is closed by its kernel; a dead host's within about a minute, by the
session's TCP keepalives). Whoever asks reads `pg_locks` and takes nothing.

It is a liveness hint for the event-driven watcher only, never a fence: two runs of one
batch at once stay safe by the commit's fencing (a manual retry, Airflow's retry of a task
it lost track of), so a second run is not refused; the lock is shared so that the batch
counts as alive while any of its runs is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg2.extensions

from offsetflow.ledger import connect

LOCK = "offsetflow:run"


def _key(batch_id: int) -> int:
    """The lock's second key (int4): batch ids 2^31 apart share it, which only makes one
    look alive while the other runs."""
    return int(batch_id) & 0x7FFFFFFF


def run_alive(cur: psycopg2.extensions.cursor, batch_id: int) -> bool:
    """Whether some session of this database holds the run lock of `batch_id`."""
    cur.execute("""SELECT EXISTS (
                     SELECT 1 FROM pg_locks
                      WHERE locktype = 'advisory' AND granted AND objsubid = 2
                        AND database = (SELECT oid FROM pg_database
                                         WHERE datname = current_database())
                        AND classid = hashtext(%s)::oid AND objid = %s::int::oid)""",
                (LOCK, _key(batch_id)))
    row = cur.fetchone()
    return bool(row and row[0])


@contextlib.contextmanager
def hold_run_lock(dsn: str, batch_id: int) -> Iterator[bool]:
    """Hold the run lock of `batch_id` until the block ends (or the process dies); yields
    whether another run of it was alive when this one took it."""
    conn = connect(dsn)
    try:
        conn.autocommit = True  # a session lock, on an idle (not idle-in-transaction) session
        with conn.cursor() as cur:
            others = run_alive(cur, batch_id)
            cur.execute("SELECT pg_advisory_lock_shared(hashtext(%s), %s)",
                        (LOCK, _key(batch_id)))
        yield others
    finally:
        conn.close()
