"""The machine's floor on the bench's rows: what moving them costs with nothing else done.

  source-floor  one confluent-kafka consumer assigned to every range, reading them to their
                end without parsing (no JSON, no Arrow): Kafka and the client alone;
  sink-floor    binary COPY of the same rows, encoded beforehand (not timed), straight into
                a target with its unique index on (topic, partition, offset), one
                transaction: PostgreSQL alone.

OffsetFlow's time is reported as a multiple of the larger of the two (`report.floor_goal`):
neither floor can be beaten by a pipeline that both reads and writes the rows.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg2
import pyarrow as pa
from confluent_kafka import Consumer, TopicPartition
from dataset import SCHEMA, DataSet
from engines import BENCH_SCHEMA, TARGET_COLUMNS, create_target, verify_and_drop
from psycopg2 import sql

from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.source import deserialize_json
from offsetflow.stage import binary_encoder

PARTITION_EOF = -191
CHUNK_ROWS = 20_000


def _consumer(ds: DataSet, bootstrap: str) -> Consumer:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "offsetflow-bench-floor",
                  "enable.auto.commit": False, "auto.offset.reset": "error",
                  "isolation.level": "read_committed", "enable.partition.eof": True})
    c.assign([TopicPartition(r.topic, r.partition, r.from_offset) for r in ds.ranges
              if not r.is_empty])
    return c


def source_floor_run(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Read every range once with one consumer, touching each record only to see where its
    partition ends."""
    t0 = time.perf_counter()
    ends = {r.partition: r.until_offset for r in ds.ranges if not r.is_empty}
    consumer = _consumer(ds, ctx["bootstrap"])
    records = nbytes = 0
    try:
        while ends:
            # never more than are left: consume() would wait out its timeout for the rest
            for m in consumer.consume(max(1, min(10_000, ds.records - records)), timeout=1.0):
                err = m.error()
                p = m.partition()
                if err is not None:
                    if err.code() != PARTITION_EOF:
                        raise RuntimeError(f"{ds.topic}[{p}]: {err}")
                    if p in ends and m.offset() >= ends[p]:
                        del ends[p]
                    continue
                off = m.offset()
                end = ends.get(p)
                if end is None or off is None or off >= end:
                    continue
                records += 1
                nbytes += len(m.value() or b"")
                if off + 1 >= end:
                    del ends[p]
    finally:
        consumer.close()
    wall = time.perf_counter() - t0
    if records != ds.records:
        raise AssertionError(f"source floor read {records} records, not {ds.records}")
    return {"wall_s": wall, "window": (t0, t0 + wall), "stages": {"read_s": round(wall, 3)},
            "verified_rows": records,
            "value_mb": round(nbytes / 1e6, 1)}


def _chunks(ds: DataSet, bootstrap: str) -> Iterator[pa.RecordBatch]:
    """The data set's rows as the target holds them, `CHUNK_ROWS` at a time (untimed)."""
    ends = {r.partition: r.until_offset for r in ds.ranges if not r.is_empty}
    consumer = _consumer(ds, bootstrap)
    try:
        while ends:
            cols: dict[str, list[Any]] = {k: [] for k in ("partition", "offset", "timestamp",
                                                          "key", "value")}
            while ends and len(cols["offset"]) < CHUNK_ROWS:
                for m in consumer.consume(10_000, timeout=1.0):
                    p, off = m.partition(), m.offset()
                    if off is None or m.error() is not None or p not in ends \
                            or off >= ends[p]:
                        if m.error() is not None and p in ends and (off or 0) >= ends[p]:
                            del ends[p]
                        continue
                    cols["partition"].append(p)
                    cols["offset"].append(off)
                    cols["timestamp"].append(m.timestamp()[1] * 1000)
                    cols["key"].append(m.key())
                    cols["value"].append(m.value())
                    if off + 1 >= ends[p]:
                        del ends[p]
            n = len(cols["offset"])
            if not n:
                continue
            typed, bad, _ = deserialize_json(cols["value"], SCHEMA)
            assert not bad, bad[:1]
            yield pa.RecordBatch.from_arrays([
                pa.array([ds.topic] * n, pa.string()),
                pa.array(cols["partition"], pa.int32()),
                pa.array(cols["offset"], pa.int64()),
                pa.array(cols["timestamp"], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
                pa.array([1] * n, pa.int32()),
                pa.array(cols["key"], pa.binary()),
                pa.array(cols["value"], pa.binary()),
                pa.nulls(n, pa.string()),
                *(c.combine_chunks() for c in typed.columns),
                pa.array(np.zeros(n, dtype=np.int64)),
            ], names=[*(c for c, _ in TARGET_COLUMNS), LINEAGE_COLUMN])
    finally:
        consumer.close()


def sink_floor_run(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Binary COPY of the pre-encoded rows into a fresh target with its unique index."""
    encode = binary_encoder([t for _, t in TARGET_COLUMNS] + ["bigint"])
    payloads = []
    for b in _chunks(ds, ctx["bootstrap"]):
        fmt, data = encode(b)
        assert fmt == "binary"
        payloads.append(data)
    create_target(ctx["dsn"], name)
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in [*(c for c, _ in TARGET_COLUMNS),
                                                         LINEAGE_COLUMN])
    copy = sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT binary)").format(
        sql.Identifier(BENCH_SCHEMA, name), cols)
    conn = psycopg2.connect(ctx["dsn"])
    try:
        t0 = time.perf_counter()
        with conn.cursor() as cur:
            for data in payloads:
                cur.copy_expert(copy, io.BytesIO(data))
        t = time.perf_counter()
        conn.commit()
        commit_s = time.perf_counter() - t
        wall = time.perf_counter() - t0
    finally:
        conn.close()
    return {"wall_s": wall, "window": (t0, t0 + wall),
            "stages": {"copy_s": round(wall - commit_s, 3),
                                       "commit_s": round(commit_s, 3)},
            **verify_and_drop(ctx["dsn"], name, ds)}
