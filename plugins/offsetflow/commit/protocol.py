"""The commit protocol: step 3 of the lifecycle, one PostgreSQL transaction. `commit_steps`
calls one function per step, in this order: the one sequence of every commit. How step 4
moves the stage is its `Step4`: `commit_batch` moves the whole stage at once after the
checks (`WholeStage`); `offsetflow.commit.partwise.PartwiseCommit` moves it part by part
while the batch is still being read (its hooks say what it does between the steps, and why):
  1. `lock_batch`: lock the batch row, waiting at most `lock_timeout_s` (else
     `CommitLockTimeoutError` naming the holder); already committed -> no-op, say so;
     abandoned, or its config changed since this run took it up (`check_config`) -> refuse;
     under `format.schema_evolution: add_columns`, the evolved columns the target lacks
     are added (or widened) here (`evolve_target`), so they commit with the rows and
     positions or not at all;
  2. `lock_stage` (`WholeStage`; `PartwiseCommit` moves parts as they come instead, see
     there): the stage in SHARE mode, so no late writer (a zombie task) adds rows after
     the checks that step 4 would read; `check_layout`: every marker is of the
     batch's current stage layout (its generation, and on the fused path offsets of its
     part's sub-range), else `StagedRowsLostError` as below (a run that is itself of an
     older generation: `StaleStageError`);
     `check_staged`: every part the job produced has its marker, and the stage holds, per
     topic-partition, exactly the rows the markers count. A stage that lost rows (markers
     are UNLOGGED like the stage, so a crash empties both, but whatever else removes rows)
     is refused with `StagedRowsLostError` and dropped with its markers after the rollback,
     so the next attempt re-stages it from Kafka instead of committing less;
  3. `fence_and_advance`: advance each partition's position only if it still equals the
     range's `from_offset` (a missing position counts only for a partition seen for the
     first time); any mismatch rolls everything back with FencedCommitError;
  4. `move_rows`: replay/backfill first deletes what its ranges produced before; rows that
     broke the quality suite go to the dead-letter table; the stage goes into the target
     (append, or upsert by the rule in `offsetflow.commit.upsert`), tombstones by the pipeline's
     `tombstones` policy; the tasks' bad records join the dead-letter table. Every count is
     checked against the markers (an INSERT's rowcount, not a second scan);
     a sink outside PostgreSQL (`spec.external`, an `ExternalSink`) takes this step instead,
     inside this still-open transaction (`commit_external`): first it looks for its own
     record of this batch (`find`: an Iceberg snapshot or a Kafka transaction that carries
     the batch id), and only when there is none it writes and commits there (`write`). The
     batch row stays locked meanwhile, so no second live run gets here; a run killed after
     the sink's commit but before COMMIT below leaves the batch open, and its retry finds
     the record instead of writing again. A zombie whose lock is gone is the sink's to
     refuse (its own fencing: a producer epoch, a snapshot-parent check);
  5. `record_batch`: per-range counts, the batch marked committed (with the schema ids
     it read, registry formats);
  6. `drop_stage`; COMMIT. Any failure before COMMIT leaves nothing visible, dead letters
     included: a retry routes the same rows again, once.

`sink_holds` asks an external sink, outside the protocol, whether it holds an open batch
already (a run died after the sink's commit, before the ledger's): such a batch must never be
abandoned, which would plan its ranges again and write them twice. Running it again
completes it (step 4 finds the record), with its dead letters, as any retry does.

Beside this module: what a commit is given and gives back, and the `ExternalSink` shape
(`offsetflow.commit.spec`); step 4's SQL into a PostgreSQL target (`offsetflow.commit.rows`);
what the markers count (`offsetflow.stage.markers`).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras
from psycopg2 import sql

from offsetflow.commit.dead_letters import route_quality_failures
from offsetflow.commit.rows import append_part, delete_range_rows, move_stage_dead_letters
from offsetflow.commit.spec import CommitResult, CommitSpec, ExternalSink, Moved
from offsetflow.commit.tables import evolve_target
from offsetflow.commit.upsert import apply_upsert
from offsetflow.errors import (
    BatchStateError,
    FencedCommitError,
    StagedRowsLostError,
    StagingIncompleteError,
    StaleConfigError,
)
from offsetflow.ledger import (
    Batch,
    Ledger,
    batch_stats,
    connect,
    lock_errors,
    lock_timeout_s,
    refuse_newer_ledger,
    stage_table,
)
from offsetflow.ranges import OffsetRange
from offsetflow.stage import (
    check_layout,
    forget_parts,
    lock_stage,
    staged_per_range,
    staged_schema_ids,
    task_bad_records,
)

log = logging.getLogger(__name__)


class Step4(ABC):
    """How a commit's step 4 moves the stage, and what it does around the checks of
    `commit_steps` (in their order: `skip` | `before_checks`, `before_count`,
    `expected_parts` and `scan` for `check_staged`, `after_count`, then `move` after
    step 3). Every hook runs in the commit's transaction with the batch row locked."""

    scan: bool = True  # `check_staged` counts the stage itself against its markers
    # when every part was staged (the ledger database's clock), for the batch's timings;
    # None: not known (the commit does not depend on it)
    staged_at: datetime | None = None

    def skip(self, cur: psycopg2.extensions.cursor, batch: Batch) -> None:
        """Step 1 found the batch committed already: nothing moves."""
        return None

    def before_checks(self, cur: psycopg2.extensions.cursor, batch: Batch) -> None:
        """After step 1 (the batch open, its config checked), before step 2's checks."""
        return None

    def before_count(self, cur: psycopg2.extensions.cursor, batch: Batch) -> None:
        """After step 2's layout check (`check_layout`), before its count."""
        return None

    @property
    @abstractmethod
    def expected_parts(self) -> int:
        """The parts the job produced (`check_staged` refuses fewer markers)."""

    def after_count(self, batch: Batch, staged: int) -> None:
        """After step 2's count (`staged`: the rows the markers count), before step 3."""
        return None

    @abstractmethod
    def move(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int,
             per_range: dict[str, int]) -> Moved:
        """Step 4 (what is left of it), after step 3; its counts for `record_batch`
        (`per_range`: step 2's split of the markers' rows by topic/partition)."""


