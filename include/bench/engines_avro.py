"""Avro in the Confluent wire format into PostgreSQL: the benchmark's records (the same
values as `dataset.record`) as Avro on a topic of their own, the schema registered in the
stack's registry (OFFSETFLOW_SCHEMA_REGISTRY_URL) under `<topic>-value`.

  offsetflow-avro      OffsetFlow with `format.type: avro` on a warm local SparkSession (the
                       tasks decode with fastavro, writer schema by id from the registry);
  spark-builtin-avro   Spark's Kafka batch source, the 5-byte Confluent header stripped with
                       `substring` (open-source `from_avro` does not understand the framing),
                       spark-avro's `from_avro` with the one fixed writer schema, and Spark's
                       JDBC writer (as `spark-builtin`).

Both land the same columns as the JSON engines, in the same kind of table, checked the same
way (`engines.verify_and_drop`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
import urllib.request
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from confluent_kafka import Producer
from dataset import NOTE, SCHEMA, DataSet, ensure_topic
from engines import (
    JDBC_PACKAGE,
    KAFKA_PACKAGE,
    builtin_jdbc_run,
    offsetflow_config,
    timed_batch,
    verify_and_drop,
)

from offsetflow.config import parse_pipeline

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("bench.avro")

AVRO_PACKAGE = "org.apache.spark:spark-avro_2.13:{spark}"
AVRO_SCHEMA = {"type": "record", "name": "BenchEvent", "namespace": "offsetflow.bench",
               "fields": [
                   {"name": "event_id", "type": "string"},
                   {"name": "customer", "type": "string"},
                   {"name": "amount", "type": "double"},
                   {"name": "quantity", "type": "long"},
                   {"name": "created_at", "type": {"type": "long",
                                                   "logicalType": "timestamp-micros"}},
                   {"name": "note", "type": "string"}]}
AVRO_ENGINES = ("offsetflow-avro", "spark-builtin-avro")


def avro_record(i: int) -> dict[str, Any]:
    """Record i of `dataset.record`, as values."""
    return {"event_id": f"evt-{i:012d}", "customer": f"customer-{i % 50_000:06d}",
            "amount": float(f"{(i * 7919) % 100_000 / 100:.2f}"), "quantity": i % 17 + 1,
            "created_at": datetime(2026, 11, 1 + i % 28, i % 24, i % 60, (i // 60) % 60,
                                   (i % 1000) * 1000, tzinfo=UTC),
            "note": NOTE}


def register(url: str, subject: str) -> int:
    """The data set's schema under `subject` (the same id when already there)."""
    body = json.dumps({"schema": json.dumps(AVRO_SCHEMA)}).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/subjects/{subject}/versions", body,
                                 {"Content-Type": "application/vnd.schemaregistry.v1+json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(json.loads(resp.read())["id"])


def avro_topic_name(records: int, partitions: int) -> str:
    return f"offsetflow-bench-avro-{records}-{partitions}"


def ensure_avro_dataset(bootstrap: str, url: str, records: int, partitions: int) -> DataSet:
    """Produce the Avro data set unless its topic already holds exactly it."""
    topic = avro_topic_name(records, partitions)
    schema_id = register(url, f"{topic}-value")
    return ensure_topic(bootstrap, topic, records, partitions,
                        lambda t: _produce(bootstrap, t, schema_id, records, partitions))


def _produce(bootstrap: str, topic: str, schema_id: int, records: int, partitions: int) -> None:
    import fastavro

    parsed = fastavro.parse_schema(AVRO_SCHEMA)
    header = b"\x00" + schema_id.to_bytes(4, "big")
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.size": 1 << 20,
                  "queue.buffering.max.messages": 1_000_000, "enable.idempotence": True,
                  "compression.type": "none"})
    t0 = time.monotonic()
    for i in range(records):
        buf = io.BytesIO()
        buf.write(header)
        fastavro.schemaless_writer(buf, parsed, avro_record(i))
        while True:
            try:
                p.produce(topic, buf.getvalue(), key=b"evt-%012d" % i, partition=i % partitions)
                break
            except BufferError:
                p.poll(0.05)
    if p.flush(300):
        raise RuntimeError(f"data set {topic}: records were not delivered")
    log.info("produced %d Avro records to %s in %.1fs", records, topic, time.monotonic() - t0)


def offsetflow_avro_run(spark: Any, ds: DataSet, name: str, ctx: dict[str, Any]
                        ) -> dict[str, Any]:
    """Plan, read (fastavro in the tasks), stage, commit on the warm local session."""
    raw = offsetflow_config(ds, name, "OFFSETFLOW_BENCH_DSN", ctx["bootstrap"], ctx["launch"],
                            ctx["connect_url"], ctx["max_offsets_per_task"])
    raw["format"] = {"type": "avro", "schema": dict(SCHEMA),
                     "schema_registry": {"url": ctx["registry_url"]}}
    cfg = parse_pipeline(raw, f"<bench {name}>", os.environ)
    return {**timed_batch(spark, cfg, ds, ctx), **verify_and_drop(ctx["dsn"], name, ds)}


def builtin_avro_session(app: str) -> SparkSession:
    import pyspark
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    v = pyspark.__version__
    pkgs = f"{KAFKA_PACKAGE.format(spark=v)},{AVRO_PACKAGE.format(spark=v)},{JDBC_PACKAGE}"
    s = (SparkSession.builder.master("local[2]").appName(app)
         .config("spark.jars.packages", pkgs)
         .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "8").getOrCreate())
    s.sparkContext.setLogLevel("WARN")
    return s


def builtin_avro_run(spark: SparkSession, ds: DataSet, name: str, ctx: dict[str, Any]
                     ) -> dict[str, Any]:
    from pyspark.sql import functions as F
    from pyspark.sql.avro.functions import from_avro

    # the Confluent header (magic byte, 4-byte schema id) off; one fixed writer schema
    return builtin_jdbc_run(spark, ds, name, ctx, lambda value: from_avro(
        F.expr("substring(value, 6, length(value) - 5)"), json.dumps(AVRO_SCHEMA),
        {"mode": "FAILFAST"}))
