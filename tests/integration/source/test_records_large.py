"""Large records on real Kafka, PostgreSQL and Spark: chunks are cut by bytes as well as by
rows, so a task's memory and every Arrow array stay bounded whatever the record size, and a
topic configured for 10 MB records is read without stalling."""

from __future__ import annotations

import json
import time
from typing import Any

from confluent_kafka import Producer

from offsetflow.config import parse_pipeline
from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from offsetflow.ranges import OffsetRange
from offsetflow.source import read_range
from tests.tooling.pipeline_data import end_offsets, query

MIB = 1 << 20
CHUNK_BYTES = 64 * MIB  # the reader's default byte cap per chunk


def _produce_big(bootstrap: str, topic: str, n: int, size: int, partition: int = 0) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                  "message.max.bytes": size + MIB, "compression.type": "none"})
    for i in range(n):
        blob = chr(ord("a") + i % 26) * (size - 40)
        value = json.dumps({"event_id": f"big-{i}", "blob": blob}).encode()
        p.produce(topic, value, key=f"big-{i}".encode(), partition=partition)
        p.poll(0)
    assert p.flush(120) == 0


def _conf(bootstrap: str) -> dict[str, str]:
    return {"bootstrap.servers": bootstrap, "group.id": "offsetflow-large-test",
            "enable.auto.commit": "false", "enable.auto.offset.store": "false",
            "auto.offset.reset": "error", "enable.partition.eof": "true"}


def identity(df: Any) -> Any:
    return df


def _config(topic: str, dsn: str, bootstrap: str, table: str, fmt: str,
            transform: str | None = None) -> Any:
    fmt_raw: dict[str, Any] = {"type": fmt}
    if fmt == "json":
        fmt_raw["schema"] = {"event_id": "string", "blob": "string"}
    return parse_pipeline({
        "name": table, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest"}, "format": fmt_raw,
        "sink": {"connection": dsn, "table": table},
        "spark": {"master": "local[2]", "max_offsets_per_task": 1000},
        **({"transform": transform} if transform else {})},
        f"<test {table}>", {})


