"""Bad records on their way from a Spark task into the batch's dead-letter stage: where
they go (`BadRows`), how a marker counts them (`BadTally`), the fused path's buffer of them
(`BadBuffer`), and their COPY (`copy_dead`; keyed by coordinates for the DataFrame path's
`offsetflow.stage.part.SubrangeBad`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg2.extensions
import pyarrow as pa
from psycopg2 import sql

from offsetflow.ledger import dead_letter_stage_table
from offsetflow.stage.payload import copy_into, csv_bytes


@dataclass(frozen=True)
class BadRows:
    """Where rows PostgreSQL refuses go: always a marker naming them (so a `fail` pipeline
    fails naming the first), the rows too in the dead-letter stage under `dead_letter`."""

    pipeline: str
    write_rows: bool


# the bad-record marker chunk of rows refused at staging (a part's own chunks count from 0)
REFUSED_CHUNK = -1


@dataclass
class BadTally:
    """How many bad records a marker counts, and a sample of each Kafka partition's first
    (so the driver can fail a `fail` batch naming the first one)."""

    count: int = 0
    sample: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, rows: Sequence[dict[str, Any]]) -> None:
        self.count += len(rows)
        for r in rows:
            s = self.sample.setdefault((r["topic"], r["partition"]), [])
            if len(s) < 5:
                s.append({k: r[k] for k in ("topic", "partition", "offset", "error")})

    def mark(self, cur: psycopg2.extensions.cursor, batch_id: int, part: int,
             chunk: int) -> None:
        sample = [x for s in self.sample.values() for x in s]
        cur.execute("""UPDATE offsetflow.staged_parts SET bad_records = %s, per_partition = %s
                        WHERE batch_id=%s AND kind='bad' AND part=%s AND chunk=%s""",
                    (self.count, json.dumps({"sample": sample}), batch_id, part, chunk))


@dataclass
class BadBuffer:
    """The fused path's bad records on their way from the reader into the part's own
    transaction (`stage_rows(bad_in=...)`): one chunk's at a time."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    # the registry formats: "topic/partition" -> writer schema id -> its first offset, of
    # every record read (dead letters too), for the part's marker (`stage_rows`)
    schema_ids: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, rows: Sequence[dict[str, Any]]) -> None:
        self.rows.extend(rows)

    def take(self) -> list[dict[str, Any]]:
        out, self.rows = self.rows, []
        return out


def ensure_coordinate_index(cur: psycopg2.extensions.cursor, batch_id: int) -> None:
    """Read-side dead letters are unique by coordinates (rows refused at staging are not: a
    transform may turn one record into several rows). Created by the first task that needs
    it; the lock keeps concurrent tasks from racing on the catalog."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtext('offsetflow_dead_index'), %s)",
                (int(batch_id),))
    cur.execute(sql.SQL("""CREATE UNIQUE INDEX IF NOT EXISTS {} ON {}
                           (topic, partition, "offset") WHERE stage = 'deserialize'""").format(
        sql.Identifier(f"b{int(batch_id)}_dead_coordinates"), dead_letter_stage_table(batch_id)))


def copy_dead(cur: psycopg2.extensions.cursor, batch_id: int, pipeline: str,
               rows: Sequence[dict[str, Any]], keyed: bool = False) -> None:
    """Bad records into the dead-letter stage; `keyed`: skip those already there."""
    t = pa.table({
        "pipeline": [pipeline] * len(rows),
        "topic": [r["topic"] for r in rows],
        "partition": pa.array([r["partition"] for r in rows], pa.int32()),
        "offset": pa.array([r["offset"] for r in rows], pa.int64()),
        "timestamp": pa.array([r["timestamp"] for r in rows], pa.timestamp("us", tz="UTC")),
        "key": [_hex(r["key"]) for r in rows],
        "value": [_hex(r["value"]) for r in rows],
        "error": [r["error"] for r in rows],
        "stage": [r.get("stage", "deserialize") for r in rows],
    })
    dead = dead_letter_stage_table(batch_id)
    if not keyed:
        copy_into(cur, dead, t.schema.names, csv_bytes(t))
        return
    cur.execute(sql.SQL("CREATE TEMP TABLE offsetflow_dead_in (LIKE {}) ON COMMIT DROP")
                .format(dead))
    copy_into(cur, sql.SQL("offsetflow_dead_in"), t.schema.names, csv_bytes(t))
    cur.execute(sql.SQL("""INSERT INTO {} SELECT * FROM offsetflow_dead_in
                           ON CONFLICT (topic, partition, "offset") WHERE stage = 'deserialize'
                           DO NOTHING""").format(dead))


def _hex(b: bytes | None) -> str | None:
    return None if b is None else "\\x" + b.hex()
