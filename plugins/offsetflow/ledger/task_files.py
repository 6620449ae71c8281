"""The task files a batch's part markers name (a Kafka sink's, issue 32:
`offsetflow.sinks.kafka.taskfile`), dropped wherever the markers are: abandon, cleanup,
a config change, the commit's stage drop, a part dropped for re-staging. Here in the
ledger, not in the sink, because every one of those drops is the ledger's or the stage's,
and the marker is what says where the files are (the driver's switch may be off by then).

A marker's entry names one attempt's file (`path`, `attempt`): exactly that file (and its
attempt's temporary name) is dropped, never the part's other attempts. The unlink runs after
the COMMIT, outside the batch lock, so a newer run may meanwhile have written the part again
under a new attempt: a pattern over the part's attempts would delete that run's file (its
read then fails as a lost part). An entry without `attempt` and `crc32` is not a task file
(an Iceberg data file: never touched). Files no marker names (other attempts of a part, a
killed task's) are dropped by the batch's commit (`KafkaPipelineSink.after_commit`) or the
driver's sweep of committed and abandoned batches (`sweep_task_files`), not here.

The files are unlinked only once the ledger transaction that deletes their markers has
committed (`drop_committed_task_files`, called after the COMMIT): a drop that rolls back
keeps markers and files together. Each drop is remembered with the connection and the
transaction's id, and unlinked only when PostgreSQL says that transaction committed.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extensions

from offsetflow.errors import LedgerIdentityError
from offsetflow.ledger.batch import OPEN_STATUSES
from offsetflow.ledger.identity import ledger_identity

log = logging.getLogger(__name__)


# per connection: (transaction id, batch, a named file) of drops not yet unlinked
_PENDING: weakref.WeakKeyDictionary[psycopg2.extensions.connection,
                                    list[tuple[int, int, Path, str]]] = \
    weakref.WeakKeyDictionary()


def task_file_entries(cur: psycopg2.extensions.cursor, batch_id: int,
                      parts: Sequence[int] | None = None) -> dict[int, list[dict[str, Any]]]:
    """The task-file entries (`offsetflow.sinks.kafka.taskfile.PartFile.close`'s: path,
    attempt, records, bytes, CRC-32, ...) the markers of the batch's parts (None: all)
    name, by part; an entry without `crc32` is not a task file (an Iceberg data file)."""
    cur.execute("""SELECT part, data_files FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows' AND data_files IS NOT NULL
                      AND (%s::int[] IS NULL OR part = ANY(%s::int[]))""",
                (batch_id, None if parts is None else list(parts),
                 None if parts is None else list(parts)))
    found: dict[int, list[dict[str, Any]]] = {}
    for part, entries in cur.fetchall():
        named = [e for e in entries or [] if isinstance(e, dict) and "crc32" in e]
        if named:
            found[int(part)] = named
    return found


def drop_named_task_files(cur: psycopg2.extensions.cursor, batch_id: int,
                          parts: list[int] | None = None) -> int:
    """Drop the task file each marker of the parts (None: all) names, exactly that one,
    once this transaction commits (`drop_committed_task_files`); how many named. Best
    effort (the markers go regardless): a file left is logged, never a failure of the
    drop, and a later drop or the commit's sweep takes it."""
    named = [(Path(str(e["path"])), str(e["attempt"]))
             for entries in task_file_entries(cur, batch_id, parts).values()
             for e in entries if e.get("attempt")]
    if not named:
        return 0
    cur.execute("SELECT txid_current()")
    row = cur.fetchone()
    assert row is not None
    _PENDING.setdefault(cur.connection, []).extend(
        (int(row[0]), batch_id, path, attempt) for path, attempt in named)
    return len(named)