def test_chunks_of_1mb_records_are_cut_by_bytes(kafka_bootstrap: str, make_topic: Any) -> None:
    n = 70  # 70 MiB: one chunk under a row cap only
    topic = make_topic("big", 1, config={"max.message.bytes": str(2 * MIB)})
    _produce_big(kafka_bootstrap, topic, n, MIB)
    r = OffsetRange(topic, 0, 0, end_offsets(kafka_bootstrap, topic, 1)[(topic, 0)])
    sizes, offsets = [], []
    for chunk in read_range(_conf(kafka_bootstrap), r):
        sizes.append(sum(len(v or b"") + len(k or b"") for v, k in
                         zip(chunk.values, chunk.keys, strict=True)))
        offsets += chunk.offsets
    assert offsets == list(range(n))
    assert len(sizes) >= 2, sizes
    assert max(sizes) <= CHUNK_BYTES + MIB, [s // MIB for s in sizes]


def test_batch_of_1mb_records_json_and_raw(spark: Any, pg_dsn: str, kafka_bootstrap: str,
                                           make_topic: Any, unique: str) -> None:
    n = 70
    topic = make_topic("bigrun", 2, config={"max.message.bytes": str(2 * MIB)})
    _produce_big(kafka_bootstrap, topic, n // 2, MIB, partition=0)
    _produce_big(kafka_bootstrap, topic, n - n // 2, MIB, partition=1)
    for fmt in ("json", "raw"):
        cfg = _config(topic, pg_dsn, kafka_bootstrap, f"big{fmt}_{unique}", fmt)
        planned = plan_only(cfg, pg_dsn, started_by="test")
        assert planned.batch is not None
        report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
        assert report.result.status == "committed" and report.result.rows_written == n
        rows = query(pg_dsn, f"SELECT count(*), min(octet_length(value)), "
                             f"count(DISTINCT (partition, \"offset\")) FROM {cfg.sink.table}")
        assert rows[0][0] == n and rows[0][1] >= MIB - 40 and rows[0][2] == n
        if fmt == "json":
            blobs = query(pg_dsn, f"SELECT min(length(blob)), max(length(blob)) "
                                  f"FROM {cfg.sink.table}")
            assert blobs[0] == (MIB - 40, MIB - 40)


def test_10mb_records_are_read_without_stalling(spark: Any, pg_dsn: str, kafka_bootstrap: str,
                                                make_topic: Any, unique: str) -> None:
    size = 10 * MIB
    topic = make_topic("huge", 1, config={"max.message.bytes": str(size + MIB)})
    _produce_big(kafka_bootstrap, topic, 3, size)
    r = OffsetRange(topic, 0, 0, 3)
    t0 = time.monotonic()
    got = [o for c in read_range(_conf(kafka_bootstrap), r, stall_timeout_s=60)
           for o in c.offsets]
    assert got == [0, 1, 2] and time.monotonic() - t0 < 60
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"huge_{unique}", "json")
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert report.result.status == "committed" and report.result.rows_written == 3
    assert query(pg_dsn, f"SELECT min(length(blob)) FROM {cfg.sink.table}")[0][0] == size - 40


def test_header_bytes_count_toward_the_chunk_cap(kafka_bootstrap: str,
                                                  make_topic: Any) -> None:
    """Header-heavy records with tiny values: headers fill the HEADER_TYPE arrays like
    values do, so they must cut chunks too."""
    n, per = 40, 100_000
    topic = make_topic("hdrbig", 1, config={"max.message.bytes": str(2 * MIB)})
    p = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 2 * MIB})
    for _ in range(n):
        p.produce(topic, b"{}", partition=0,
                  headers=[("a", b"x" * (per // 2)), ("b", b"y" * (per // 2))])
        p.poll(0)
    assert p.flush(60) == 0
    sizes, offsets = [], []
    for chunk in read_range(_conf(kafka_bootstrap), OffsetRange(topic, 0, 0, n),
                            max_bytes=MIB):
        sizes.append(sum(len(h["value"]) for hs in chunk.headers for h in hs or []))
        offsets += chunk.offsets
    assert offsets == list(range(n))
    assert max(sizes) <= MIB + per, sizes


def test_one_consume_call_returns_about_a_chunk_at_most(
        monkeypatch: Any, kafka_bootstrap: str, make_topic: Any) -> None:
    """The records one consume() call returns are all in memory at once, next to the chunk:
    with large records it must ask for fewer."""
    from confluent_kafka import Consumer

    from offsetflow.source import reader

    size, n = 200_000, 60
    topic = make_topic("consumecap", 1, config={"max.message.bytes": str(2 * MIB)})
    _produce_big(kafka_bootstrap, topic, n, size)
    returned: list[int] = []

    class Counting(Consumer):  # type: ignore[misc]
        def consume(self, *a: Any, **kw: Any) -> Any:
            msgs = super().consume(*a, **kw)
            returned.append(sum(len(m.value() or b"") for m in msgs))
            return msgs
    monkeypatch.setattr(reader, "Consumer", Counting)
    got = [o for c in read_range(_conf(kafka_bootstrap), OffsetRange(topic, 0, 0, n),
                                 max_bytes=MIB) for o in c.offsets]
    assert got == list(range(n))
    # the first call probes with a few records (8 x 200 kB), later ones ask for what the
    # chunk has room for (1 MiB + the record that passes it)
    assert max(returned) <= 2 * MIB, [r // 1000 for r in returned]


def test_transform_pipeline_with_1mb_records_commits_in_bounded_arrow_batches(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The DataFrame path hands the writer Arrow batches Spark cuts: build_spark bounds them
    by bytes (10,000 rows of 1 MB records would be 10 GB, past Arrow's 2 GiB)."""
    from offsetflow.job import build_spark

    n = 40
    topic = make_topic("bigtf", 2, config={"max.message.bytes": str(2 * MIB)})
    _produce_big(kafka_bootstrap, topic, n // 2, MIB, partition=0)
    _produce_big(kafka_bootstrap, topic, n - n // 2, MIB, partition=1)
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"bigtf_{unique}", "json",
                  transform="tests.integration.source.test_records_large.identity")
    session = build_spark(cfg, "offsetflow-tests")  # the test session, configured
    cap = session.conf.get("spark.sql.execution.arrow.maxBytesPerBatch")
    assert int(str(cap).rstrip("b")) == 64 * MIB, cap
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(session, cfg, planned.batch.batch_id, pg_dsn)
    assert report.result.status == "committed" and report.result.rows_written == n
    rows = query(pg_dsn, f"SELECT count(DISTINCT (partition, \"offset\")), min(length(blob)) "
                         f"FROM {cfg.sink.table}")
    assert rows[0] == (n, MIB - 40)
