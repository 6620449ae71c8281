"""A/B of the Kafka sink's record path without Spark or the broker (issue 32, task files):
the CPU seconds per process of getting the bench's staged rows from the tasks to the
driver's produce loop, for the three candidates, interleaved:

  stage   today: the task COPYs its rows (binary, `offsetflow.stage.pgcopy`) into an UNLOGGED
          stage part; the driver reads key/value/headers/timestamp back through a server-side
          cursor (`prefetched`, PostgreSQL building each value with `row_to_json`, the sink's
          own `parts_select_sql` under `OUTPUT_SETTINGS`);
  files   candidate a: the task builds the finished records (Arrow kernels,
          `offsetflow.sinks.kafka.values.finished_records`) and writes them (topic,
          partition, offset, key, value, headers, timestamp) to an Arrow IPC task file;
          the driver reads the file;
  binary  candidate b: the task builds the same values and COPYs the finished records into a
          stage part; the driver reads them with `COPY ... TO STDOUT (FORMAT binary)`,
          parsed in Python.

The produce loop itself (the same in all three) is not run: each record is handed to a
no-op. CPU: the task's and the driver's Python (this process, `time.process_time`, split
by side) and the PostgreSQL backend serving each side (/proc/<pid>/stat of
`pg_backend_pid()`). The data set is the bench's (`dataset.record`: 6 typed fields).

    python include/bench/kafka_files_ab.py [--records 200000] [--runs 3] [--dir /tmp/x]

Needs PostgreSQL of the stack (`source .stack/env.sh`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow as pa
import pyarrow.ipc as ipc
from dataset import record
from psycopg2 import sql

from offsetflow.sinks.kafka.form import OUTPUT_SETTINGS, parts_select_sql, record_key
from offsetflow.sinks.kafka.stage import prefetched
from offsetflow.sinks.kafka.values import finished_records
from offsetflow.stage import pgcopy

PAYLOAD = [("event_id", "text"), ("customer", "text"), ("amount", "double precision"),
           ("quantity", "bigint"), ("created_at", "timestamptz"), ("note", "text")]
STAGE = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
         ("timestamp", "timestamptz"), ("timestamp_type", "integer"), ("key", "bytea"),
         ("value", "bytea"), ("headers", "jsonb"), *PAYLOAD]
FINISHED = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
            ("key", "bytea"), ("value", "bytea"), ("headers", "jsonb"), ("ts", "bigint")]
HZ = os.sysconf("SC_CLK_TCK")


def batches(n: int, per: int = 10_000) -> list[pa.RecordBatch]:
    """The bench's records as a task hands them to the stage (parsed, typed)."""
    out = []
    for lo in range(0, n, per):
        ids = range(lo, min(n, lo + per))
        rows = [json.loads(record(i)) for i in ids]
        ts = pa.array([1_790_000_000_000_000 + i * 1000 for i in ids], pa.timestamp("us", "UTC"))
        cols = {
            "topic": pa.array(["src"] * len(ids)), "partition": pa.array([0] * len(ids),
                                                                          pa.int32()),
            "offset": pa.array(list(ids), pa.int64()), "timestamp": ts,
            "timestamp_type": pa.array([0] * len(ids), pa.int32()),
            "key": pa.array([f"k{i % 50_000}".encode() for i in ids], pa.binary()),
            "value": pa.array([record(i) for i in ids], pa.binary()),
            "headers": pa.array([None] * len(ids), pa.string()),
            "event_id": pa.array([r["event_id"] for r in rows]),
            "customer": pa.array([r["customer"] for r in rows]),
            "amount": pa.array([r["amount"] for r in rows], pa.float64()),
            "quantity": pa.array([r["quantity"] for r in rows], pa.int64()),
            "created_at": pa.array([datetime.fromisoformat(r["created_at"]) for r in rows],
                                   pa.timestamp("us", "UTC")),
            "note": pa.array([r["note"] for r in rows]),
        }
        out.append(pa.RecordBatch.from_pydict(cols))
    return out


def pg_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        s = f.read().rsplit(")", 1)[1].split()
    return (int(s[11]) + int(s[12])) / HZ


