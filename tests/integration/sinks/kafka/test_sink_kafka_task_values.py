"""What the tasks build for a Kafka sink's task files agrees with the stage path, or the
shape is left to the stage (review s39-kfiles item 11): a header key holding a NUL, column
names PostgreSQL would truncate."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tests.tooling.kafka_sink_shape import KafkaSinkShape
from tests.tooling.kafka_staging import stage_query_rows

_NUL_HEADER_JAVA = """
import org.apache.kafka.clients.producer.*;
import org.apache.kafka.common.serialization.ByteArraySerializer;
public class NulHeader {
  public static void main(String[] a) throws Exception {
    java.util.Properties p = new java.util.Properties();
    p.put("bootstrap.servers", a[0]);
    p.put("key.serializer", ByteArraySerializer.class.getName());
    p.put("value.serializer", ByteArraySerializer.class.getName());
    try (KafkaProducer<byte[], byte[]> pr = new KafkaProducer<>(p)) {
      ProducerRecord<byte[], byte[]> r = new ProducerRecord<>(a[1], 0, null,
          a[2].getBytes("UTF-8"));
      r.headers().add("k\\u0000ey", "v".getBytes("UTF-8"));
      System.out.println(pr.send(r).get().offset());
    }
  }
}
"""


def test_a_header_key_holding_a_nul_reads_the_same_on_both_paths(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source record whose header key holds a NUL on the wire (written by the Java
    client: librdkafka's producer cuts a key at its NUL): the reader (librdkafka's
    consumer) hands the key cut at the NUL ("k"), so neither the stage's jsonb nor the task
    builder ever sees a NUL there; from task files the record is produced once with that
    header, as the stage path stages it."""
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from tests.tooling.kafka_case import RECORDS, make_case
    from tests.tooling.topic_checker import read_topic

    d = tmp_path / "task-files"
    d.mkdir()
    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", str(d))
    src_java = tmp_path / "NulHeader.java"
    src_java.write_text(_NUL_HEADER_JAVA)
    libs = Path(os.environ["OFFSETFLOW_STACK_DIR"]) / "kafka" / "libs" / "*"

    def nul_header(src: str) -> None:
        subprocess.run(["java", "-cp", str(libs), str(src_java), kafka_bootstrap, src,
                        '{"event_id":"nulkey","seq":1,"amount":1.5,"checksum":"c"}'],
                       check=True, capture_output=True, timeout=120)

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path, dead_letter=True,
                     before_plan=nul_header)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    out = read_topic(kafka_bootstrap, case.out)
    got = [r for r in out if r.key == b"nulkey"]
    assert len(got) == 1 and got[0].headers.get("k") == b"v", got
    assert not [k for k in got[0].headers if "\x00" in k], got
    assert len(out) == RECORDS + 1  # the workload's committed records and this one


def test_column_names_postgresql_truncates_are_built_as_it_does_or_left_to_the_stage(
        pg_dsn: str, unique: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Value columns named beyond PostgreSQL's 63 bytes (the stage's columns, so
    row_to_json's keys, are truncated there; config and schema evolution refuse such names
    today): the driver leaves the batch to the stage, or what the task builds is
    row_to_json's byte for byte."""
    from offsetflow.config import parse_pipeline
    from offsetflow.ledger import Batch
    from offsetflow.sinks.kafka import KafkaPipelineSink
    from offsetflow.sinks.kafka.values import finished_records

    long_ascii, long_utf8 = "a" * 70, "\u00e9" * 40  # 70 bytes; 80 bytes in UTF-8
    types = {"topic": "text", "partition": "integer", "offset": "bigint",
             "timestamp": "timestamptz", "key": "bytea", "value": "bytea",
             "headers": "jsonb", "id": "bigint", long_ascii: "bigint", long_utf8: "text"}
    n = 2
    batch = pa.RecordBatch.from_pydict({
        "topic": ["src"] * n, "partition": pa.array([0] * n, pa.int32()),
        "offset": pa.array(range(n), pa.int64()),
        "timestamp": pa.array([1_700_000_000_000_000] * n, pa.int64()).cast(
            pa.timestamp("us", "UTC")),
        "key": [b"k"] * n, "value": [b"{}"] * n, "headers": pa.nulls(n, pa.string()),
        "id": pa.array([1, 2], pa.int64()), long_ascii: pa.array([3, 4], pa.int64()),
        long_utf8: ["x", "y"]})
    cfg = parse_pipeline({
        "name": "orders", "kafka": {"bootstrap_servers": "k:9092"},
        "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "long"}},
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": "o", "headers": "none",
                 "task_files": str(tmp_path)}}, "orders.yaml", {})
    sink = KafkaPipelineSink(cfg)
    b = Batch.__new__(Batch)
    object.__setattr__(b, "batch_id", 5)
    with caplog.at_level("INFO"):
        tf = sink.task_files(pg_dsn, b, list(types.items()), (long_ascii, long_utf8))
    if tf is None:  # the stage path builds it
        assert "longer than PostgreSQL" in caplog.text, caplog.text
        return
    want = [bytes(r[4]) if not isinstance(r[4], str) else r[4].encode()
            for r in stage_query_rows(pg_dsn, f"kl_{unique}", types, batch,
                                      KafkaSinkShape(headers="none"))]
    built = finished_records(tf.sink, tf.columns, batch)
    assert built is not None
    assert built.column("value").to_pylist() == want
