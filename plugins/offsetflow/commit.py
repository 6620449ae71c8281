"""The commit protocol: step 3 of the lifecycle, one PostgreSQL transaction, in this order:
  1. lock the batch row; already committed -> no-op, say so; abandoned -> refuse;
  2. check that every part the job produced is staged (no partial stage commits);
  3. fence: advance each partition's position only if it still equals the range's
     `from_offset` (a missing position counts only for a partition seen for the first
     time); any mismatch rolls everything back with FencedCommitError;
  4. move staged rows into the target (append, or upsert on the key), and dead letters
     into the dead-letter table; in append mode `PartwiseCommit` runs this step part by
     part in the same transaction while the batch is still being read;
  5. record per-range counts, position history, and mark the batch committed;
  6. drop the stage tables; COMMIT. Any failure before COMMIT leaves nothing visible.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psycopg2
import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from offsetflow.errors import BatchStateError, FencedCommitError, StagingIncompleteError
from offsetflow.ledger import (
    Batch,
    Ledger,
    dead_letter_stage_table,
    qualified,
    stage_part_table,
    stage_table,
)
from offsetflow.tables import DEAD_LETTER_COLUMNS, LINEAGE_COLUMN

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitResult:
    batch_id: int
    status: str  # committed | already_committed
    rows_written: int
    bad_records: int
    records_per_range: dict[str, int]

    @property
    def message(self) -> str:
        if self.status == "already_committed":
            return f"batch {self.batch_id} was already committed; nothing to do"
        return (f"batch {self.batch_id} committed: {self.rows_written} rows, "
                f"{self.bad_records} dead letters")



@dataclass
class MovedRows:
    """Rows a `PartwiseCommit` moved into the target earlier in the commit's transaction."""

    rows: int = 0
    per_range: dict[str, int] = field(default_factory=dict)


def commit_batch(ledger: Ledger, batch_id: int, *, expected_parts: int, columns: Sequence[str],
                 mode: str, key: Sequence[str], dead_letter_table: str | None,
                 timings: dict[str, float] | None = None,
                 stage_changed: bool = True) -> CommitResult:
    """Step 3 of the lifecycle; see the module docstring for the numbered steps.

    `stage_changed=False` says no row left the stage since it was staged (no quality
    routing), so per-range counts come from the stage markers instead of a scan."""
    with ledger.transaction() as cur:
        return _commit(cur, ledger, batch_id, expected_parts=expected_parts, columns=columns,
                       mode=mode, key=key, dead_letter_table=dead_letter_table,
                       timings=timings, moved=None, stage_changed=stage_changed)