def drop_committed_task_files(conn: psycopg2.extensions.connection) -> int:
    """Unlink the files of `conn`'s drops whose transaction committed (call after the
    COMMIT); forget those of a transaction that rolled back; how many unlinked."""
    pending = _PENDING.pop(conn, [])
    if not pending or conn.closed:
        return 0
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT x, txid_status(x) FROM unnest(%s::bigint[]) AS x",
                        (sorted({p[0] for p in pending}),))
            status = {int(x): s for x, s in cur.fetchall()}
        conn.rollback()  # nothing to keep: a read only
    except psycopg2.Error as err:
        log.warning("task files of dropped markers left (their transaction's state "
                    "unknown: %s)", err)
        return 0
    n = 0
    for xid, batch_id, path, attempt in pending:
        if status.get(xid) == "in progress":
            _PENDING.setdefault(conn, []).append((xid, batch_id, path, attempt))
        if status.get(xid) != "committed":
            continue
        # exactly the named attempt's file (and its temporary name): not a pattern over the
        # part's attempts, which would take a newer run's file written since the COMMIT
        for f in (path, path.with_name(path.name + ".tmp")):
            try:
                if f.exists():
                    f.unlink(missing_ok=True)
                    n += 1
            except OSError as err:
                log.warning("batch %d: task file %s of attempt %s was not dropped: %s",
                            batch_id, f, attempt, err)
    return n


def ledger_files_glob(installation_id: str) -> str:
    """The pattern of every task file name of one ledger (`taskfile.file_name`:
    `<installation id>_b<batch>_p<part>_<attempt>.arrow`, `.tmp` appended while written)."""
    return f"{installation_id}_b*_p*_*.arrow*"


def sweep_task_files(cur: psycopg2.extensions.cursor, directory: str) -> list[Path]:
    """Unlink every task file in `directory` of this ledger (its installation id starts the
    name) whose batch is committed or abandoned (for good: neither is ever read or run
    again). These are files no marker names any more: a killed task's attempt, files left
    by a driver that died between the ledger's COMMIT and their unlink (or lost the
    COMMIT's outcome, and its pending drops with it), an `after_commit` that never ran, a
    drop whose PostgreSQL crashed, the setting changed meanwhile. Run by the driver at the
    start of each run with task files (`KafkaPipelineSink.task_files`) and by `offsetflow
    cleanup --task-files DIR`: one directory listing and one query. Returns the files
    removed.

    A file of a batch id this ledger never had (batches are never deleted) is another
    ledger's under the same installation id: a copy of this ledger given its identity
    (`offsetflow db adopt-identity` while the original still runs) shares the directory,
    and its open batches may be committed here. Then nothing is removed: a
    `LedgerIdentityError` names the batch ids and the way out."""
    ident = ledger_identity(cur)
    prefix = f"{ident.installation_id}_b"
    found: dict[int, list[Path]] = {}
    for f in Path(directory).glob(ledger_files_glob(ident.installation_id)):
        digits = f.name[len(prefix):].split("_", 1)[0]
        # ASCII digits only (the names `file_name` writes): str.isdigit also takes '²',
        # which int() refuses (the sweep would fail on a stray file), and '٣' (read as 3)
        if digits.isascii() and digits.isdecimal():
            found.setdefault(int(digits), []).append(f)
    if not found:
        return []
    cur.execute("SELECT batch_id, status FROM offsetflow.batches WHERE batch_id = ANY(%s)",
                (sorted(found),))
    status = {int(b): str(s) for b, s in cur.fetchall()}
    unknown = sorted(set(found) - set(status))
    if unknown:
        raise LedgerIdentityError(
            f"task files in {directory} carry this ledger's installation id "
            f"{ident.installation_id} but batch ids {unknown[:10]} this ledger never had: "
            f"another ledger with the same identity (a copy given it with offsetflow db "
            f"adopt-identity while this one still runs) writes there, and its open batches "
            f"may be closed here, so no task file was removed. Give the copy its own "
            f"identity (offsetflow --dsn <the copy> db new-identity) or its own "
            f"sink.task_files directory. If instead this ledger was restored from a backup "
            f"older than those files (the original is gone), remove the files of those "
            f"batch ids by hand ({ident.installation_id}_b<id>_*)")
    removed = []
    for batch_id, files in sorted(found.items()):
        if status[batch_id] in OPEN_STATUSES:
            continue
        for f in files:
            try:
                f.unlink(missing_ok=True)
                removed.append(f)
            except OSError as err:
                log.warning("batch %d: task file %s was not removed: %s", batch_id, f, err)
    return removed
