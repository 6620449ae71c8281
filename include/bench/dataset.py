"""The benchmark's fixed data set: N JSON records of about 200 bytes on P partitions.

Deterministic (record i is always the same bytes) and reused between runs: the topic
`offsetflow-bench-<N>-<P>` is produced once and kept while it holds exactly N records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.ranges import OffsetRange
from offsetflow.source import KafkaMetadata

log = logging.getLogger("bench.dataset")

SCHEMA = {"event_id": "string", "customer": "string", "amount": "double",
          "quantity": "long", "created_at": "timestamp", "note": "string"}
NOTE = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor"


def record(i: int) -> bytes:
    """Record i: ~200 bytes of JSON with every declared type."""
    return (f'{{"event_id":"evt-{i:012d}","customer":"customer-{i % 50_000:06d}",'
            f'"amount":{(i * 7919) % 100_000 / 100:.2f},"quantity":{i % 17 + 1},'
            f'"created_at":"2026-11-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:'
            f'{(i // 60) % 60:02d}.{i % 1000:03d}Z","note":"{NOTE}"}}').encode()


@dataclass(frozen=True)
class DataSet:
    topic: str
    records: int
    partitions: int
    ranges: tuple[OffsetRange, ...]

    @property
    def avg_record_bytes(self) -> float:
        sample = range(0, self.records, max(self.records // 1000, 1))
        return sum(len(record(i)) for i in sample) / max(len(sample), 1)


def topic_name(records: int, partitions: int) -> str:
    return f"offsetflow-bench-{records}-{partitions}"


def ensure_dataset(bootstrap: str, records: int, partitions: int) -> DataSet:
    """Produce the data set unless the topic already holds exactly it."""
    return ensure_topic(bootstrap, topic_name(records, partitions), records, partitions,
                        lambda topic: _produce(bootstrap, topic, records, partitions))


def ensure_topic(bootstrap: str, topic: str, records: int, partitions: int,
                 produce: Callable[[str], None]) -> DataSet:
    """The data set in `topic`: reused when the topic holds exactly `records` records from
    offset 0 on `partitions` partitions, else the topic is made again and `produce` fills
    it (the JSON and the Avro data sets differ only in what they produce)."""
    meta = KafkaMetadata({"bootstrap.servers": bootstrap})
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = admin.list_topics(timeout=30).topics
    if topic in existing:
        ranges = _ranges(meta, topic, partitions)
        if len(existing[topic].partitions) == partitions and \
                sum(r.span for r in ranges) == records and all(r.from_offset == 0
                                                                 for r in ranges):
            log.info("data set %s: reusing %d records on %d partitions", topic, records,
                     partitions)
            return DataSet(topic, records, partitions, tuple(ranges))
        log.info("data set %s does not hold exactly %d records; recreating it", topic, records)
        admin.delete_topics([topic])[topic].result(timeout=60)
        _wait(lambda: topic not in admin.list_topics(timeout=30).topics, 60, "topic deletion")
    fut = admin.create_topics([NewTopic(topic, partitions, 1,
                                        config={"retention.ms": "-1",
                                                "segment.bytes": str(512 << 20)})])
    fut[topic].result(timeout=60)
    produce(topic)
    ranges = _ranges(meta, topic, partitions)
    got = sum(r.span for r in ranges)
    if got != records:
        raise RuntimeError(f"data set {topic}: produced {records} records but the partitions "
                           f"hold {got}")
    return DataSet(topic, records, partitions, tuple(ranges))


def _ranges(meta: KafkaMetadata, topic: str, partitions: int) -> list[OffsetRange]:
    offs = meta.partition_offsets([(topic, p) for p in range(partitions)])
    return [OffsetRange(topic, p, offs[(topic, p)].earliest, offs[(topic, p)].latest)
            for p in range(partitions)]


def _produce(bootstrap: str, topic: str, records: int, partitions: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.size": 1 << 20,
                  "queue.buffering.max.messages": 1_000_000, "enable.idempotence": True,
                  "compression.type": "none"})
    t0 = time.monotonic()
    step = max(records // 10, 1)
    for i in range(records):
        while True:
            try:
                p.produce(topic, record(i), key=b"evt-%012d" % i, partition=i % partitions)
                break
            except BufferError:
                p.poll(0.05)
        if (i + 1) % step == 0:
            p.poll(0)
            log.info("producing %s: %d/%d records (%.0f/s)", topic, i + 1, records,
                     (i + 1) / max(time.monotonic() - t0, 1e-9))
    left = p.flush(300)
    if left:
        raise RuntimeError(f"data set {topic}: {left} records were not delivered")
    log.info("produced %d records to %s in %.1fs", records, topic, time.monotonic() - t0)


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish in {timeout:.0f}s")
        time.sleep(0.5)