def _commit(cur: psycopg2.extensions.cursor, ledger: Ledger, batch_id: int, *,
            expected_parts: int, columns: Sequence[str], mode: str, key: Sequence[str],
            dead_letter_table: str | None, timings: dict[str, float] | None,
            moved: MovedRows | None, stage_changed: bool) -> CommitResult:
    """Steps 1-6 in the caller's transaction. With `moved`, step 4's rows are already in
    the target (moved part by part, in this same transaction) and are only checked."""
    batch = ledger.get_batch(batch_id, cur, for_update=True)  # 1
    if batch.status == "committed":
        log.info("batch %d is already committed; this commit changes nothing", batch_id)
        return CommitResult(batch_id, "already_committed", batch.rows_written or 0,
                            batch.bad_records or 0, {})
    if batch.status == "abandoned":
        raise BatchStateError(f"batch {batch_id} was abandoned; refusing to commit it")
    cur.execute("""SELECT count(*), COALESCE(sum(rows_staged), 0)
                     FROM offsetflow.staged_parts WHERE batch_id = %s AND kind = 'rows'""",
                (batch_id,))
    row = cur.fetchone()
    assert row is not None
    parts, staged_rows = int(row[0]), int(row[1])
    if parts != expected_parts:  # 2
        raise StagingIncompleteError(
            f"batch {batch_id}: {parts} of {expected_parts} parts are staged; not committing")
    if moved is not None and moved.rows != staged_rows:
        raise StagingIncompleteError(
            f"batch {batch_id}: the stage markers count {staged_rows} rows but "
            f"{moved.rows} were found in the stage tables; not committing")
    if batch.moves_positions:  # 3
        _fence_and_advance(cur, batch)
    t_insert = time.monotonic()
    if moved is None:  # 4
        if batch.kind in ("replay", "backfill"):
            _delete_range_rows(cur, batch, dead_letter_table)
        rows_written = _insert_stage(cur, batch, columns, mode, key)
    else:
        rows_written = moved.rows
    bad = 0
    if dead_letter_table:
        dl_cols = sql.SQL(", ").join(sql.Identifier(c) for c, _ in DEAD_LETTER_COLUMNS)
        cur.execute(sql.SQL("INSERT INTO {dl} ({cols}, {lin}) SELECT {cols}, %s FROM {st}")
                    .format(dl=qualified(dead_letter_table), cols=dl_cols,
                            lin=sql.Identifier(LINEAGE_COLUMN),
                            st=dead_letter_stage_table(batch_id)), (batch_id,))
        bad = cur.rowcount
    if timings is not None:
        timings["commit_insert_s"] = round(
            timings.get("commit_insert_s", 0.0) + time.monotonic() - t_insert, 3)
    if moved is not None:
        per_range = dict(moved.per_range)
    elif stage_changed:
        cur.execute(sql.SQL("SELECT topic, partition, count(*) FROM {} GROUP BY 1, 2").format(
            stage_table(batch_id)))
        per_range = {f"{t}/{p}": int(n) for t, p, n in cur.fetchall()}
    else:
        per_range = _staged_per_range(cur, batch_id)
    for r in batch.ranges:  # 5
        cur.execute("""UPDATE offsetflow.batch_ranges SET records = %s
                        WHERE batch_id = %s AND topic = %s AND partition = %s""",
                    (per_range.get(f"{r.topic}/{r.partition}", 0), batch_id, r.topic,
                     r.partition))
    cur.execute("""UPDATE offsetflow.batches
                      SET status = 'committed', finished_at = now(), records_read = %s,
                          rows_written = %s, bad_records = %s, error = NULL,
                          timings = %s
                    WHERE batch_id = %s""",
                (staged_rows + bad, rows_written, bad, json.dumps(timings or {}), batch_id))
    ledger._drop_staging(cur, batch_id)  # 6
    log.info("batch %d committed: %d rows into %s, %d dead letters", batch_id, rows_written,
             batch.target_table, bad)
    return CommitResult(batch_id, "committed", rows_written, bad, per_range)


def _insert_stage(cur: psycopg2.extensions.cursor, batch: Batch, columns: Sequence[str],
                  mode: str, key: Sequence[str]) -> int:
    target = qualified(batch.target_table)
    collist = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    if mode == "upsert":
        order = sql.SQL(", ").join(sql.Identifier(k) for k in key)
        updates = sql.SQL(", ").join(
            sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c))
            for c in [*columns, LINEAGE_COLUMN] if c not in key)
        cur.execute(sql.SQL(
            "INSERT INTO {t} ({cols}, {lin}) "
            "SELECT DISTINCT ON ({key}) {cols}, %s FROM {stage} "
            "ORDER BY {key}, \"timestamp\" DESC NULLS LAST, \"offset\" DESC "
            "ON CONFLICT ({key}) DO UPDATE SET {updates}").format(
                t=target, cols=collist, lin=sql.Identifier(LINEAGE_COLUMN), key=order,
                stage=stage_table(batch.batch_id), updates=updates), (batch.batch_id,))
    else:
        _append_from(cur, batch, columns, stage_table(batch.batch_id))
    return int(cur.rowcount)


