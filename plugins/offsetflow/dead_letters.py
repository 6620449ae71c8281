"""Routing staged rows to the batch's dead-letter stage (quality-gate failures)."""

from __future__ import annotations

import io
from collections.abc import Sequence

import pyarrow as pa
from psycopg2 import sql

from offsetflow.ledger import connect, dead_letter_stage_table, stage_table
from offsetflow.staging import _csv_bytes


def route_rows_to_dead_letter(dsn: str, batch_id: int, pipeline: str,
                              rows: dict[tuple[str, int, int], list[str]], stage: str,
                              stage_columns: Sequence[str]) -> int:
    """Move staged rows (by coordinates) to the dead-letter stage, in one transaction."""
    if not rows:
        return 0
    key = "key" if "key" in stage_columns else None
    value = "value" if "value" in stage_columns else None
    ts = "timestamp" if "timestamp" in stage_columns else None
    conn = connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("CREATE TEMP TABLE route (topic text, partition int, \"offset\" bigint, "
                        "error text) ON COMMIT DROP")
            buf = io.BytesIO(_csv_bytes(pa.table({
                "topic": [c[0] for c in rows], "partition": [c[1] for c in rows],
                "offset": [c[2] for c in rows],
                "error": [f"{stage}: failed " + ", ".join(errs) for errs in rows.values()]})))
            cur.copy_expert('COPY route FROM STDIN WITH (FORMAT csv)', buf)
            opt = {n: (sql.SQL("s.{}").format(sql.Identifier(n)) if n else sql.SQL("NULL"))
                   for n in ("key", "value", "timestamp")}
            cur.execute(sql.SQL(
                "INSERT INTO {dl} (pipeline, topic, partition, \"offset\", \"timestamp\", key, "
                "value, error, stage) SELECT %s, s.topic, s.partition, s.\"offset\", {ts}, "
                "{k}::bytea, {v}::bytea, r.error, %s FROM {st} s JOIN route r "
                "USING (topic, partition, \"offset\")").format(
                    dl=dead_letter_stage_table(batch_id), st=stage_table(batch_id),
                    ts=opt["timestamp"] if ts else sql.SQL("NULL"),
                    k=opt["key"] if key else sql.SQL("NULL"),
                    v=opt["value"] if value else sql.SQL("NULL")), (pipeline, stage))
            cur.execute(sql.SQL("DELETE FROM {st} s USING route r WHERE s.topic = r.topic "
                                "AND s.partition = r.partition AND s.\"offset\" = r.\"offset\"")
                        .format(st=stage_table(batch_id)))
            return int(cur.rowcount)
    finally:
        conn.close()