class Side:
    """A connection and the CPU of its backend and of this process while it works."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg2.connect(dsn)
        with self.conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            self.pid = int(cur.fetchone()[0])  # type: ignore[index]
        self.py = self.pg = 0.0

    def __enter__(self) -> Side:
        self._py, self._pg = time.process_time(), pg_cpu(self.pid)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.py += time.process_time() - self._py
        self.pg += pg_cpu(self.pid) - self._pg


def ddl(name: str, cols: list[tuple[str, str]]) -> sql.Composed:
    return sql.SQL("DROP TABLE IF EXISTS {n}; CREATE UNLOGGED TABLE {n} ({c})").format(
        n=sql.Identifier(name), c=sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t)) for c, t in cols))


def copy_in(cur: Any, name: str, cols: list[tuple[str, str]], data: bytes) -> None:
    cur.copy_expert(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT binary)").format(
        sql.Identifier(name), sql.SQL(", ").join(sql.Identifier(c) for c, _ in cols)),
        io.BytesIO(data))


def sink_cfg() -> Any:
    class S:  # the attributes `parts_select_sql` reads of a KafkaSinkConfig
        value_format = "json"
        value_columns: tuple[str, ...] = ()
        key_column = None
        headers = "carry"
    return S()


def finished(b: pa.RecordBatch) -> pa.RecordBatch:
    """The records as the produce loop needs them, built in the task."""
    fb = finished_records(sink_cfg(), dict(STAGE), b)  # type: ignore[arg-type]
    assert fb is not None
    return fb


def run_stage(data: list[pa.RecordBatch], task: Side, drv: Side, n: int) -> int:
    with task, task.conn.cursor() as cur:
        cur.execute(ddl("ab_stage", STAGE))
        for b in data:
            copy_in(cur, "ab_stage", STAGE, pgcopy.encode(b, [t for _, t in STAGE]) or b"")
        task.conn.commit()
    got = 0
    with drv, drv.conn.cursor() as cur:
        cur.execute(OUTPUT_SETTINGS)
        cur.execute("SET LOCAL jit = off")
        q = parts_select_sql(sink_cfg(), dict(STAGE), [(sql.Identifier("ab_stage"), None)])
        for chunk in prefetched(drv.conn, "ab_cursor", q, 20_000):
            for _t, _p, _o, key, value, _h, _ts in chunk:
                record_key(key)
                got += value is not None
        drv.conn.rollback()
    return got


def run_files(data: list[pa.RecordBatch], task: Side, drv: Side, path: Path) -> int:
    with task, pa.OSFile(str(path), "wb") as f:
        w = None
        for b in data:
            fb = finished(b)
            if w is None:
                w = ipc.new_file(f, fb.schema)
            w.write_batch(fb)
        assert w is not None
        w.close()
    got = 0
    with drv, pa.memory_map(str(path)) as f:
        r = ipc.open_file(f)
        for i in range(r.num_record_batches):
            b = r.get_batch(i)
            cols = [b.column(c).to_pylist() for c in ("topic", "partition", "offset",
                                                      "key", "value", "headers", "ts")]
            for _t, _p, _o, _key, value, _h, _ts in zip(*cols, strict=True):
                got += value is not None
    path.unlink()
    return got


def run_binary(data: list[pa.RecordBatch], task: Side, drv: Side) -> int:
    with task, task.conn.cursor() as cur:
        cur.execute(ddl("ab_finished", FINISHED))
        for b in data:
            fb = finished(b)
            copy_in(cur, "ab_finished", FINISHED,
                    pgcopy.encode(fb, [t for _, t in FINISHED]) or b"")
        task.conn.commit()
    got = 0
    with drv, drv.conn.cursor() as cur:
        buf = io.BytesIO()
        cur.copy_expert("COPY ab_finished TO STDOUT (FORMAT binary)", buf)
        got = _parse_binary(buf.getbuffer())
        drv.conn.rollback()
    return got


def _parse_binary(mv: memoryview) -> int:
    """Walk a binary COPY, field by field, as a produce loop would need (bytes per field)."""
    i32, i16 = struct.Struct(">i"), struct.Struct(">h")
    pos = 19
    got = 0
    data = bytes(mv)
    while True:
        (nf,) = i16.unpack_from(data, pos)
        pos += 2
        if nf == -1:
            return got
        fields: list[bytes | None] = []
        for _ in range(nf):
            (ln,) = i32.unpack_from(data, pos)
            pos += 4
            if ln < 0:
                fields.append(None)
            else:
                fields.append(data[pos:pos + ln])
                pos += ln
        got += fields[4] is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--modes", default="stage,files,binary")
    args = ap.parse_args(argv)
    dsn = os.environ["OFFSETFLOW_PG_DSN"]
    data = batches(args.records)
    modes = args.modes.split(",")
    res: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    path = Path(args.dir) / f"kafka-files-ab-{os.getpid()}.arrow"
    for i in range(args.runs + 1):  # round 0 warms up
        for m in (modes if i % 2 else modes[::-1]):
            task, drv = Side(dsn), Side(dsn)
            t = time.monotonic()
            got = (run_stage(data, task, drv, args.records) if m == "stage" else
                   run_files(data, task, drv, path) if m == "files" else
                   run_binary(data, task, drv))
            wall = time.monotonic() - t
            assert got == args.records, (m, got)
            row = {"task_py": task.py, "task_pg": task.pg, "driver_py": drv.py,
                   "driver_pg": drv.pg, "wall": wall}
            row["total"] = task.py + task.pg + drv.py + drv.pg
            print(m, "(warm-up)" if i == 0 else "", {k: round(v, 3) for k, v in row.items()},
                  "load", os.getloadavg()[0], flush=True)
            if i:
                res[m].append(row)
            task.conn.close()
            drv.conn.close()
    keys = ["task_py", "task_pg", "driver_py", "driver_pg", "total", "wall"]
    print(f"{args.records} records, median of {args.runs} (CPU s)" + "".join(
        f"{m:>10}" for m in modes))
    for k in keys:
        print(f"{k:<34}" + "".join(f"{statistics.median(r[k] for r in res[m]):>10.3f}"
                                   for m in modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