def _append_from(cur: psycopg2.extensions.cursor, batch: Batch, columns: Sequence[str],
                 source: sql.Composable) -> int:
    collist = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    cur.execute(sql.SQL("INSERT INTO {t} ({cols}, {lin}) SELECT {cols}, %s FROM {src}")
                .format(t=qualified(batch.target_table), cols=collist,
                        lin=sql.Identifier(LINEAGE_COLUMN), src=source), (batch.batch_id,))
    return int(cur.rowcount)


def _staged_per_range(cur: psycopg2.extensions.cursor, batch_id: int) -> dict[str, int]:
    """Rows per topic/partition as the tasks counted them when staging."""
    cur.execute("""SELECT per_partition FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows'""", (batch_id,))
    per_range: dict[str, int] = {}
    for (per_tp,) in cur.fetchall():
        for tp, (n, _lo, _hi) in (per_tp or {}).items():
            per_range[tp] = per_range.get(tp, 0) + int(n)
    return per_range


class _Aborted(Exception):
    """The run failed before the commit could finish; roll the moved parts back."""


class PartwiseCommit:
    """An append-mode commit that starts while the batch is still being read.

    The commit's single INSERT of the whole stage is serial in one PostgreSQL backend (one
    core busy, the rest idle while the driver waits). Here the same transaction moves each
    part into the target as soon as its task has staged it, while later parts are still
    read, so only the last parts are left for the end. One transaction, on a connection of
    its own, in this order:
      a. replay/backfill: delete what the ranges produced before (the start of step 4);
      b. while tasks run: each part whose stage marker is visible is moved from its part
         table into the target (step 4, part by part). A marker commits with its task's
         COPY, so a failed task attempt moves nothing and a retried part is moved once;
      c. `finish()`: the parts left and any rows staged into the stage table itself, then
         steps 1-3 and 5-6 of `commit_batch`, the moved rows checked against the markers;
         COMMIT. `abort()` (or any error) rolls back everything, moved parts included.
    Append only: an upsert keeps the latest record per key across the whole batch, so it
    waits for all parts; a quality gate checks the whole stage before anything moves.
    """

    POLL_S = 0.05

    def __init__(self, dsn: str, batch: Batch, *, columns: Sequence[str], parts: int,
                 dead_letter_table: str | None, timings: dict[str, float]) -> None:
        self.dsn = dsn
        self.batch = batch
        self.columns = list(columns)
        self.parts = parts
        self.dead_letter_table = dead_letter_table
        self.timings = timings
        self._moved_parts: set[int] = set()
        self._finish = threading.Event()
        self._aborted = False
        self._expected_parts = 0
        self._result: CommitResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"offsetflow-commit-b{batch.batch_id}")

    def __enter__(self) -> PartwiseCommit:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._thread.is_alive():
            self.abort()
        if exc_type is not None and self._error is not None:
            log.warning("batch %d: the commit had failed too: %s: %s", self.batch.batch_id,
                        type(self._error).__name__, str(self._error)[:500])

    def abort(self) -> None:
        self._aborted = True
        self._finish.set()
        self._thread.join()

    def finish(self, expected_parts: int) -> CommitResult:
        self._expected_parts = expected_parts
        self._finish.set()
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None  # shown once, by the caller
            raise error
        assert self._result is not None
        return self._result

    def _run(self) -> None:
        try:
            with Ledger(self.dsn) as ledger, ledger.transaction() as cur:
                # step 1's lock, taken first: a second run of the batch waits for this one
                # here (or at mark_running) instead of racing it part by part
                batch = ledger.get_batch(self.batch.batch_id, cur, for_update=True)
                moving = batch.is_open
                if moving and self.batch.kind in ("replay", "backfill"):  # a
                    _delete_range_rows(cur, self.batch, self.dead_letter_table)
                moved = MovedRows()
                while not self._finish.is_set():  # b
                    if moving:
                        self._move_staged_parts(cur, moved, "commit_overlapped_s")
                    self._finish.wait(self.POLL_S)
                if self._aborted:
                    raise _Aborted
                # c: finish() comes after the last task committed, so this pass sees all
                t = time.monotonic()
                if moving:
                    self._move_staged_parts(cur, moved, "commit_insert_s")
                    moved.rows += _append_from(cur, self.batch, self.columns, sql.SQL(
                        "ONLY {}").format(stage_table(self.batch.batch_id)))
                self.timings["commit_insert_s"] = round(time.monotonic() - t, 3)
                self._result = _commit(
                    cur, ledger, self.batch.batch_id, expected_parts=self._expected_parts,
                    columns=self.columns, mode="append", key=(),
                    dead_letter_table=self.dead_letter_table, timings=self.timings,
                    moved=moved, stage_changed=False)
        except _Aborted:
            log.info("batch %d: commit aborted; the parts moved so far are rolled back",
                     self.batch.batch_id)
        except psycopg2.errors.UniqueViolation as e:
            self._error = self._fenced_or(e)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by finish()
            self._error = e

    def _fenced_or(self, e: psycopg2.errors.UniqueViolation) -> BaseException:
        """A part's rows already in the target: if positions moved meanwhile, another run
        committed these ranges first and this one is fenced; else the rows came from
        elsewhere, and the unique violation is the error to show."""
        try:
            with Ledger(self.dsn) as ledger, ledger.transaction() as cur:
                check_fence(cur, self.batch)
        except FencedCommitError as fenced:
            fenced.__cause__ = e
            return fenced
        except psycopg2.Error:
            pass
        return e

    def _move_staged_parts(self, cur: psycopg2.extensions.cursor, moved: MovedRows,
                           timing: str) -> None:
        cur.execute("""SELECT part, per_partition FROM offsetflow.staged_parts
                        WHERE batch_id = %s AND kind = 'rows' AND NOT (part = ANY(%s))
                        ORDER BY part""", (self.batch.batch_id, sorted(self._moved_parts)))
        for part, per_tp in cur.fetchall():
            t = time.monotonic()
            if part < self.parts:  # else an earlier attempt staged it into the stage table
                moved.rows += _append_from(cur, self.batch, self.columns, sql.SQL("ONLY {}")
                                           .format(stage_part_table(self.batch.batch_id, part)))
            for tp, (n, _lo, _hi) in (per_tp or {}).items():
                moved.per_range[tp] = moved.per_range.get(tp, 0) + int(n)
            self._moved_parts.add(part)
            self.timings[timing] = round(self.timings.get(timing, 0.0) + time.monotonic() - t,
                                         3)


