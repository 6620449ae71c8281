"""What the `staged_parts` markers count, read by the driver (the tasks write them,
`offsetflow.stage.part`): the rows staged per topic/partition, in all, and the bad records
the tasks found with a sample of each partition's first."""

from __future__ import annotations

from typing import Any

import psycopg2.extensions

from offsetflow.ledger import Ledger


def bad_record_summary(ledger: Ledger, batch_id: int) -> tuple[int, list[dict[str, Any]]]:
    with ledger.transaction() as cur:
        cur.execute("""SELECT COALESCE(sum(bad_records), 0), array_agg(per_partition)
                         FROM offsetflow.staged_parts WHERE batch_id = %s AND kind = 'bad'""",
                    (batch_id,))
        row = cur.fetchone()
    assert row is not None
    samples = [s for pp in (row[1] or []) if pp for s in pp.get("sample", [])]
    samples.sort(key=lambda s: (s["topic"], s["partition"], s["offset"]))
    return int(row[0]), samples


def task_bad_records(cur: psycopg2.extensions.cursor, batch_id: int) -> int:
    cur.execute("""SELECT COALESCE(sum(bad_records), 0) FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'bad'""", (batch_id,))
    row = cur.fetchone()
    return int(row[0]) if row else 0


def staged_per_range(cur: psycopg2.extensions.cursor, batch_id: int) -> dict[str, int]:
    """Rows per topic/partition as the tasks counted them when staging."""
    cur.execute("""SELECT per_partition FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows'""", (batch_id,))
    per_range: dict[str, int] = {}
    for (per_tp,) in cur.fetchall():
        for tp, (n, _lo, _hi) in (per_tp or {}).items():
            per_range[tp] = per_range.get(tp, 0) + int(n)
    return per_range


def staged_rows(cur: psycopg2.extensions.cursor, batch_id: int) -> int:
    cur.execute("""SELECT COALESCE(sum(rows_staged), 0) FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows'""", (batch_id,))
    row = cur.fetchone()
    return int(row[0]) if row else 0


def staged_schema_ids(cur: psycopg2.extensions.cursor, batch_id: int
                      ) -> dict[str, dict[str, list[int]]]:
    """The writer schema ids of the batch's staged rows, merged over its markers: topic ->
    schema id (as text) -> [partition, offset] of its first record (the lowest offset;
    across partitions, the lowest partition's). Empty when no marker names any."""
    cur.execute("""SELECT schema_ids FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows' AND schema_ids IS NOT NULL""",
                (batch_id,))
    out: dict[str, dict[str, list[int]]] = {}
    for (per_tp,) in cur.fetchall():
        for tp, ids in (per_tp or {}).items():
            topic, _, p = tp.rpartition("/")
            mine = out.setdefault(topic, {})
            for sid, first in ids.items():
                at = [int(p), int(first)]
                if sid not in mine or at < mine[sid]:
                    mine[sid] = at
    return out
