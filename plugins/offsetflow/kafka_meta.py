"""Kafka metadata adapter: partitions and earliest/latest offsets in batched admin calls.

Thin edge over confluent-kafka's AdminClient; planning itself is pure (`planner`).
Under read_committed, "latest" is the last stable offset, so a batch never names an
offset of a transaction that is still open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import IsolationLevel, KafkaException, TopicCollection
from confluent_kafka import TopicPartition as KTopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from offsetflow.errors import KafkaUnavailableError
from offsetflow.planner import PartitionOffsets
from offsetflow.ranges import TopicPartition

log = logging.getLogger(__name__)


class KafkaMetadata:
    def __init__(self, admin_conf: Mapping[str, str], isolation_level: str = "read_committed",
                 timeout_s: float = 15.0) -> None:
        self._conf = dict(admin_conf)
        self._isolation = (IsolationLevel.READ_COMMITTED if isolation_level == "read_committed"
                           else IsolationLevel.READ_UNCOMMITTED)
        self._timeout = timeout_s
        self._admin: AdminClient | None = None

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(dict(self._conf))  # type: ignore[arg-type]
        return self._admin

    def _cluster(self) -> Any:
        try:
            return self.admin.list_topics(timeout=self._timeout)
        except KafkaException as e:
            raise KafkaUnavailableError(
                f"cannot reach Kafka at {self._conf.get('bootstrap.servers')}: {e}") from e

    def topics(self, names: Iterable[str] = (), pattern: str | None = None) -> list[str]:
        """Existing topics: the listed names (an unknown one is an error) or a pattern match."""
        import re

        md = self._cluster()
        existing = {t for t in md.topics if not t.startswith("__")}
        if pattern is not None:
            return sorted(t for t in existing if re.fullmatch(pattern, t))
        names = list(names)
        missing = [t for t in names if t not in existing]
        if missing:
            raise KafkaUnavailableError(f"topic(s) {missing} do not exist in Kafka at "
                                        f"{self._conf.get('bootstrap.servers')}")
        return names

    def partitions(self, topics: Iterable[str]) -> list[TopicPartition]:
        md = self._cluster()
        out: list[TopicPartition] = []
        for t in topics:
            tm = md.topics.get(t)
            if tm is None or tm.error is not None:
                raise KafkaUnavailableError(f"no metadata for topic {t}: "
                                            f"{tm.error if tm else 'unknown topic'}")
            out.extend((t, p) for p in sorted(tm.partitions))
        return out

    def topic_ids(self, topics: Iterable[str]) -> dict[str, str]:
        """Kafka's topic id per topic: it changes when a topic is deleted and recreated."""
        names = list(topics)
        if not names:
            return {}
        try:
            futures = self.admin.describe_topics(TopicCollection(names),
                                                 request_timeout=self._timeout)
            return {t: str(f.result().topic_id) for t, f in futures.items()}
        except KafkaException as e:
            raise KafkaUnavailableError(f"describing topics {names} failed: {e}") from e

    def retention_ms(self, topics: Iterable[str]) -> dict[str, int | None]:
        """Topic retention.ms (None: unlimited)."""
        from confluent_kafka.admin import ConfigResource, ResourceType

        res = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
        if not res:
            return {}
        try:
            futures = self.admin.describe_configs(res, request_timeout=self._timeout)
            out: dict[str, int | None] = {}
            for r, f in futures.items():
                entry = f.result().get("retention.ms")
                v = int(entry.value) if entry is not None and entry.value is not None else -1
                out[r.name] = None if v < 0 else v
            return out
        except KafkaException as e:
            raise KafkaUnavailableError(f"describing topic configs failed: {e}") from e

    def record_timestamps(self, at: Mapping[TopicPartition, int],
                          consumer_conf: Mapping[str, str], timeout_s: float = 5.0
                          ) -> dict[TopicPartition, int]:
        """Timestamp (ms) of the first record at or after each given offset."""
        import time

        from confluent_kafka import Consumer

        if not at:
            return {}
        conf = dict(consumer_conf)
        conf["enable.partition.eof"] = "true"
        c = Consumer(conf)
        out: dict[TopicPartition, int] = {}
        try:
            c.assign([KTopicPartition(t, p, o) for (t, p), o in at.items()])
            pending = set(at)
            deadline = time.monotonic() + timeout_s
            while pending and time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is None:
                    continue
                tp = (m.topic() or "", int(m.partition() or 0))
                if tp not in pending:
                    continue
                if m.error() is None:
                    ts_type, ts = m.timestamp()
                    if ts_type:
                        out[tp] = int(ts)
                pending.discard(tp)
                c.pause([KTopicPartition(tp[0], tp[1])])
        finally:
            c.close()
        return out

    def _list_offsets(self, specs: Mapping[TopicPartition, OffsetSpec]) -> dict[TopicPartition,
                                                                               int]:
        if not specs:
            return {}
        req = {KTopicPartition(t, p): s for (t, p), s in specs.items()}
        try:
            futures = self.admin.list_offsets(req, isolation_level=self._isolation,
                                              request_timeout=self._timeout)
            return {(tp.topic, tp.partition): int(f.result().offset)
                    for tp, f in futures.items()}
        except KafkaException as e:
            raise KafkaUnavailableError(f"listing offsets failed: {e}") from e

    def partition_offsets(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition,
                                                                       PartitionOffsets]:
        """Earliest and latest (last stable) offsets of all partitions in two batched calls."""
        tps = list(tps)
        earliest = self._list_offsets({tp: OffsetSpec.earliest() for tp in tps})
        latest = self._list_offsets({tp: OffsetSpec.latest() for tp in tps})
        return {tp: PartitionOffsets(earliest[tp], latest[tp]) for tp in tps}

    def offsets_for_time(self, tps: Iterable[TopicPartition], timestamp_ms: int
                         ) -> dict[TopicPartition, int]:
        """First offset at or after `timestamp_ms` per partition (-1: none yet)."""
        return self._list_offsets({tp: OffsetSpec.for_timestamp(timestamp_ms) for tp in tps})