def _expected_positions(cur: psycopg2.extensions.cursor, batch: Batch
                        ) -> dict[tuple[str, int], tuple[int, int | None]]:
    """Per range: the committed position the batch was planned from (the range's
    `from_offset`, or the older position a `data_loss: continue` gap skipped) and the
    position found now (None: the partition has none yet)."""
    cur.execute("""SELECT br.topic, br.partition,
                          COALESCE(br.expected_position, br.from_offset), p.next_offset
                     FROM offsetflow.batch_ranges br
                     LEFT JOIN offsetflow.positions p
                       ON p.pipeline = %s AND p.topic = br.topic AND p.partition = br.partition
                    WHERE br.batch_id = %s""", (batch.pipeline, batch.batch_id))
    return {(t, int(p)): (int(exp), None if found is None else int(found))
            for t, p, exp, found in cur.fetchall()}


def check_fence(cur: psycopg2.extensions.cursor, batch: Batch) -> None:
    """Step 3's test without its lock or update: a batch planned from positions that have
    moved since (a zombie, or a run that lost a race) is refused before it reads anything
    or writes a row. Step 3 itself still decides at commit time."""
    if not batch.moves_positions:
        return
    expected = _expected_positions(cur, batch)
    for r in batch.ranges:
        exp, found = expected.get(r.topic_partition, (r.from_offset, None))
        if found is not None and found != exp:
            raise FencedCommitError(batch.batch_id, r.topic, r.partition, exp, found,
                                    open_scheduled=batch.kind == "scheduled")


