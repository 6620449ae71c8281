"""Kafka -> Kafka: the same offset ranges parsed and written to a fresh output topic.

  offsetflow-kafka     OffsetFlow with `sink.type: kafka` as configured by default (on a
                       local master `sink.task_files: auto`: the tasks write task files, Arrow
                       IPC, the driver produces from them in one producer transaction per
                       batch with the source offsets in it: exactly-once) on a warm local
                       SparkSession; on the cluster (offsetflow-kafka-cluster) the default
                       stages in PostgreSQL;
  offsetflow-kafka-stage  the same with `sink.task_files: off`: read + stage in PostgreSQL,
                       the driver produces from the stage;
  offsetflow-kafka-cluster-files  the cluster with `sink.task_files` set to one directory of
                       this host, which its workers share;
  spark-builtin-kafka  Spark's Kafka batch source -> from_json -> to_json -> Spark's Kafka
                       sink (at-least-once: a retried task writes its records again).

Both write the parsed fields as a JSON value with the source key. Every run gets a fresh
output topic with the source's partition count, is checked (read_committed record count)
and the topic is deleted afterwards.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError
from confluent_kafka import TopicPartition as KTopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from dataset import DataSet
from engines import ROOT, builtin_kafka_frame, offsetflow_config, spark_ddl, timed_batch

from offsetflow.config import parse_pipeline

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(timeout=60)


def verify_and_delete(bootstrap: str, topic: str, ds: DataSet) -> dict[str, Any]:
    """Count what read_committed consumers see, then delete the topic."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-verify-{topic}",
                  "enable.auto.commit": False, "isolation.level": "read_committed",
                  "enable.partition.eof": True})
    try:
        c.assign([KTopicPartition(topic, p, OFFSET_BEGINNING) for p in range(ds.partitions)])
        pending, count = set(range(ds.partitions)), 0
        deadline = time.monotonic() + 600
        while pending and time.monotonic() < deadline:
            for m in c.consume(10_000, 1.0):
                err = m.error()
                if err is None:
                    count += 1
                elif err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(int(m.partition() or 0))
                else:
                    raise RuntimeError(f"verifying {topic}: {err}")
    finally:
        c.close()
    if count != ds.records:
        raise AssertionError(f"{topic} holds {count} records, expected {ds.records}")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(timeout=60)
    return {"verified_records": count}


def offsetflow_kafka_run(spark: SparkSession, ds: DataSet, name: str, ctx: dict[str, Any],
                         task_files: str | None = None) -> dict[str, Any]:
    """`task_files`: None the default (`auto`), "off", or "shared" (one directory of this
    host, set in `sink.task_files`)."""
    out = f"bench-out-{name.replace('_', '-')}"
    _create_topic(ctx["bootstrap"], out, ds.partitions)
    raw = offsetflow_config(ds, name, "OFFSETFLOW_BENCH_DSN", ctx["bootstrap"], "submit",
                            ctx["connect_url"], ctx["max_offsets_per_task"])
    raw["sink"] = {"type": "kafka", "connection": raw["sink"]["connection"], "topic": out,
                   "headers": "none"}
    if task_files == "shared":  # one directory on this host: the cluster's workers share it
        directory = ROOT / ".stack" / "bench-task-files"
        directory.mkdir(parents=True, exist_ok=True)
        raw["sink"]["task_files"] = str(directory)
    elif task_files is not None:
        raw["sink"]["task_files"] = task_files
    cfg = parse_pipeline(raw, f"<bench {name}>", os.environ)
    return {**timed_batch(spark, cfg, ds, ctx), **verify_and_delete(ctx["bootstrap"], out, ds)}


def builtin_kafka_run(spark: SparkSession, ds: DataSet, name: str, ctx: dict[str, Any]
                      ) -> dict[str, Any]:
    from pyspark.sql import functions as F

    out = f"bench-out-{name.replace('_', '-')}"
    _create_topic(ctx["bootstrap"], out, ds.partitions)
    t0 = time.perf_counter()
    df = builtin_kafka_frame(spark, ds, ctx, headers=False)
    parsed = df.select("key", F.from_json(F.col("value").cast("string"), spark_ddl())
                       .alias("d"))
    (parsed.select("key", F.to_json(F.col("d")).alias("value"))
     .write.format("kafka")
     .option("kafka.bootstrap.servers", ctx["bootstrap"])
     .option("kafka.linger.ms", "20")
     .option("topic", out).save())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "window": (t0, t0 + wall),
            "stages": {"plan_s": 0.0, "spark_start_s": 0.0, "read_parse_write_s": round(wall, 3)},
            **verify_and_delete(ctx["bootstrap"], out, ds)}
