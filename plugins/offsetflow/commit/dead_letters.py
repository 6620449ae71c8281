"""Dead letters the commit writes: staged rows that must not reach the target (quality-gate
failures, upsert rows without a key, tombstones by policy). Every function runs on the
commit's cursor, so routing is part of the commit: a rolled-back commit routes nothing and
its retry routes the same rows again, once."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import psycopg2.extensions
import pyarrow as pa
from psycopg2 import sql

from offsetflow.commit.tables import LINEAGE_COLUMN
from offsetflow.ledger import Batch, qualified
from offsetflow.stage import csv_bytes

Coordinate = tuple[str, int, int]


def _optional(columns: Sequence[str], name: str, cast: str = "") -> sql.Composable:
    """A stage column, or NULL when the stage has none (a transform dropped it)."""
    if name not in columns:
        return sql.SQL("NULL")
    return sql.SQL("s.{}{}").format(sql.Identifier(name), sql.SQL(cast))


def dead_letters_from(cur: psycopg2.extensions.cursor, batch: Batch, dead_letter_table: str,
                      source: sql.Composable, columns: Sequence[str], where: sql.Composable,
                      error: sql.Composable, stage: str) -> int:
    """Copy the rows of `source` (aliased `s`) matching `where` into the dead-letter table
    with their coordinates, `error` and `stage`. Returns how many."""
    cur.execute(sql.SQL(
        "INSERT INTO {dl} (pipeline, topic, partition, \"offset\", \"timestamp\", key, value, "
        "error, stage, {lin}) SELECT %s, s.topic, s.partition, s.\"offset\", {ts}, {k}, {v}, "
        "{err}, %s, %s FROM {src} WHERE {where}").format(
            dl=qualified(dead_letter_table), lin=sql.Identifier(LINEAGE_COLUMN),
            ts=_optional(columns, "timestamp"), k=_optional(columns, "key", "::bytea"),
            v=_optional(columns, "value", "::bytea"), err=error, src=source, where=where),
        (batch.pipeline, stage, batch.batch_id))
    return int(cur.rowcount)


def route_quality_failures(cur: psycopg2.extensions.cursor, batch: Batch,
                           dead_letter_table: str, stage: sql.Composable,
                           rows: Mapping[Coordinate, list[str]], columns: Sequence[str],
                           prefix: str = "quality: failed ", label: str = "quality") -> int:
    """Move the rows that broke the quality suite (by coordinates) from the stage to the
    dead-letter table, inside the commit (their error `prefix` + what they broke; the
    dead letters' stage `label`: another check of the commit's may route its own)."""
    if not rows:
        return 0
    cur.execute("CREATE TEMP TABLE IF NOT EXISTS offsetflow_route (topic text, "
                "partition int, \"offset\" bigint, error text) ON COMMIT DROP")
    cur.execute("TRUNCATE offsetflow_route")
    buf = io.BytesIO(csv_bytes(pa.table({
        "topic": [c[0] for c in rows], "partition": [c[1] for c in rows],
        "offset": [c[2] for c in rows],
        "error": [prefix + ", ".join(errs) for errs in rows.values()]})))
    cur.copy_expert("COPY offsetflow_route FROM STDIN WITH (FORMAT csv)", buf)
    routed = dead_letters_from(
        cur, batch, dead_letter_table,
        sql.SQL("{} s JOIN offsetflow_route r USING (topic, partition, \"offset\")").format(
            stage), columns, sql.SQL("true"), sql.SQL("r.error"), label)
    cur.execute(sql.SQL("DELETE FROM {st} s USING offsetflow_route r WHERE s.topic = r.topic "
                        "AND s.partition = r.partition AND s.\"offset\" = r.\"offset\"")
                .format(st=stage))
    return routed
