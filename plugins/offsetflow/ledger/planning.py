"""The ledger's planning statements: the per-pipeline planning lock, the positions and open
batches a plan starts from, and the rows a plan writes (its batch and ranges, new
partitions' positions, data-loss gaps). Each runs in the planning transaction's cursor
(`offsetflow.plan.planning`), so a plan is written whole or not at all; `Ledger` has them as
methods.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras

from offsetflow.errors import LockTimeoutError
from offsetflow.ledger.batch import KINDS, OPEN_STATUSES
from offsetflow.ledger.migrate import refuse_newer_ledger
from offsetflow.ledger.timing import Due
from offsetflow.ranges import DataLossGap, OffsetRange, TopicPartition


class PlanningQueries:
    """Statements on a cursor the caller's transaction owns (no connection of their own)."""

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

    def insert_batch(self, cur: psycopg2.extensions.cursor, *, pipeline: str, kind: str,
                     ranges: Sequence[OffsetRange], target_table: str,
                     config_fingerprint: str, split_offsets: int, started_by: str,
                     moves_positions: bool = True, params: dict[str, Any] | None = None,
                     topic_ids: Mapping[str, str] | None = None,
                     expected_positions: Mapping[TopicPartition, int] | None = None,
                     due: Due | None = None,
                     rate: Mapping[str, Any] | None = None) -> int:
        """`config_fingerprint` and `split_offsets` are what `config_drift` compares a run's
        config with; a batch without them would look like one planned before 0003.
        `expected_positions`: the committed position a range's commit must find when it is
        not the range's `from_offset` (a `data_loss: continue` gap); the fence uses it.
        `due`: when the batch was due (`offsetflow.ledger.timing`); None: now, the plan.
        `rate`: how an adaptive rate sized the batch (`offsetflow.plan.rate`)."""
        if kind not in KINDS:
            raise ValueError(f"unknown batch kind {kind!r}")
        cur.execute("""INSERT INTO offsetflow.batches
                         (pipeline, kind, status, target_table, moves_positions,
                          config_fingerprint, started_by, params, split_offsets, due_at,
                          due_source, rate)
                       VALUES (%s, %s, 'planned', %s, %s, %s, %s, %s, %s,
                               COALESCE(%s, now()), %s, %s) RETURNING batch_id""",
                    (pipeline, kind, target_table, moves_positions, config_fingerprint,
                     started_by, json.dumps(params or {}), split_offsets,
                     due.at if due else None, due.source if due else "plan",
                     json.dumps(rate) if rate is not None else None))
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

    def rate_inputs(self, cur: psycopg2.extensions.cursor, pipeline: str
                    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """What adaptive sizing starts from: the rate record of the newest scheduled batch
        that has one, and the newest scheduled batches that were not abandoned (newest
        first: batch_id, status, offsets, planned_at, started_at, finished_at, timings,
        due_at, due_source)."""
        cur.execute("""SELECT rate FROM offsetflow.batches
                        WHERE pipeline = %s AND kind = 'scheduled' AND rate IS NOT NULL
                        ORDER BY batch_id DESC LIMIT 1""", (pipeline,))
        row = cur.fetchone()
        cur.execute("""SELECT b.batch_id, b.status, b.planned_at, b.started_at, b.finished_at,
                              b.timings, b.due_at, b.due_source,
                              (SELECT COALESCE(sum(until_offset - from_offset), 0)
                                 FROM offsetflow.batch_ranges r
                                WHERE r.batch_id = b.batch_id)
                         FROM offsetflow.batches b
                        WHERE b.pipeline = %s AND b.kind = 'scheduled'
                          AND b.status <> 'abandoned'
                        ORDER BY b.batch_id DESC LIMIT 2""", (pipeline,))
        cols = ("batch_id", "status", "planned_at", "started_at", "finished_at", "timings",
                "due_at", "due_source", "offsets")
        return (row[0] if row else None), [dict(zip(cols, r, strict=True))
                                           for r in cur.fetchall()]

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
