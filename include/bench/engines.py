"""The three ways of moving the same offset ranges from Kafka into the same PostgreSQL table.

  offsetflow      plan + read + stage + exactly-once commit (`offsetflow.job.run_batch`), on a
                  warm local SparkSession, a warm Spark Connect server, or a cold spark-submit;
  spark-builtin   Spark's own Kafka batch source with startingOffsets/endingOffsets, from_json,
                  and Spark's JDBC writer (tuned: batchsize 10000, reWriteBatchedInserts);
  baseline        one Python process: confluent-kafka assign/consume, pyarrow JSON, binary
                  COPY straight into the target (OffsetFlow's own encoders, no Spark, no stage).

Every run writes a fresh table with the same columns and the same unique index on
(topic, partition, offset), is checked (row count, distinct coordinates, a checksum of a
parsed column), and is dropped afterwards.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psycopg2
import pyarrow as pa
import yaml
from cpu import CpuUse
from dataset import SCHEMA, DataSet, record
from psycopg2 import sql
from rss import PeakRss

from offsetflow.commit import LINEAGE_COLUMN, ensure_target
from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.ranges import OffsetRange, split_ranges
from offsetflow.source import deserialize_json
from offsetflow.stage import binary_encoder
from offsetflow.stage.metrics import read_task_metrics

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("bench.engines")

BENCH_SCHEMA = "offsetflow_bench"
ROOT = Path(__file__).resolve().parents[2]
# the target's columns, as OffsetFlow creates them (raw coordinates + declared fields)
TARGET_COLUMNS: list[tuple[str, str]] = [
    ("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
    ("timestamp", "timestamptz"), ("timestamp_type", "integer"), ("key", "bytea"),
    ("value", "bytea"), ("headers", "jsonb"), ("event_id", "text"), ("customer", "text"),
    ("amount", "double precision"), ("quantity", "bigint"), ("created_at", "timestamptz"),
    ("note", "text")]


def expected_quantity_sum(records: int) -> int:
    return sum(i % 17 + 1 for i in range(records))


def run_name(engine: str, label: str, i: int) -> str:
    return f"{engine.replace('-', '_')}_{label.lower()}_{i}_{uuid.uuid4().hex[:6]}"


# -- checks and tables ----------------------------------------------------------------
def verify_and_drop(dsn: str, table: str, ds: DataSet, keep: bool = False) -> dict[str, Any]:
    """The run counts only if the table holds each record exactly once with its payload."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            t = sql.Identifier(BENCH_SCHEMA, table)
            cur.execute(sql.SQL('SELECT count(*), count(DISTINCT (partition, "offset")), '
                                'COALESCE(sum(quantity), 0), count(*) FILTER (WHERE value IS '
                                'NULL OR event_id IS NULL) FROM {}').format(t))
            row = cur.fetchone()
            assert row is not None
            rows, distinct, qsum, nulls = (int(x) for x in row)
            if not keep:
                cur.execute(sql.SQL("DROP TABLE {}").format(t))
    finally:
        conn.close()
    want = expected_quantity_sum(ds.records)
    if rows != ds.records or distinct != ds.records or qsum != want or nulls:
        raise AssertionError(f"{table}: {rows} rows, {distinct} distinct offsets, quantity sum "
                             f"{qsum}, {nulls} null payloads; expected {ds.records} rows and "
                             f"quantity sum {want}")
    return {"verified_rows": rows}


def create_target(dsn: str, table: str) -> None:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            ensure_target(cur, f"{BENCH_SCHEMA}.{table}", TARGET_COLUMNS, "append", [])
    finally:
        conn.close()


# -- OffsetFlow -----------------------------------------------------------------------
def offsetflow_config(ds: DataSet, name: str, dsn_env: str, bootstrap: str, launch: str,
                      connect_url: str, max_offsets_per_task: int) -> dict[str, Any]:
    return {
        "name": name,
        "kafka": {"bootstrap_servers": bootstrap, "isolation_level": "read_committed"},
        "source": {"topics": [ds.topic], "starting": "earliest",
                   "max_records_per_partition": 1_000_000_000},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": f"${{{dsn_env}}}", "table": f"{BENCH_SCHEMA}.{name}",
                 "mode": "append"},
        "bad_records": "fail",
        "spark": {"master": "local[2]", "launch": launch, "connect_url": connect_url,
                  "max_offsets_per_task": max_offsets_per_task},
    }


def _plan(cfg: PipelineConfig, dsn: str, ds: DataSet) -> tuple[int, float]:
    t = time.perf_counter()
    outcome = plan_only(cfg, dsn, started_by="bench")
    plan_s = time.perf_counter() - t
    assert outcome.batch is not None, f"{cfg.name}: nothing planned"
    planned = sorted(outcome.batch.ranges, key=lambda r: r.partition)
    if tuple(planned) != tuple(ds.ranges):
        raise AssertionError(f"{cfg.name} planned {planned}, not the data set's {ds.ranges}")
    return outcome.batch.batch_id, plan_s


