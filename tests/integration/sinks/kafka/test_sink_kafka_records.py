"""Records the Kafka sink's output topic can never take, on the real broker, PostgreSQL and
Spark: a value over the producer's `message.max.bytes` (1,000,000 by default, while the
broker takes 1,048,588 at the source) and a keyless record for a compacted output topic.
With `bad_records: dead_letter` each goes to the PostgreSQL dead-letter table, named, and
the rest of the batch commits once; without, the batch fails naming the record."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.errors import KafkaSinkError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.sinks.kafka.sink import FAULT_ENV
from tests.tooling import chaos
from tests.tooling.chaos import PRODUCER_MAX_BYTES, dead_letters
from tests.tooling.topic_checker import read_topic

BIG = 1_020_000  # valid at the source, over the producer's default 1,000,000


def produce(bootstrap: str, topic: str, records: list[tuple[int, bytes | None, bytes]]
            ) -> list[tuple[int, int]]:
    """(partition, key, value) records; returns their (partition, offset)."""
    out: list[tuple[int, int]] = []

    def cb(err: Any, msg: Any) -> None:
        assert err is None, err
        out.append((msg.partition(), msg.offset()))

    p = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": PRODUCER_MAX_BYTES})
    for part, key, value in records:
        p.produce(topic, value, key, partition=part, on_delivery=cb)
        p.flush(30)  # in order: the offsets returned match the records
    assert p.flush(30) == 0
    return out


def raw_pipeline(name: str, src: str, out: str, dsn: str, bootstrap: str,
                 dead_letter: bool, file: Path | None = None) -> PipelineConfig:
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": dsn, "topic": out, "value_format": "raw"}}
    if dead_letter:
        raw.update({"bad_records": "dead_letter", "dead_letter_table": f"{name}_dead"})
    if file is not None:
        file.write_text(yaml.safe_dump(raw))
    return parse_pipeline(raw, str(file or f"<test {name}>"), {})


def reported_size(error: str) -> int:
    """The record size an error names (key, value, headers and record overhead)."""
    m = re.search(r"the record is (\d+) bytes", error)
    assert m, error
    return int(m.group(1))


def run(spark: Any, cfg: PipelineConfig, dsn: str) -> Any:
    planned = plan_only(cfg, dsn)
    assert planned.batch is not None
    return planned.batch.batch_id, lambda: run_batch(spark, cfg, planned.batch.batch_id,
                                                     dsn).result


def test_a_record_over_the_size_limit_goes_to_dead_letters_or_fails_naming_it(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    src = make_topic("kb-src", 2)
    out = make_topic("kb-out", 2)
    small = [(i % 2, f"k{i}".encode(), f"v{i}".encode()) for i in range(20)]
    coords = produce(kafka_bootstrap, src, [*small[:10], (0, b"big", b"x" * BIG), *small[10:]])
    big = coords[10]

    # without a dead-letter table: the batch fails naming the record, nothing is visible
    cfg = raw_pipeline(f"kbf_{unique}", src, out, pg_dsn, kafka_bootstrap, dead_letter=False)
    bid, go = run(spark, cfg, pg_dsn)
    with pytest.raises(KafkaSinkError, match=f"{src}/{big[0]}/{big[1]}") as e:
        go()
    assert reported_size(str(e.value)) > BIG and "message.max.bytes" in str(e.value)
    assert read_topic(kafka_bootstrap, out) == []
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(bid).status != "committed"

    # with one: the record goes there, named, and the other 20 commit once
    name = f"kbd_{unique}"
    cfg = raw_pipeline(name, src, out, pg_dsn, kafka_bootstrap, dead_letter=True)
    _, go = run(spark, cfg, pg_dsn)
    res = go()
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 20, 1)
    records = read_topic(kafka_bootstrap, out)
    assert sorted(r.value for r in records) == sorted(v for _, _, v in small)
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *big)]
    assert out in dead[0].error and reported_size(dead[0].error) > BIG
    assert "limit of 1000000 bytes" in dead[0].error


def test_a_keyless_record_for_a_compacted_topic_goes_to_dead_letters(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    src = make_topic("kc-src", 2)
    out = make_topic("kc-out", 2, {"cleanup.policy": "compact"})
    keyed = [(i % 2, f"k{i}".encode(), f"v{i}".encode()) for i in range(12)]
    coords = produce(kafka_bootstrap, src, [*keyed[:5], (1, None, b"no key"), *keyed[5:]])
    keyless = coords[5]
    name = f"kc_{unique}"
    cfg = raw_pipeline(name, src, out, pg_dsn, kafka_bootstrap, dead_letter=True)
    _, go = run(spark, cfg, pg_dsn)
    res = go()
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 12, 1)
    assert sorted(r.key for r in read_topic(kafka_bootstrap, out)) == sorted(
        k for _, k, _ in keyed)
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *keyless)]
    assert "compact" in dead[0].error and "key" in dead[0].error


@pytest.mark.slow
def test_killed_after_the_kafka_commit_the_next_run_routes_the_same_left_out_record(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path) -> None:
    """The Kafka commit records which records it left out (offset metadata), so the run
    that finds the commit routes exactly those to the dead-letter table, once."""
    src = make_topic("kk-src", 2)
    out = make_topic("kk-out", 2)
    small = [(i % 2, f"k{i}".encode(), f"v{i}".encode()) for i in range(20)]
    coords = produce(kafka_bootstrap, src, [*small[:10], (0, b"big", b"x" * BIG), *small[10:]])
    name = f"kk_{unique}"
    cfg = raw_pipeline(name, src, out, pg_dsn, kafka_bootstrap, dead_letter=True,
                       file=tmp_path / f"{name}.yaml")
    bid, go = run(spark, cfg, pg_dsn)
    proc = chaos.run_batch_process(tmp_path / f"{name}.yaml", bid, tmp_path / "job.log",
                                   env={FAULT_ENV: "kill_after_commit"})
    try:
        assert proc.wait(timeout=600) == -9, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            chaos.kill(proc)
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(bid).status != "committed"
    assert dead_letters(pg_dsn, f"{name}_dead", name) == []  # rolled back with the ledger
    res = go()
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 20, 1)
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) == 20  # not again
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *coords[10])]
    assert reported_size(dead[0].error) > BIG


class PeakRss:
    """This process's resident memory sampled every 20 ms: the driver produces the records
    here (Spark's workers are other processes)."""

    def __init__(self) -> None:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def grew_mb(self) -> float:
        return (self.peak - self.start) / 2**20


@pytest.mark.slow
def test_the_driver_reads_the_stage_in_chunks_bounded_by_bytes_not_rows(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """400 records of 900 KB: a fetch of up to 5,000 rows took them all at once (hex bytea in
    the PGresult, twice the bytes, plus the memoryviews: > 1 GB in the driver); chunks sized
    by bytes keep the driver's growth to a few tens of MB. Values are compressible (lz4 in
    Kafka, pglz in PostgreSQL), so the disks hold little."""
    n, size = 400, 900_000
    src = make_topic("km-src", 2)
    out = make_topic("km-out", 2)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "compression.type": "lz4",
                  "message.max.bytes": PRODUCER_MAX_BYTES, "linger.ms": 50})
    for i in range(n):
        p.produce(src, (f"{i:08d}" * (size // 8)).encode(), f"k{i}".encode(), partition=i % 2)
        p.poll(0)
    assert p.flush(60) == 0
    del p
    name = f"km_{unique}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": out, "value_format": "raw",
                 "producer": {"compression.type": "lz4"}}}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    bid, go = run(spark, cfg, pg_dsn)
    with PeakRss() as rss:
        res = go()
    assert (res.status, res.rows_written) == ("committed", n)
    assert rss.grew_mb < 300, f"the driver grew by {rss.grew_mb:.0f} MB"
    records = read_topic(kafka_bootstrap, out)
    assert len(records) == n and all(r.value is not None and len(r.value) == size
                                     for r in records)
