"""The ledger: PostgreSQL tables that are the single system of record for offsets.

Thin adapter over psycopg2. Batches and their ranges are written before any record is
read; positions only move inside the commit transaction (see `offsetflow.commit`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras
from psycopg2 import sql

from offsetflow.errors import (
    BatchNotFoundError,
    BatchStateError,
    LockTimeoutError,
)
from offsetflow.ledger_migrations import refuse_newer_ledger, upgrade
from offsetflow.planner import DataLossGap
from offsetflow.ranges import OffsetRange, TopicPartition

log = logging.getLogger(__name__)

OPEN_STATUSES = ("planned", "running", "failed")
KINDS = ("scheduled", "backfill", "replay")


@dataclass(frozen=True)
class Batch:
    batch_id: int
    pipeline: str
    kind: str
    status: str
    ranges: tuple[OffsetRange, ...]
    target_table: str
    moves_positions: bool = True
    config_fingerprint: str | None = None
    started_by: str = "unknown"
    params: dict[str, Any] = field(default_factory=dict)
    planned_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    records_read: int | None = None
    rows_written: int | None = None
    bad_records: int | None = None
    error: str | None = None
    quality: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    split_offsets: int | None = None  # its ranges' split into Spark parts; None before 0003

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_STATUSES

    @property
    def offset_span(self) -> int:
        return sum(r.span for r in self.ranges)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "batch_id", "pipeline", "kind", "status", "target_table", "moves_positions",
            "started_by", "params", "attempts", "records_read", "rows_written", "bad_records",
            "error", "quality", "timings")}
        for k in ("planned_at", "started_at", "finished_at"):
            v = getattr(self, k)
            d[k] = v.isoformat() if v else None
        d["ranges"] = [r.to_dict() for r in self.ranges]
        return d


# Server-side settings of every OffsetFlow session (libpq `options`):
#  - READ COMMITTED whatever the database's default: `PartwiseCommit` polls for new stage
#    markers inside one long transaction, and under `repeatable read` it would never see them;
#  - TimeZone UTC: timestamps rendered as text (deleted_keys' JSON keys) never depend on a
#    server's or role's default;
#  - TCP keepalives on the server's socket: a driver whose host dies mid-commit (no FIN, no
#    RST) loses its session, and the row locks its commit holds, in about a minute instead
#    of the kernel's ~2 h (settings every supported PostgreSQL version knows).
SESSION_OPTIONS = ("-c default_transaction_isolation=read\\ committed -c timezone=UTC "
                   "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 "
                   "-c tcp_keepalives_count=3")
# libpq's keepalives: the client side notices a dead server the same way
CLIENT_KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 30,
                                     "keepalives_interval": 10, "keepalives_count": 3}


def connect(dsn: str) -> psycopg2.extensions.connection:
    """Open a connection with OffsetFlow's session settings (`SESSION_OPTIONS`); the DSN is
    never logged (it holds the password). Options a DSN sets itself come after ours."""
    dsn_opts = psycopg2.extensions.parse_dsn(dsn).get("options", "")
    conn = psycopg2.connect(dsn, application_name="offsetflow", connect_timeout=10,
                            options=f"{SESSION_OPTIONS} {dsn_opts}".strip(),
                            **CLIENT_KEEPALIVES)
    return conn


def stage_table(batch_id: int) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier("offsetflow_stage"),
                                   sql.Identifier(f"b{int(batch_id)}"))


def stage_part_table(batch_id: int, part: int) -> sql.Composed:
    """One Spark part's rows: a child of the stage table (`INHERITS`), so whole-stage reads
    see every part, while the commit can move a part the moment its task has staged it."""
    return sql.SQL("{}.{}").format(sql.Identifier("offsetflow_stage"),
                                   sql.Identifier(f"b{int(batch_id)}_p{int(part)}"))


def dead_letter_stage_table(batch_id: int) -> sql.Composed:
    return sql.SQL("{}.{}").format(sql.Identifier("offsetflow_stage"),
                                   sql.Identifier(f"b{int(batch_id)}_dead"))


def qualified(table: str) -> sql.Composed:
    """Quote a validated `schema.table` name for SQL."""
    parts = table.split(".")
    if len(parts) == 1:
        parts = ["public", parts[0]]
    return sql.SQL(".").join(sql.Identifier(p) for p in parts)


class Ledger:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._conn: psycopg2.extensions.connection | None = None

    @property
    def conn(self) -> psycopg2.extensions.connection:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.dsn)
        return self._conn

    def close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            self._conn.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg2.extensions.cursor]:
        conn = self.conn
        try:
            with conn.cursor() as cur:
                yield cur
            conn.commit()
        except BaseException:
            if not conn.closed:
                with contextlib.suppress(psycopg2.Error):
                    conn.rollback()
            raise

    # -- migrations -------------------------------------------------------------------
    def upgrade(self) -> list[str]:
        """Apply pending migrations in order, once each (`ledger_migrations.upgrade`)."""
        with self.transaction() as cur:
            applied = upgrade(cur)
        for v in applied:
            log.info("applied ledger migration %s", v)
        return applied

    # -- locking ----------------------------------------------------------------------
    @staticmethod
    def lock_pipeline(cur: psycopg2.extensions.cursor, pipeline: str,
                      timeout_s: float = 60.0) -> None:
        """Per-pipeline planning lock, held until the surrounding transaction ends (after
        the ledger version check: the first lock a planning transaction takes)."""
        cur.execute("SET LOCAL lock_timeout = %s", (f"{int(timeout_s * 1000)}ms",))
        refuse_newer_ledger(cur)
        try:
            cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                        (f"offsetflow:plan:{pipeline}",))
        except psycopg2.errors.LockNotAvailable as e:
            raise LockTimeoutError(
                f"pipeline {pipeline}: another planner held the planning lock for more "
                f"than {timeout_s:.0f}s") from e

    # -- reads ------------------------------------------------------------------------
    _BATCH_COLS = ("batch_id, pipeline, kind, status, target_table, moves_positions, "
                   "config_fingerprint, started_by, params, planned_at, started_at, finished_at, "
                   "attempts, records_read, rows_written, bad_records, error, quality, timings, "
                   "split_offsets")

    def _batches(self, cur: psycopg2.extensions.cursor, where: sql.Composable,
                 args: Sequence[Any], suffix: str = "") -> list[Batch]:
        cur.execute(sql.SQL("SELECT " + self._BATCH_COLS + " FROM offsetflow.batches WHERE ")
                    + where + sql.SQL(" ORDER BY batch_id DESC " + suffix), args)
        rows = cur.fetchall()
        if not rows:
            return []
        ids = [r[0] for r in rows]
        cur.execute("""SELECT batch_id, topic, partition, from_offset, until_offset
                         FROM offsetflow.batch_ranges WHERE batch_id = ANY(%s)
                        ORDER BY topic, partition""", (ids,))
        ranges: dict[int, list[OffsetRange]] = {}
        for bid, t, p, f, u in cur.fetchall():
            ranges.setdefault(bid, []).append(OffsetRange(t, p, f, u))
        return [Batch(batch_id=r[0], pipeline=r[1], kind=r[2], status=r[3],
                      ranges=tuple(ranges.get(r[0], [])), target_table=r[4],
                      moves_positions=r[5], config_fingerprint=r[6], started_by=r[7],
                      params=r[8] or {}, planned_at=r[9], started_at=r[10], finished_at=r[11],
                      attempts=r[12], records_read=r[13], rows_written=r[14],
                      bad_records=r[15], error=r[16], quality=r[17], timings=r[18],
                      split_offsets=r[19])
                for r in rows]

    def get_batch(self, batch_id: int, cur: psycopg2.extensions.cursor | None = None,
                  for_update: bool = False) -> Batch:
        def run(c: psycopg2.extensions.cursor) -> list[Batch]:
            return self._batches(c, sql.SQL("batch_id = %s"), (batch_id,),
                                 "FOR UPDATE" if for_update else "")
        if cur is not None:
            found = run(cur)
        else:
            with self.transaction() as c:
                found = run(c)
        if not found:
            raise BatchNotFoundError(f"no batch {batch_id} in the ledger")
        return found[0]

    def open_batch(self, cur: psycopg2.extensions.cursor, pipeline: str,
                   kind: str = "scheduled") -> Batch | None:
        found = self._batches(cur, sql.SQL("pipeline = %s AND kind = %s AND status = ANY(%s)"),
                              (pipeline, kind, list(OPEN_STATUSES)), "LIMIT 1")
        return found[0] if found else None

    def recent_batches(self, pipeline: str, limit: int = 20) -> list[Batch]:
        with self.transaction() as cur:
            return self._batches(cur, sql.SQL("pipeline = %s"), (pipeline,), f"LIMIT {int(limit)}")

    def positions(self, pipeline: str, cur: psycopg2.extensions.cursor | None = None
                  ) -> dict[TopicPartition, int]:
        q = "SELECT topic, partition, next_offset FROM offsetflow.positions WHERE pipeline = %s"
        if cur is not None:
            cur.execute(q, (pipeline,))
            return {(t, p): o for t, p, o in cur.fetchall()}
        with self.transaction() as c:
            c.execute(q, (pipeline,))
            return {(t, p): o for t, p, o in c.fetchall()}

    def init_positions(self, cur: psycopg2.extensions.cursor, pipeline: str,
                       starts: dict[TopicPartition, int], topic_ids: dict[str, str],
                       reason: str) -> None:
        """One statement for all new partitions (1,000 of them: one round trip); history
        for the rows it inserted (a concurrent planner's rows are left as they are)."""
        items = sorted(starts.items())
        if not items:
            return
        cur.execute("""WITH new AS (
                         INSERT INTO offsetflow.positions
                           (pipeline, topic, partition, next_offset, topic_id)
                         SELECT %s, s.topic, s.partition, s.next_offset, s.topic_id
                           FROM unnest(%s::text[], %s::int[], %s::bigint[], %s::text[])
                                AS s(topic, partition, next_offset, topic_id)
                          ORDER BY s.topic, s.partition
                         ON CONFLICT DO NOTHING
                         RETURNING topic, partition, next_offset)
                       INSERT INTO offsetflow.position_history
                         (pipeline, topic, partition, old_offset, new_offset, reason)
                       SELECT %s, topic, partition, NULL, next_offset, %s FROM new""",
                    (pipeline, [t for (t, _), _ in items], [p for (_, p), _ in items],
                     [o for _, o in items], [topic_ids.get(t) for (t, _), _ in items],
                     pipeline, reason))

    def lag_history(self, pipeline: str, limit: int = 100) -> list[dict[str, Any]]:
        """Lag (offsets) seen at each planning, oldest first: the lag-over-time chart."""
        with self.transaction() as cur:
            cur.execute("""SELECT batch_id, planned_at, (params->>'lag_at_plan')::bigint,
                                  status FROM offsetflow.batches
                            WHERE pipeline = %s AND kind = 'scheduled'
                              AND params ? 'lag_at_plan'
                            ORDER BY batch_id DESC LIMIT %s""", (pipeline, limit))
            rows = cur.fetchall()
        return [{"batch_id": b, "at": t.isoformat(), "lag": lag, "status": s}
                for b, t, lag, s in reversed(rows)]

    def position_topic_ids(self, cur: psycopg2.extensions.cursor, pipeline: str
                           ) -> dict[TopicPartition, str | None]:
        cur.execute("""SELECT topic, partition, topic_id FROM offsetflow.positions
                        WHERE pipeline = %s""", (pipeline,))
        return {(t, p): i for t, p, i in cur.fetchall()}

    def open_batches_overlapping(self, cur: psycopg2.extensions.cursor, pipeline: str,
                                 ranges: Sequence[OffsetRange]) -> list[int]:
        """Ids of open batches of `pipeline` whose ranges overlap any of `ranges`."""
        found: set[int] = set()
        for r in ranges:
            cur.execute("""SELECT b.batch_id FROM offsetflow.batches b
                             JOIN offsetflow.batch_ranges br USING (batch_id)
                            WHERE b.pipeline = %s AND b.status = ANY(%s)
                              AND br.topic = %s AND br.partition = %s
                              AND br.from_offset < %s AND br.until_offset > %s""",
                        (pipeline, list(OPEN_STATUSES), r.topic, r.partition,
                         r.until_offset, r.from_offset))
            found.update(row[0] for row in cur.fetchall())
        return sorted(found)

    # -- writes -----------------------------------------------------------------------
    def insert_batch(self, cur: psycopg2.extensions.cursor, *, pipeline: str, kind: str,
                     ranges: Sequence[OffsetRange], target_table: str,
                     config_fingerprint: str, split_offsets: int, started_by: str,
                     moves_positions: bool = True, params: dict[str, Any] | None = None,
                     topic_ids: Mapping[str, str] | None = None,
                     expected_positions: Mapping[TopicPartition, int] | None = None) -> int:
        """`config_fingerprint` and `split_offsets` are what `config_drift` compares a run's
        config with; a batch without them would look like one planned before 0003.
        `expected_positions`: the committed position a range's commit must find when it is
        not the range's `from_offset` (a `data_loss: continue` gap); the fence uses it."""
        if kind not in KINDS:
            raise ValueError(f"unknown batch kind {kind!r}")
        cur.execute("""INSERT INTO offsetflow.batches
                         (pipeline, kind, status, target_table, moves_positions,
                          config_fingerprint, started_by, params, split_offsets)
                       VALUES (%s, %s, 'planned', %s, %s, %s, %s, %s, %s) RETURNING batch_id""",
                    (pipeline, kind, target_table, moves_positions, config_fingerprint,
                     started_by, json.dumps(params or {}), split_offsets))
        row = cur.fetchone()
        assert row is not None
        batch_id = int(row[0])
        psycopg2.extras.execute_values(
            cur, """INSERT INTO offsetflow.batch_ranges
                      (batch_id, topic, partition, from_offset, until_offset, topic_id,
                       expected_position)
                    VALUES %s""",
            [(batch_id, r.topic, r.partition, r.from_offset, r.until_offset,
              (topic_ids or {}).get(r.topic),
              (expected_positions or {}).get(r.topic_partition)) for r in ranges])
        return batch_id

    def record_data_loss(self, cur: psycopg2.extensions.cursor, pipeline: str,
                         gaps: Sequence[DataLossGap], policy: str,
                         batch_id: int | None = None) -> None:
        """Record each gap once per (partition, missing_from): a later plan that finds
        the same gap (a re-plan under `fail`, a batch abandoned and planned again, a gap
        first recorded when no batch covered it) extends that row and links it to
        `batch_id` when given, instead of adding an overlapping one."""
        for g in gaps:
            key = (pipeline, g.topic, g.partition, g.missing_from)
            cur.execute("""UPDATE offsetflow.data_loss
                              SET missing_until = GREATEST(missing_until, %s),
                                  batch_id = COALESCE(%s, batch_id), policy = %s
                            WHERE pipeline = %s AND topic = %s AND partition = %s
                              AND missing_from = %s""",
                        (g.missing_until, batch_id, policy, *key))
            if cur.rowcount:
                continue
            cur.execute("""INSERT INTO offsetflow.data_loss
                             (pipeline, topic, partition, missing_from, missing_until, policy,
                              batch_id) VALUES (%s, %s, %s, %s, %s, %s, %s)""",
                        (*key, g.missing_until, policy, batch_id))

    def data_loss_events(self, pipeline: str) -> list[dict[str, Any]]:
        with self.transaction() as cur:
            cur.execute("""SELECT topic, partition, missing_from, missing_until, policy,
                                  batch_id, detected_at
                             FROM offsetflow.data_loss WHERE pipeline = %s ORDER BY id""",
                        (pipeline,))
            cols = [d[0] for d in cur.description or ()]
            return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]

    def mark_running(self, batch_id: int) -> Batch:
        """Move an open batch to running; a committed one is returned as is (no-op)."""
        with self.transaction() as cur:
            refuse_newer_ledger(cur)
            b = self.get_batch(batch_id, cur, for_update=True)
            if b.status == "committed":
                return b
            if b.status == "abandoned":
                raise BatchStateError(f"batch {batch_id} was abandoned and cannot run")
            cur.execute("""UPDATE offsetflow.batches
                              SET status = 'running', started_at = now(),
                                  attempts = attempts + 1, error = NULL
                            WHERE batch_id = %s""", (batch_id,))
        return self.get_batch(batch_id)

    def add_timings(self, batch_id: int, timings: dict[str, float]) -> None:
        """Timings known only after the commit (its own duration), for stats and status;
        informational, so outside the commit transaction."""
        with self.transaction() as cur:
            cur.execute("""UPDATE offsetflow.batches
                              SET timings = COALESCE(timings, '{}'::jsonb) || %s::jsonb
                            WHERE batch_id = %s""", (json.dumps(timings), batch_id))

    def mark_failed(self, batch_id: int, error: str, quality: dict[str, Any] | None = None
                    ) -> None:
        """Record a failed attempt; the batch stays open and is re-run unchanged."""
        with self.transaction() as cur:
            cur.execute("""UPDATE offsetflow.batches
                              SET status = 'failed', error = %s, finished_at = now(),
                                  quality = COALESCE(%s, quality)
                            WHERE batch_id = %s AND status IN ('planned', 'running', 'failed')""",
                        (error[:10000], json.dumps(quality) if quality else None, batch_id))

    def adopt_config(self, batch_id: int, fingerprint: str, split_offsets: int) -> None:
        """An open batch takes a changed config (its output accepted by the user, or only its
        split): staged data of earlier attempts is dropped with the old config, in one
        transaction."""
        with self.transaction() as cur:
            b = self.get_batch(batch_id, cur, for_update=True)
            if not b.is_open:
                raise BatchStateError(f"batch {batch_id} is {b.status}; its config is final")
            self._drop_staging(cur, batch_id)
            cur.execute("UPDATE offsetflow.batches SET config_fingerprint = %s, "
                        "split_offsets = %s WHERE batch_id = %s",
                        (fingerprint, split_offsets, batch_id))

    def abandon(self, batch_id: int, reason: str,
                cur: psycopg2.extensions.cursor | None = None) -> None:
        """Close an open batch for good and drop its staged data (in `cur`'s transaction
        when given, e.g. planning's, which holds the pipeline lock)."""
        if cur is None:
            with self.transaction() as c:
                self.abandon(batch_id, reason, c)
            return
        refuse_newer_ledger(cur)
        b = self.get_batch(batch_id, cur, for_update=True)
        if not b.is_open:
            raise BatchStateError(f"batch {batch_id} is {b.status}; only open batches "
                                  f"can be abandoned")
        cur.execute("""UPDATE offsetflow.batches SET status = 'abandoned', error = %s,
                              finished_at = now() WHERE batch_id = %s""",
                    (reason, batch_id))
        self._drop_staging(cur, batch_id)

    @staticmethod
    def range_topic_ids(cur: psycopg2.extensions.cursor, batch_id: int) -> dict[str, str]:
        """The Kafka topic id each topic of a batch had when the batch was planned (topics
        planned without one, before ledger migration 0002, are left out)."""
        cur.execute("""SELECT DISTINCT topic, topic_id FROM offsetflow.batch_ranges
                        WHERE batch_id = %s AND topic_id IS NOT NULL""", (batch_id,))
        return {t: i for t, i in cur.fetchall()}

    @staticmethod
    def _drop_staging(cur: psycopg2.extensions.cursor, batch_id: int) -> int:
        """Returns the new stage generation."""
        # CASCADE: the part tables inherit from the stage table and go with it
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(stage_table(batch_id)))
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(dead_letter_stage_table(batch_id)))
        cur.execute("DELETE FROM offsetflow.staged_parts WHERE batch_id = %s", (batch_id,))
        # markers of an attempt still running (a zombie) are refused from now on
        cur.execute("UPDATE offsetflow.batches SET stage_generation = stage_generation + 1 "
                    "WHERE batch_id = %s RETURNING stage_generation", (batch_id,))
        row = cur.fetchone()
        assert row is not None
        return int(row[0])

    def cleanup_staging(self) -> list[int]:
        """Drop staged data of batches that are closed (committed, abandoned) or gone."""
        with self.transaction() as cur:
            cur.execute("""SELECT c.relname FROM pg_class c
                             JOIN pg_namespace n ON n.oid = c.relnamespace
                            WHERE n.nspname = 'offsetflow_stage' AND c.relkind = 'r'""")
            ids = set()
            for (name,) in cur.fetchall():
                digits = name[1:].split("_")[0]
                if digits.isdigit():
                    ids.add(int(digits))
            cur.execute("SELECT DISTINCT batch_id FROM offsetflow.staged_parts")
            ids.update(r[0] for r in cur.fetchall())
            if not ids:
                return []
            cur.execute("""SELECT batch_id FROM offsetflow.batches
                            WHERE batch_id = ANY(%s) AND status = ANY(%s)""",
                        (sorted(ids), list(OPEN_STATUSES)))
            keep = {r[0] for r in cur.fetchall()}
            dropped = sorted(ids - keep)
            for bid in dropped:
                self._drop_staging(cur, bid)
        return dropped