def offsetflow_warm_run(spark: SparkSession, ds: DataSet, name: str, ctx: dict[str, Any]
                        ) -> dict[str, Any]:
    """Plan, read, stage, commit on an already running Spark (local or Connect)."""
    raw = offsetflow_config(ds, name, "OFFSETFLOW_BENCH_DSN", ctx["bootstrap"], ctx["launch"],
                            ctx["connect_url"], ctx["max_offsets_per_task"])
    cfg = parse_pipeline(raw, f"<bench {name}>", os.environ)
    return {**timed_batch(spark, cfg, ds, ctx), **verify_and_drop(ctx["dsn"], name, ds)}


def timed_batch(spark: Any, cfg: Any, ds: DataSet, ctx: dict[str, Any]) -> dict[str, Any]:
    """One warm batch end to end (plan, read, stage, commit) with its stage timings; every
    warm OffsetFlow engine, whatever its sink, is timed the same way."""
    from offsetflow.job import run_batch

    t0 = time.perf_counter()
    batch_id, plan_s = _plan(cfg, ctx["dsn"], ds)
    report = run_batch(spark, cfg, batch_id, ctx["dsn"])
    wall = time.perf_counter() - t0
    assert report.result.status == "committed", report.result
    stages = {"plan_s": round(plan_s, 3), "spark_start_s": 0.0,
              **{k: v for k, v in report.timings.items() if k != "total_s"}}
    return {"wall_s": wall, "window": (t0, t0 + wall), "stages": stages, "batch_id": batch_id,
            "task_seconds": read_task_metrics(Path(ctx["metrics_dir"]), batch_id)}


def _submit_timings(output: str, batch_id: int) -> dict[str, float]:
    m = re.search(rf"batch {batch_id} timings (\{{.*\}})", output)
    if m is None:
        raise RuntimeError(f"spark-submit output has no timings line for batch {batch_id}")
    return {k: float(v) for k, v in json.loads(m.group(1)).items()}


