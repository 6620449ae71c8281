"""Kafka topics for tests: one deleted and created again under the same name (its offsets
restart and it gets a new topic id); records produced with their coordinates."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.source import KafkaMetadata


def recreate(bootstrap: str, topic: str, partitions: int) -> str:
    """Delete `topic`, create it again; returns the new topic id."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if topic in admin.list_topics(timeout=10).topics:  # (or just create it again)
        admin.delete_topics([topic])[topic].result(30)
    deadline = time.monotonic() + 90
    while True:
        try:
            admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result(30)
            break
        except Exception:  # noqa: BLE001 - the deletion is still finishing
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    km = KafkaMetadata({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 60
    while True:  # metadata of the new topic reaches every client a little later
        try:
            km.partition_offsets([(topic, p) for p in range(partitions)])
            return km.topic_ids([topic])[topic]
        except Exception:  # noqa: BLE001
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def produce(bootstrap: str, topic: str,
            records: Sequence[tuple[int, bytes | None, bytes, int]]) -> list[tuple[int, int]]:
    """(partition, key, value, timestamp ms; 0: now) records, in order; their (partition,
    offset)."""
    out: list[tuple[int, int]] = [(-1, -1)] * len(records)

    def cb(i: int) -> Any:
        def done(err: Any, msg: Any) -> None:
            assert err is None, err
            out[i] = (msg.partition(), msg.offset())
        return done

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    for i, (part, key, value, ts) in enumerate(records):
        p.produce(topic, value, key, partition=part, timestamp=ts, on_delivery=cb(i))
    assert p.flush(30) == 0
    return out