class WholeStage(Step4):
    """Step 4 on the whole stage at once, after every check: into the PostgreSQL target
    (`move_rows`) or through an external sink (`commit_external`)."""

    def __init__(self, spec: CommitSpec, expected_parts: int,
                 timings: dict[str, float] | None, staged_at: datetime | None = None) -> None:
        self.spec = spec
        self.parts = expected_parts
        self.timings = timings
        self.staged_at = staged_at
        self.scan = not spec.task_files  # task-written files: the sink reconciles them

    def before_checks(self, cur: psycopg2.extensions.cursor, batch: Batch) -> None:
        lock_stage(cur, batch.batch_id)  # 2: no late writer lands between checks and moves

    @property
    def expected_parts(self) -> int:
        return self.parts

    def move(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int,
             per_range: dict[str, int]) -> Moved:
        moved = (commit_external(cur, batch, self.spec.external, staged)
                 if self.spec.external is not None
                 else move_rows(cur, batch, self.spec, staged, self.timings))
        moved.per_range = per_range
        if self.timings is not None:
            self.timings.update(moved.timings)
        return moved


def commit_batch(ledger: Ledger, batch_id: int, *, expected_parts: int, spec: CommitSpec,
                 timings: dict[str, float] | None = None,
                 staged_at: datetime | None = None) -> CommitResult:
    """Steps 1-6 in one transaction, step 4 on the whole stage; see the module docstring.
    `staged_at`: when the job's last part was staged, kept with the batch's timings."""
    return commit_steps(ledger, batch_id, spec,
                        WholeStage(spec, expected_parts, timings, staged_at), timings)