def _fence_and_advance(cur: psycopg2.extensions.cursor, batch: Batch) -> None:
    """Move each position from the value the batch expects (`batch_ranges.expected_position`,
    else `from_offset`) to the range's `until_offset`, or refuse the whole commit."""
    expected = _expected_positions(cur, batch)
    for r in batch.ranges:
        exp, _ = expected.get(r.topic_partition, (r.from_offset, None))
        cur.execute("""UPDATE offsetflow.positions p
                          SET next_offset = %s, batch_id = %s, updated_at = now(),
                              topic_id = COALESCE(br.topic_id, p.topic_id)
                         FROM offsetflow.batch_ranges br
                        WHERE br.batch_id = %s AND br.topic = p.topic
                          AND br.partition = p.partition
                          AND p.pipeline = %s AND p.topic = %s AND p.partition = %s
                          AND p.next_offset = %s""",
                    (r.until_offset, batch.batch_id, batch.batch_id, batch.pipeline, r.topic,
                     r.partition, exp))
        if cur.rowcount == 0:
            cur.execute("""SELECT next_offset FROM offsetflow.positions
                            WHERE pipeline = %s AND topic = %s AND partition = %s""",
                        (batch.pipeline, r.topic, r.partition))
            found = cur.fetchone()
            if found is not None:
                raise FencedCommitError(batch.batch_id, r.topic, r.partition, exp,
                                        int(found[0]), open_scheduled=batch.kind == "scheduled")
            # first batch of this partition: the position row is created here, once
            cur.execute("""INSERT INTO offsetflow.positions
                             (pipeline, topic, partition, next_offset, batch_id, topic_id)
                           SELECT %s, %s, %s, %s, %s, topic_id FROM offsetflow.batch_ranges
                            WHERE batch_id = %s AND topic = %s AND partition = %s
                           ON CONFLICT DO NOTHING""",
                        (batch.pipeline, r.topic, r.partition, r.until_offset, batch.batch_id,
                         batch.batch_id, r.topic, r.partition))
            if cur.rowcount == 0:
                raise FencedCommitError(batch.batch_id, r.topic, r.partition, r.from_offset,
                                        None)
            old = None
        else:
            old = exp
        reason = "commit" if exp == r.from_offset else (
            f"commit; offsets [{exp}, {r.from_offset}) were gone from Kafka (data_loss: "
            f"continue)")
        cur.execute("""INSERT INTO offsetflow.position_history
                         (pipeline, topic, partition, old_offset, new_offset, batch_id, reason)
                       VALUES (%s, %s, %s, %s, %s, %s, %s)""",
                    (batch.pipeline, r.topic, r.partition, old, r.until_offset, batch.batch_id,
                     reason))


def _delete_range_rows(cur: psycopg2.extensions.cursor, batch: Batch,
                       dead_letter_table: str | None) -> None:
    """Replay/backfill: what the ranges produced before is replaced, not duplicated."""
    for r in batch.ranges:
        cur.execute(sql.SQL("DELETE FROM {} WHERE topic = %s AND partition = %s "
                            "AND \"offset\" >= %s AND \"offset\" < %s").format(
                                qualified(batch.target_table)),
                    (r.topic, r.partition, r.from_offset, r.until_offset))
        if dead_letter_table:
            cur.execute(sql.SQL("DELETE FROM {} WHERE pipeline = %s AND topic = %s "
                                "AND partition = %s AND \"offset\" >= %s "
                                "AND \"offset\" < %s").format(qualified(dead_letter_table)),
                        (batch.pipeline, r.topic, r.partition, r.from_offset, r.until_offset))

