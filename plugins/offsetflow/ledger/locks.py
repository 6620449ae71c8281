"""How long the commit waits for a lock, and who to name when it waits too long: a driver
that died mid-commit without closing its socket would otherwise hold its row locks until
TCP gives up (hours); the error names the session that blocks, never healthy ones."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import psycopg2
import psycopg2.errors

from offsetflow.errors import CommitLockTimeoutError
from offsetflow.ledger.session import connect

LOCK_TIMEOUT_ENV = "OFFSETFLOW_COMMIT_LOCK_TIMEOUT_S"
DEFAULT_LOCK_TIMEOUT_S = 120.0


def lock_timeout_s() -> float:
    return float(os.environ.get(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT_S))


@contextlib.contextmanager
def lock_errors(dsn: str, batch_id: int, own_pid: int) -> Iterator[None]:
    """Turns a lock wait cut by `lock_timeout` into `CommitLockTimeoutError` naming the
    session that blocks (`own_pid`: the commit's own session, never named)."""
    try:
        yield
    except psycopg2.errors.LockNotAvailable as e:
        raise CommitLockTimeoutError(
            f"batch {batch_id}: the commit waited more than {lock_timeout_s():.0f}s for a "
            f"lock held by {lock_holders(dsn, batch_id, own_pid)}; if that is a run "
            f"that died, its session ends when TCP keepalives notice (about a minute), or end "
            f"it with pg_terminate_backend(pid); then re-run the batch") from e


def lock_holders(dsn: str, batch_id: int, own_pid: int) -> str:
    """The sessions whose transactions hold the row locks this commit waits for: the batch
    row and the pipeline's position rows record their locker's transaction id in `xmax`,
    and only a running transaction holds that id's lock. The commit's own session and
    sessions locking other rows (healthy commits of other batches) are never named."""
    try:
        conn = connect(dsn)
        try:
            with conn, conn.cursor() as cur:
                cur.execute("""WITH lockers AS (
                                 SELECT xmax::text AS xid FROM offsetflow.batches
                                  WHERE batch_id = %(b)s
                                 UNION SELECT p.xmax::text FROM offsetflow.positions p
                                   JOIN offsetflow.batches b ON b.pipeline = p.pipeline
                                  WHERE b.batch_id = %(b)s)
                               SELECT DISTINCT a.pid, a.application_name, a.client_addr,
                                      a.state, round(extract(epoch FROM now() - a.xact_start))
                                 FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                                 JOIN lockers k ON k.xid = l.transactionid::text
                                WHERE l.locktype = 'transactionid' AND l.granted
                                  AND l.mode = 'ExclusiveLock' AND k.xid <> '0'
                                  AND a.pid NOT IN (%(own)s, pg_backend_pid())
                                ORDER BY a.pid""",
                            {"b": batch_id, "own": own_pid})
                rows = cur.fetchall()
        finally:
            conn.close()
    except psycopg2.Error as e:
        return f"another session (could not list it: {e})"
    if not rows:
        return ("another session (not identified: gone by now, or it holds a lock on the "
                "target table's rows)")
    return "; ".join(f"pid {pid} ({app or 'no application_name'} from {addr or 'local'}, "
                     f"{state}, transaction open {age}s)" for pid, app, addr, state, age in rows)
