"""The ledger: PostgreSQL tables that are the single system of record for offsets.

Thin adapter over psycopg2. Batches and their ranges are written before any record is
read; positions only move inside the commit transaction (see `offsetflow.commit.protocol`). Here:
the connection and its transactions, migrations, reading batches and positions, a batch's
status transitions, and dropping staged data. What planning writes is in `ledger_planning`
(`Ledger` inherits it), the Batch record in `ledger_batch`, sessions in `pg_session`.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from offsetflow.errors import BatchNotFoundError, BatchStateError
from offsetflow.ledger.batch import OPEN_STATUSES, Batch
from offsetflow.ledger.migrate import refuse_newer_ledger, upgrade
from offsetflow.ledger.planning import PlanningQueries
from offsetflow.ledger.session import connect
from offsetflow.ledger.task_files import (
    drop_committed_task_files,
    drop_named_task_files,
    sweep_task_files,
)
from offsetflow.ranges import OffsetRange, TopicPartition

log = logging.getLogger(__name__)


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


class Ledger(PlanningQueries):
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
                drop_committed_task_files(conn)  # forgets the rolled-back drops
            raise
        # task files whose markers this transaction deleted: only now it committed
        drop_committed_task_files(conn)

    # -- migrations -------------------------------------------------------------------
    def upgrade(self) -> list[str]:
        """Apply pending migrations in order, once each (`ledger_migrations.upgrade`)."""
        with self.transaction() as cur:
            applied = upgrade(cur)
        for v in applied:
            log.info("applied ledger migration %s", v)
        return applied

    # -- reads ------------------------------------------------------------------------
    _BATCH_COLS = ("batch_id, pipeline, kind, status, target_table, moves_positions, "
                   "config_fingerprint, started_by, params, planned_at, started_at, finished_at, "
                   "attempts, records_read, rows_written, bad_records, error, quality, timings, "
                   "split_offsets, due_at, due_source, staged_at, committed_at, stats, schemas")

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
                      split_offsets=r[19], due_at=r[20], due_source=r[21],
                      staged_at=r[22], committed_at=r[23], stats=r[24], schemas=r[25])
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

    def pin_reader_schemas(self, batch_id: int, ids: dict[str, int | None],
                           part: str = "value") -> dict[str, int | None]:
        """The reader schema ids of the batch's first run (`ids`, when this is it), in one
        statement: two runs at once pin the same ones. `part`: the values' (migration
        0013) or, `key`, the Avro keys' (0015)."""
        col = sql.Identifier("key_reader_schemas" if part == "key" else "reader_schemas")
        with self.transaction() as cur:
            cur.execute(sql.SQL("""UPDATE offsetflow.batches
                                      SET {col} = COALESCE({col}, %s::jsonb)
                                    WHERE batch_id = %s RETURNING {col}""").format(col=col),
                        (json.dumps(ids), batch_id))
            row = cur.fetchone()
        return dict(row[0]) if row and row[0] is not None else dict(ids)

    def last_schemas(self, pipeline: str) -> dict[str, Any] | None:
        """The schema ids the pipeline's last committed batch that recorded any read
        (`batches.schemas`: readers and writers per topic), or None."""
        with self.transaction() as cur:
            cur.execute("""SELECT schemas FROM offsetflow.batches
                            WHERE pipeline = %s AND status = 'committed'
                              AND schemas IS NOT NULL
                            ORDER BY batch_id DESC LIMIT 1""", (pipeline,))
            row = cur.fetchone()
        return None if row is None else row[0]  # type: ignore[no-any-return]

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

    # -- writes -----------------------------------------------------------------------
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

    def clock(self) -> datetime:
        """The ledger database's time: every time a batch keeps is on this one clock
        (`offsetflow.ledger.timing`), wherever the driver runs."""
        with self.transaction() as cur:
            cur.execute("SELECT clock_timestamp()")
            row = cur.fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

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
            self.drop_staging(cur, batch_id)
            # the reader schemas are resolved again with the new config (migrations 0013,
            # 0015)
            cur.execute("UPDATE offsetflow.batches SET config_fingerprint = %s, "
                        "split_offsets = %s, reader_schemas = NULL, key_reader_schemas = NULL "
                        "WHERE batch_id = %s",
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
        self.drop_staging(cur, batch_id)

    @staticmethod
    def range_topic_ids(cur: psycopg2.extensions.cursor, batch_id: int) -> dict[str, str]:
        """The Kafka topic id each topic of a batch had when the batch was planned (topics
        planned without one, before ledger migration 0002, are left out)."""
        cur.execute("""SELECT DISTINCT topic, topic_id FROM offsetflow.batch_ranges
                        WHERE batch_id = %s AND topic_id IS NOT NULL""", (batch_id,))
        return {t: i for t, i in cur.fetchall()}

    @staticmethod
    def drop_staging(cur: psycopg2.extensions.cursor, batch_id: int) -> int:
        """Returns the new stage generation."""
        # CASCADE: the part tables inherit from the stage table and go with it
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(stage_table(batch_id)))
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(dead_letter_stage_table(batch_id)))
        drop_named_task_files(cur, batch_id)  # a Kafka sink's tasks' files, with the markers
        cur.execute("DELETE FROM offsetflow.staged_parts WHERE batch_id = %s", (batch_id,))
        # markers of an attempt still running (a zombie) are refused from now on
        cur.execute("UPDATE offsetflow.batches SET stage_generation = stage_generation + 1 "
                    "WHERE batch_id = %s RETURNING stage_generation", (batch_id,))
        row = cur.fetchone()
        assert row is not None
        return int(row[0])

    def cleanup_staging(self, task_files: str | None = None) -> list[int]:
        """Drop staged data of batches that are closed (committed, abandoned) or gone, and
        in `task_files` (a Kafka sink's `sink.task_files`) every file of this ledger's
        committed or abandoned batches (`sweep_task_files`, after the stage: it refuses,
        removing nothing, where another ledger shares this one's identity)."""
        dropped = self._cleanup_stage()
        if task_files is not None:
            with self.transaction() as cur:
                swept = sweep_task_files(cur, task_files)
            if swept:
                log.info("%d task files of closed batches removed from %s", len(swept),
                         task_files)
        return dropped

    def _cleanup_stage(self) -> list[int]:
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
                self.drop_staging(cur, bid)
        return dropped
