"""The exactly-once checker for a Kafka output topic (sink.type: kafka).

The output topic is read twice from its beginning: `read_committed` (what consumers see;
judged by `tests.tooling.checker.check` like a table: 0 lost, 0 duplicated, nothing of an
aborted source transaction) and `read_uncommitted` (every record in the log, aborted sink
transactions included), so a test can show that aborted attempts exist and stay invisible.
A record's source coordinates come from its `offsetflow.source` header, its id and checksum
from its JSON value (or the source record's key for a tombstone).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError
from confluent_kafka import TopicPartition as KTopicPartition

from offsetflow.ranges import TopicPartition
from tests.tooling.chaos import expected_checksum
from tests.tooling.checker import CheckReport, ProducedRecord, SinkRow, check


@dataclass(frozen=True)
class OutputRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes | None] = field(default_factory=dict)

    @property
    def source(self) -> tuple[str, int, int]:
        raw = self.headers.get("offsetflow.source")
        assert raw is not None, f"output record {self.partition}@{self.offset} has no source"
        topic, part, off = raw.decode().rsplit("/", 2)
        return topic, int(part), int(off)

    @property
    def batch_id(self) -> int:
        raw = self.headers.get("offsetflow.batch")
        assert raw is not None
        return int(raw)


def read_topic(bootstrap: str, topic: str, isolation: str = "read_committed",
               timeout_s: float = 60.0) -> list[OutputRecord]:
    """Every record of `topic` the isolation level shows, up to the end of each partition
    (for read_committed: its last stable offset)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"checker-{uuid.uuid4().hex}",
                  "enable.auto.commit": False, "isolation.level": isolation,
                  "enable.partition.eof": True})
    try:
        md = c.list_topics(topic, timeout=timeout_s)
        parts = sorted(md.topics[topic].partitions)
        c.assign([KTopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        pending = set(parts)
        out: list[OutputRecord] = []
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} ({isolation}): partitions {pending} never "
                                   f"reached their end")
            for m in c.consume(1000, 1.0):
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        pending.discard(int(m.partition() or 0))
                        continue
                    raise RuntimeError(f"reading {topic}: {err}")
                out.append(OutputRecord(int(m.partition() or 0), int(m.offset() or 0), m.key(),
                                        m.value(), _headers(m.headers())))
        return out
    finally:
        c.close()


def _headers(raw: Any) -> dict[str, bytes | None]:
    return {str(k): v for k, v in (raw or [])}


def sink_rows(records: Iterable[OutputRecord]) -> list[SinkRow]:
    rows = []
    for r in records:
        topic, part, off = r.source
        if r.value is None:
            rows.append(SinkRow(None, None, topic, part, off))
            continue
        body = json.loads(r.value)
        checksum = body.get("checksum")  # with a pad (large records): and the pad's md5
        rows.append(SinkRow(body.get("event_id"), checksum and expected_checksum(
            checksum, body.get("pad")), topic, part, off))
    return rows


@dataclass
class TopicVerdict:
    committed: CheckReport
    visible: int  # read_committed
    in_log: int  # read_uncommitted: aborted sink attempts included
    batches: set[int]

    @property
    def aborted_in_log(self) -> int:
        return self.in_log - self.visible


def check_topic(bootstrap: str, topic: str, produced: Iterable[ProducedRecord],
                positions: Mapping[TopicPartition, int]) -> TopicVerdict:
    committed = read_topic(bootstrap, topic, "read_committed")
    everything = read_topic(bootstrap, topic, "read_uncommitted")
    report = check(produced, sink_rows(committed), positions, tombstones="row")
    return TopicVerdict(report, len(committed), len(everything),
                        {r.batch_id for r in committed})