def commit_steps(ledger: Ledger, batch_id: int, spec: CommitSpec, step4: Step4,
                 timings: dict[str, float] | None) -> CommitResult:
    """Steps 1-6 in one transaction, in the order of the module docstring, with `step4`'s
    way of moving the stage. A stage that lost rows is dropped with its markers after the
    rollback, so the next attempt re-stages it from Kafka."""
    try:
        with ledger.transaction() as cur, lock_errors(ledger.dsn, batch_id,
                                                      ledger.conn.get_backend_pid()):
            batch = lock_batch(cur, ledger, batch_id)  # 1
            if batch.status == "committed":
                step4.skip(cur, batch)
                return already_committed(batch)
            check_config(batch, spec)
            if spec.add_columns and spec.external is None:
                evolved = evolve_target(cur, batch.target_table, spec.add_columns,
                                        spec.column_defaults)
                if evolved:
                    log.info("batch %d: %s: %s (in the commit's transaction)",
                             batch.batch_id, batch.target_table, ", ".join(evolved))
            step4.before_checks(cur, batch)
            check_layout(cur, batch, spec.stage_generation, spec.subrange_parts)  # 2
            step4.before_count(cur, batch)
            staged, per_range = check_staged(cur, batch, step4.expected_parts,
                                             scan=step4.scan)
            step4.after_count(batch, staged)
            if batch.moves_positions:  # 3
                fence_and_advance(cur, batch)
            moved = step4.move(cur, batch, staged, per_range)  # 4
            return record_batch(cur, ledger, batch, moved, staged, timings,  # 5, 6
                                step4.staged_at, spec.readers)
    except StagedRowsLostError as e:
        try:
            forget_parts(ledger.dsn, batch_id, e.parts, spec.stage_generation)
        except psycopg2.Error as forget:  # the refusal is what the user must see
            log.error("batch %d: could not drop the refused part(s); the next run refuses "
                      "them again: %s", batch_id, forget)
        raise


def sink_holds(dsn: str, batch: Batch, sink: ExternalSink) -> bool:
    """Whether the sink already holds `batch` (step 4's `find`, in a transaction rolled
    back afterwards: a find may route dead letters, which only a commit may keep)."""
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            return sink.find(cur, batch) is not None
    finally:
        conn.rollback()
        conn.close()
        sink.close()


def lock_batch(cur: psycopg2.extensions.cursor, ledger: Ledger, batch_id: int) -> Batch:
    """Step 1. Every lock the commit takes from here waits at most `lock_timeout_s`."""
    cur.execute("SELECT set_config('lock_timeout', %s, true)",
                (f"{int(lock_timeout_s() * 1000)}ms",))
    refuse_newer_ledger(cur)  # before any lock a `db upgrade` could wait for
    batch = ledger.get_batch(batch_id, cur, for_update=True)
    if batch.status == "abandoned":
        raise BatchStateError(f"batch {batch_id} was abandoned; refusing to commit it")
    return batch


def check_config(batch: Batch, spec: CommitSpec) -> None:
    """Step 1's end: the batch's config is still the one this run staged under. A run with
    --accept-config-change may have adopted a new one (and rebuilt the stage) meanwhile."""
    if spec.config_fingerprint is not None and \
            batch.config_fingerprint != spec.config_fingerprint:
        raise StaleConfigError(
            f"batch {batch.batch_id}: its config changed while this run worked on it "
            f"(another run took a new config with --accept-config-change); this run's "
            f"config is stale, so it commits nothing. Re-run the batch with the current "
            f"pipeline config")


def already_committed(batch: Batch) -> CommitResult:
    log.info("batch %d is already committed; this commit changes nothing", batch.batch_id)
    return CommitResult(batch.batch_id, "already_committed", batch.rows_written or 0,
                        batch.bad_records or 0, {})


def check_staged(cur: psycopg2.extensions.cursor, batch: Batch, expected_parts: int,
                 scan: bool) -> tuple[int, dict[str, int]]:
    """Step 2. Returns the rows the markers count and their split by topic/partition. With
    `scan`, the stage itself is counted against the markers (the upsert, quality and
    transform paths); without, the caller checks each part as it moves it."""
    cur.execute("""SELECT count(*), COALESCE(sum(rows_staged), 0)
                     FROM offsetflow.staged_parts WHERE batch_id = %s AND kind = 'rows'""",
                (batch.batch_id,))
    row = cur.fetchone()
    assert row is not None
    parts, staged = int(row[0]), int(row[1])
    if parts != expected_parts:
        raise StagingIncompleteError(f"batch {batch.batch_id}: {parts} of {expected_parts} "
                                     f"parts are staged; not committing")
    per_range = staged_per_range(cur, batch.batch_id)
    if scan:
        # no distinct-offset check: a transform may turn one record into several rows, and
        # parts of two partitionings never meet (a transform run stages under a generation
        # of its own, and markers of another are refused above)
        cur.execute(sql.SQL("SELECT topic, partition, count(*) FROM {} GROUP BY 1, 2")
                    .format(stage_table(batch.batch_id)))
        found = {f"{t}/{p}": int(n) for t, p, n in cur.fetchall()}
        for tp in sorted(set(found) | set(per_range)):
            if found.get(tp, 0) != per_range.get(tp, 0):
                raise StagedRowsLostError(
                    batch.batch_id, None,
                    f"the stage holds {found.get(tp, 0)} rows of {tp} but its markers count "
                    f"{per_range.get(tp, 0)}")
    return staged, per_range