def offsetflow_submit_run(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Cold: plan here, then one spark-submit (new JVM, new Python workers) per batch."""
    out = Path(ctx["out_dir"]) / "pipelines"
    out.mkdir(parents=True, exist_ok=True)
    raw = offsetflow_config(ds, name, "OFFSETFLOW_BENCH_DSN", ctx["bootstrap"], "submit",
                            ctx["connect_url"], ctx["max_offsets_per_task"])
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))  # the DSN stays an ${ENV} reference
    cfg = parse_pipeline(raw, str(path), os.environ)
    t0 = time.perf_counter()
    batch_id, plan_s = _plan(cfg, ctx["dsn"], ds)
    venv_bin = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    cmd = [f"{venv_bin}/spark-submit", "--master", "local[2]",
           "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.session.timeZone=UTC",
           str(ROOT / "spark_jobs" / "run_batch.py"), "--pipeline-file", str(path),
           "--batch-id", str(batch_id)]
    t1 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with PeakRss([proc.pid]) as rss, CpuUse([proc.pid]) as cpu:
        output, _ = proc.communicate(timeout=3600)
    submit_s = time.perf_counter() - t1
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"spark-submit of batch {batch_id} failed ({proc.returncode}):\n"
                           + output.decode(errors="replace")[-3000:])
    with Ledger(ctx["dsn"]) as ledger:
        b = ledger.get_batch(batch_id)
    assert b.status == "committed", b
    timings = _submit_timings(output.decode(errors="replace"), batch_id)
    inner = float(timings.pop("total_s"))
    # everything spark-submit spent outside run_batch: JVM, session, Python start and exit
    stages = {"plan_s": round(plan_s, 3), "spark_start_s": round(submit_s - inner, 3),
              **{k: v for k, v in timings.items() if k != "spark_start_s"}}
    return {"wall_s": wall, "stages": stages, **rss.as_dict(),
            "cpu_s": cpu.as_dict((t0, t0 + wall)), "batch_id": batch_id,
            "task_seconds": read_task_metrics(Path(ctx["metrics_dir"]), batch_id),
            **verify_and_drop(ctx["dsn"], name, ds)}


# -- Spark's built-in Kafka source -----------------------------------------------------
KAFKA_PACKAGE = "org.apache.spark:spark-sql-kafka-0-10_2.13:{spark}"
JDBC_PACKAGE = "org.postgresql:postgresql:42.7.8"


def builtin_session(app: str) -> SparkSession:
    import pyspark
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    pkgs = f"{KAFKA_PACKAGE.format(spark=pyspark.__version__)},{JDBC_PACKAGE}"
    s = (SparkSession.builder.master("local[2]").appName(app)
         .config("spark.jars.packages", pkgs)
         .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "8").getOrCreate())
    s.sparkContext.setLogLevel("WARN")
    return s


def spark_ddl() -> str:
    types = {"string": "string", "long": "bigint", "double": "double", "timestamp": "timestamp"}
    return ", ".join(f"`{k}` {types[v]}" for k, v in SCHEMA.items())


def builtin_kafka_frame(spark: SparkSession, ds: DataSet, ctx: dict[str, Any],
                        headers: bool = True) -> Any:
    """Spark's built-in Kafka source over exactly the data set's ranges (read_committed),
    in as many Spark tasks as OffsetFlow splits the ranges into: the baselines' one read."""
    tasks = len(split_ranges(ds.ranges, ctx["max_offsets_per_task"]))
    starting = {ds.topic: {str(r.partition): r.from_offset for r in ds.ranges}}
    ending = {ds.topic: {str(r.partition): r.until_offset for r in ds.ranges}}
    reader = (spark.read.format("kafka")
              .option("kafka.bootstrap.servers", ctx["bootstrap"])
              .option("kafka.isolation.level", "read_committed")
              .option("subscribe", ds.topic)
              .option("startingOffsets", json.dumps(starting))
              .option("endingOffsets", json.dumps(ending))
              .option("failOnDataLoss", "true")
              .option("minPartitions", str(tasks)))
    if headers:
        reader = reader.option("includeHeaders", "true")
    return reader.load()


def builtin_run(spark: SparkSession, ds: DataSet, name: str, ctx: dict[str, Any]
                ) -> dict[str, Any]:
    from pyspark.sql import functions as F

    return builtin_jdbc_run(spark, ds, name, ctx, lambda value: F.from_json(
        value.cast("string"), spark_ddl()))


def builtin_jdbc_run(spark: SparkSession, ds: DataSet, name: str, ctx: dict[str, Any],
                     parse: Callable[[Any], Any]) -> dict[str, Any]:
    """Spark's built-in path into PostgreSQL: the Kafka source over the data set's ranges,
    `parse(value column)` to the record's struct, JDBC append; timed, then verified. The JSON
    and Avro baselines differ only in `parse`."""
    from pyspark.sql import functions as F

    create_target(ctx["dsn"], name)
    t0 = time.perf_counter()
    df = builtin_kafka_frame(spark, ds, ctx)
    parsed = df.select(
        "topic", "partition", "offset", "timestamp",
        F.col("timestampType").alias("timestamp_type"), "key", "value",
        F.to_json("headers").alias("headers"),
        parse(F.col("value")).alias("d"),
    ).select("*", "d.*").drop("d").withColumn(LINEAGE_COLUMN, F.lit(0).cast("bigint"))
    (parsed.write.mode("append")
     .option("batchsize", 10_000).option("isolationLevel", "READ_COMMITTED")
     .jdbc(ctx["jdbc_url"], f"{BENCH_SCHEMA}.{name}",
           properties={"user": ctx["pg_user"], "password": ctx["pg_password"],
                       "driver": "org.postgresql.Driver"}))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "window": (t0, t0 + wall),
            "stages": {"plan_s": 0.0, "spark_start_s": 0.0, "read_parse_write_s": round(wall, 3)},
            **verify_and_drop(ctx["dsn"], name, ds)}


# -- the single-process baseline -------------------------------------------------------
def baseline_run(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """confluent-kafka → pyarrow JSON → binary COPY, one process, one transaction."""
    create_target(ctx["dsn"], name)
    t0 = time.perf_counter()
    st = baseline_copy(ds, name, ctx)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "window": (t0, t0 + wall),
            "stages": {k: round(v, 3) for k, v in st.items()},
            **verify_and_drop(ctx["dsn"], name, ds)}


