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

from offsetflow.ledger.session import connect

LOCK = "offsetflow:run"


def _key(batch_id: int) -> int:
    """The lock's second key (int4): batch ids 2^31 apart share it, which only makes one
    look alive while the other runs."""
    return int(batch_id) & 0x7FFFFFFF


_HELD = """l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND l.classid = hashtext(%s)::oid AND l.objid = %s::int::oid"""


def run_holders(cur: psycopg2.extensions.cursor, batch_id: int) -> tuple[str, ...]:
    """The sessions holding the run lock of `batch_id`, each as an operator finds it (server
    pid, client, application, connected since): a lock can outlive its run where a pooler
    in transaction mode keeps the session, or a driver hangs after its launcher was killed."""
    cur.execute(f"""SELECT l.pid, a.client_addr, a.application_name,
                           to_char(a.backend_start AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
                      FROM pg_locks l LEFT JOIN pg_stat_activity a USING (pid)
                     WHERE {_HELD} ORDER BY l.pid""", (LOCK, _key(batch_id)))
    return tuple(f"pid {pid} (client {addr or 'local'}, application {app or '?'}, connected "
                 f"{since or '?'} UTC)" for pid, addr, app, since in cur.fetchall())


@contextlib.contextmanager
def hold_run_lock(dsn: str, batch_id: int) -> Iterator[bool]:
    """Hold the run lock of `batch_id` until the block ends (or the process dies); yields
    whether another run of it was alive when this one took it."""
    conn = connect(dsn)
    try:
        conn.autocommit = True  # a session lock, on an idle (not idle-in-transaction) session
        with conn.cursor() as cur:
            others = bool(run_holders(cur, batch_id))
            cur.execute("SELECT pg_advisory_lock_shared(hashtext(%s), %s)",
                        (LOCK, _key(batch_id)))
        yield others
    finally:
        conn.close()