def move_rows(cur: psycopg2.extensions.cursor, batch: Batch, spec: CommitSpec, staged: int,
              timings: dict[str, float] | None) -> Moved:
    """Step 4 for the whole stage at once."""
    moved = Moved()
    stage = stage_table(batch.batch_id)
    if batch.kind in ("replay", "backfill"):
        delete_range_rows(cur, batch, spec)
    if spec.quality_routes:
        assert spec.dead_letter_table is not None
        moved.dead += route_quality_failures(cur, batch, spec.dead_letter_table, stage,
                                             spec.quality_routes, spec.columns)
    if spec.mode == "upsert":
        assert spec.dead_letter_table is not None
        rows, _deleted, dead = apply_upsert(cur, batch, stage, spec.columns, spec.key,
                                            spec.tombstones, spec.dead_letter_table)
        moved.rows += rows
        moved.dead += dead
    else:
        append_part(cur, batch, spec, stage, staged - moved.dead, "the stage", None, moved)
    move_stage_dead_letters(cur, batch, spec, moved)
    return moved


def commit_external(cur: psycopg2.extensions.cursor, batch: Batch, sink: ExternalSink,
                    staged: int) -> Moved:
    """Step 4 for an external sink: find this batch's commit there, else write it."""
    found = sink.find(cur, batch)
    if found is not None:
        log.info("batch %d is already committed in the sink (an earlier attempt got that far); "
                 "completing the ledger without writing again", batch.batch_id)
        return found
    return sink.write(cur, batch, staged)


def record_batch(cur: psycopg2.extensions.cursor, ledger: Ledger, batch: Batch, moved: Moved,
                 staged: int, timings: dict[str, float] | None,
                 staged_at: datetime | None = None,
                 readers: Mapping[str, int | None] | None = None) -> CommitResult:
    """Steps 5 and 6: per-range counts (records staged), the batch committed, the stage
    dropped; the caller's COMMIT makes it all visible at once. `readers` (registry
    formats): with the writer schema ids the markers name, the batch's `schemas`."""
    # one statement for all ranges (a batch of 1,000 partitions: one round trip)
    cur.execute("""UPDATE offsetflow.batch_ranges br SET records = n.records
                     FROM unnest(%s::text[], %s::int[], %s::bigint[])
                          AS n(topic, partition, records)
                    WHERE br.batch_id = %s AND br.topic = n.topic
                      AND br.partition = n.partition""",
                ([r.topic for r in batch.ranges], [r.partition for r in batch.ranges],
                 [moved.per_range.get(f"{r.topic}/{r.partition}", 0) for r in batch.ranges],
                 batch.batch_id))
    records = staged + task_bad_records(cur, batch.batch_id)
    committed_at, stats = commit_stats(cur, batch, records, staged_at)
    cur.execute("""UPDATE offsetflow.batches
                      SET status = 'committed', finished_at = now(), committed_at = %s,
                          staged_at = %s, records_read = %s, rows_written = %s,
                          bad_records = %s, error = NULL, timings = %s, stats = %s
                    WHERE batch_id = %s""",
                (committed_at, staged_at, records, moved.rows, moved.dead,
                 json.dumps(timings or {}), json.dumps(stats), batch.batch_id))
    if readers is not None:
        cur.execute("UPDATE offsetflow.batches SET schemas = %s WHERE batch_id = %s",
                    (json.dumps({"readers": dict(readers),
                                 "writers": staged_schema_ids(cur, batch.batch_id)}),
                     batch.batch_id))
    ledger.drop_staging(cur, batch.batch_id)  # 6
    log.info("batch %d committed: %d rows into %s, %d dead letters", batch.batch_id,
             moved.rows, batch.target_table, moved.dead)
    return CommitResult(batch.batch_id, "committed", moved.rows, moved.dead,
                        dict(moved.per_range))