def baseline_copy(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, float]:
    """The baseline's work on `ds.ranges` into an existing target: its stage seconds."""
    from confluent_kafka import Consumer, TopicPartition

    from offsetflow.source import KafkaMetadata

    st: dict[str, float] = {"plan_s": 0.0, "read_s": 0.0, "deserialize_s": 0.0,
                            "encode_s": 0.0, "copy_s": 0.0, "commit_s": 0.0}
    t0 = time.perf_counter()
    offs = KafkaMetadata({"bootstrap.servers": ctx["bootstrap"]}).partition_offsets(
        [(r.topic, r.partition) for r in ds.ranges])
    ends = {r.partition: r.until_offset for r in ds.ranges}
    assert all(offs[(ds.topic, p)].latest >= e for p, e in ends.items())
    st["plan_s"] = time.perf_counter() - t0
    consumer = Consumer({"bootstrap.servers": ctx["bootstrap"], "group.id": "offsetflow-bench",
                         "enable.auto.commit": False, "auto.offset.reset": "error",
                         "isolation.level": "read_committed", "enable.partition.eof": True})
    consumer.assign([TopicPartition(r.topic, r.partition, r.from_offset) for r in ds.ranges])
    conn = psycopg2.connect(ctx["dsn"])
    # the same encoder OffsetFlow's tasks use: binary COPY (raw bytea, no text parsing)
    encode = binary_encoder([t for _, t in TARGET_COLUMNS] + ["bigint"])
    collist = sql.SQL(", ").join(sql.Identifier(c) for c in [*(c for c, _ in TARGET_COLUMNS),
                                                            LINEAGE_COLUMN])
    copy_sql = {fmt: sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT {})").format(
        sql.Identifier(BENCH_SCHEMA, name), collist, sql.SQL(fmt)) for fmt in ("csv", "binary")}
    open_parts = set(ends)
    try:
        with conn.cursor() as cur:
            while open_parts:
                t = time.perf_counter()
                cols: dict[str, list[Any]] = {k: [] for k in ("partition", "offset", "timestamp",
                                                              "key", "value")}
                while open_parts and len(cols["offset"]) < 20_000:
                    for m in consumer.consume(10_000, timeout=1.0):
                        p = m.partition()
                        err = m.error()
                        off = m.offset()
                        assert p is not None and off is not None
                        if err is not None:
                            if err.code() == -191:  # _PARTITION_EOF
                                if off >= ends[p]:
                                    open_parts.discard(p)
                                continue
                            raise RuntimeError(f"{ds.topic}[{p}]: {err}")
                        if off >= ends[p]:
                            open_parts.discard(p)
                            continue
                        cols["partition"].append(p)
                        cols["offset"].append(off)
                        cols["timestamp"].append(m.timestamp()[1] * 1000)
                        cols["key"].append(m.key())
                        cols["value"].append(m.value())
                        if off + 1 >= ends[p]:
                            open_parts.discard(p)
                st["read_s"] += time.perf_counter() - t
                if not cols["offset"]:
                    continue
                t = time.perf_counter()
                typed, bad, _ = deserialize_json(cols["value"], SCHEMA)
                if bad:
                    raise RuntimeError(f"{len(bad)} bad records, first {bad[0]}")
                st["deserialize_s"] += time.perf_counter() - t
                t = time.perf_counter()
                n = len(cols["offset"])
                raw = pa.RecordBatch.from_arrays([
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
                fmt, data = encode(raw)
                st["encode_s"] += time.perf_counter() - t
                t = time.perf_counter()
                cur.copy_expert(copy_sql[fmt], io.BytesIO(data))
                st["copy_s"] += time.perf_counter() - t
        t = time.perf_counter()
        conn.commit()
        st["commit_s"] = time.perf_counter() - t
    finally:
        conn.close()
        consumer.close()
    return st


def timed_runs(engine: str, datasets: Sequence[tuple[str, DataSet, int]],
               run: Callable[[DataSet, str], dict[str, Any]], roots: Sequence[int] = ()
               ) -> list[dict[str, Any]]:
    """Run `run` n times per (label, data set, n); each result gets its own peak RSS."""
    results = []
    for label, ds, n in datasets:
        for i in range(n):
            name = run_name(engine, label, i)
            with PeakRss(roots or [os.getpid()]) as rss, \
                    CpuUse(roots or [os.getpid()]) as cpu:
                res = run(ds, name)
            # a cold run measures its own process tree
            res = {**rss.as_dict(), "cpu_s": cpu.as_dict(res.pop("window", None)), **res}
            res.update({"engine": engine, "label": label, "run": i, "records": ds.records,
                        "partitions": ds.partitions,
                        "records_per_s": round(ds.records / res["wall_s"], 1),
                        "wall_s": round(res["wall_s"], 3)})
            log.info("%s %s run %d: %d records in %.2fs = %.0f records/s (peak RSS %.0f MB)",
                     engine, label, i + 1, ds.records, res["wall_s"], res["records_per_s"],
                     res["peak_rss_mb"])
            results.append(res)
    return results


def dataset_from_dict(d: dict[str, Any]) -> DataSet:
    return DataSet(d["topic"], d["records"], d["partitions"],
                   tuple(OffsetRange.from_dict(r) for r in d["ranges"]))


def dataset_to_dict(ds: DataSet) -> dict[str, Any]:
    return {"topic": ds.topic, "records": ds.records, "partitions": ds.partitions,
            "ranges": [r.to_dict() for r in ds.ranges]}


__all__ = ["record"]
