"""Dropping staged data so the next attempt stages it again from Kafka: after a commit
refused a stage that lost rows, and before a transform run whose partitioning differs from
the one its earlier attempts staged under (their part numbers would mean other rows)."""

from __future__ import annotations

import logging

from psycopg2 import sql

from offsetflow.ledger import (
    Ledger,
    connect,
    dead_letter_stage_table,
    stage_part_table,
    stage_table,
)

log = logging.getLogger(__name__)


def forget_parts(dsn: str, batch_id: int, parts: list[int] | None) -> None:
    """After a refused commit rolled back: drop the named parts' markers and rows (None:
    the whole stage, bad records included), so the next attempt's tasks stage them again
    from Kafka. A batch with bad records is always dropped whole: the fused path's dead
    letters are not kept per part, and a re-staged part would write its own again."""
    conn = connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            if parts is not None:
                cur.execute("SELECT EXISTS (SELECT 1 FROM offsetflow.staged_parts "
                            "WHERE batch_id = %s AND kind = 'bad')", (batch_id,))
                found = cur.fetchone()
                if found and found[0]:
                    parts = None
            if parts is None:
                cur.execute("DELETE FROM offsetflow.staged_parts WHERE batch_id = %s",
                            (batch_id,))
                cur.execute(sql.SQL("TRUNCATE {}, {}").format(
                    stage_table(batch_id), dead_letter_stage_table(batch_id)))
            else:
                cur.execute("DELETE FROM offsetflow.staged_parts WHERE batch_id = %s "
                            "AND kind = 'rows' AND part = ANY(%s)", (batch_id, parts))
                for part in parts:
                    cur.execute(sql.SQL("TRUNCATE {}").format(stage_part_table(batch_id, part)))
    finally:
        conn.close()
    log.warning("batch %d: staged part(s) %s had lost rows and were dropped; the next run "
                "re-stages them", batch_id, "all" if parts is None else parts)


def claim_stage_layout(ledger: Ledger, batch_id: int, layout: str) -> bool:
    """Before staging on the transform path: parts are numbered by the Spark partitions of
    the transform's output, so an earlier attempt's markers only mean something under the
    same layout. A different (or unrecorded) one drops earlier staging, in one transaction
    with recording the new layout. Returns whether staging was dropped."""
    with ledger.transaction() as cur:
        cur.execute("SELECT stage_layout FROM offsetflow.batches WHERE batch_id = %s "
                    "FOR UPDATE", (batch_id,))
        row = cur.fetchone()
        if row is None or row[0] == layout:
            return False
        cur.execute("SELECT EXISTS (SELECT 1 FROM offsetflow.staged_parts "
                    "WHERE batch_id = %s)", (batch_id,))
        found = cur.fetchone()
        staged = bool(found and found[0])
        if staged:
            ledger._drop_staging(cur, batch_id)
            log.warning("batch %d: the transform's partitioning changed (%s -> %s); staged "
                        "data of earlier attempts was dropped and the ranges are read again",
                        batch_id, row[0] or "unrecorded", layout)
        cur.execute("UPDATE offsetflow.batches SET stage_layout = %s WHERE batch_id = %s",
                    (layout, batch_id))
        return staged