def commit_stats(cur: psycopg2.extensions.cursor, batch: Batch, records: int,
                 staged_at: datetime | None) -> tuple[datetime, dict[str, Any]]:
    """The batch's commit time and derived timings (`offsetflow.ledger.timing`). The commit
    time is the database's clock now, just before COMMIT (not `now()`, the transaction's
    start: a part-by-part commit's transaction began while the tasks were still reading).
    The input rate's interval is the time since the previous scheduled batch was due."""
    cur.execute("SELECT clock_timestamp()")
    row = cur.fetchone()
    assert row is not None
    now = row[0]
    interval_s = None
    if batch.kind == "scheduled" and batch.due_at is not None:
        cur.execute("""SELECT max(due_at) FROM offsetflow.batches
                        WHERE pipeline = %s AND kind = 'scheduled' AND batch_id < %s
                          AND due_at < %s""", (batch.pipeline, batch.batch_id, batch.due_at))
        prev = cur.fetchone()
        if prev is not None and prev[0] is not None:
            interval_s = (batch.due_at - prev[0]).total_seconds()
    return now, batch_stats(due_at=batch.due_at, started_at=batch.started_at,
                            staged_at=staged_at, committed_at=now, records=records,
                            interval_s=interval_s)


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


def fence_and_advance(cur: psycopg2.extensions.cursor, batch: Batch) -> None:
    """Move each position from the value the batch expects (`batch_ranges.expected_position`,
    else `from_offset`) to the range's `until_offset`, or refuse the whole commit. One
    statement moves every position found where the batch expects it (1,000 ranges cost one
    round trip, not 1,000); a range it did not move is fenced, or its partition's first."""
    cur.execute("""UPDATE offsetflow.positions p
                      SET next_offset = br.until_offset, batch_id = br.batch_id,
                          updated_at = now(), topic_id = COALESCE(br.topic_id, p.topic_id)
                     FROM offsetflow.batch_ranges br
                    WHERE br.batch_id = %s AND br.topic = p.topic
                      AND br.partition = p.partition AND p.pipeline = %s
                      AND p.next_offset = COALESCE(br.expected_position, br.from_offset)
                RETURNING p.topic, p.partition,
                          COALESCE(br.expected_position, br.from_offset)""",
                (batch.batch_id, batch.pipeline))
    advanced = {(t, int(p)): int(exp) for t, p, exp in cur.fetchall()}
    expected = _expected_positions(cur, batch) if len(advanced) < len(batch.ranges) else {}
    history = []
    for r in batch.ranges:
        old: int | None
        if r.topic_partition in advanced:
            old = exp = advanced[r.topic_partition]
        else:
            exp, _ = expected.get(r.topic_partition, (r.from_offset, None))
            _first_position(cur, batch, r, exp)
            old = None
        reason = "commit" if exp == r.from_offset else (
            f"commit; offsets [{exp}, {r.from_offset}) were gone from Kafka (data_loss: "
            f"continue)")
        history.append((batch.pipeline, r.topic, r.partition, old, r.until_offset,
                        batch.batch_id, reason))
    psycopg2.extras.execute_values(
        cur, """INSERT INTO offsetflow.position_history
                  (pipeline, topic, partition, old_offset, new_offset, batch_id, reason)
                VALUES %s""", history, page_size=max(len(history), 1))


def _first_position(cur: psycopg2.extensions.cursor, batch: Batch, r: OffsetRange,
                    exp: int) -> None:
    """A range whose position was not where the batch expects it: fenced, unless its
    partition has no position yet (its first batch creates the row, once)."""
    cur.execute("""SELECT next_offset FROM offsetflow.positions
                    WHERE pipeline = %s AND topic = %s AND partition = %s""",
                (batch.pipeline, r.topic, r.partition))
    found = cur.fetchone()
    if found is not None:
        raise FencedCommitError(batch.batch_id, r.topic, r.partition, exp,
                                int(found[0]), open_scheduled=batch.kind == "scheduled")
    cur.execute("""INSERT INTO offsetflow.positions
                     (pipeline, topic, partition, next_offset, batch_id, topic_id)
                   SELECT %s, %s, %s, %s, %s, topic_id FROM offsetflow.batch_ranges
                    WHERE batch_id = %s AND topic = %s AND partition = %s
                   ON CONFLICT DO NOTHING""",
                (batch.pipeline, r.topic, r.partition, r.until_offset, batch.batch_id,
                 batch.batch_id, r.topic, r.partition))
    if cur.rowcount == 0:
        raise FencedCommitError(batch.batch_id, r.topic, r.partition, r.from_offset, None)
