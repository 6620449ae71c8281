"""Lag for existing tools: committed positions published as Kafka consumer-group offsets.

After each commit the ledger's positions are written to the group `offsetflow-<pipeline>`
so Burrow, kcat or `kafka-consumer-groups` show the lag. They are never read back: the
ledger stays the only system of record. The group has no members (readers assign, they
never subscribe), so Kafka accepts the offsets.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException
from confluent_kafka import TopicPartition as KTopicPartition
from confluent_kafka.admin import AdminClient

from offsetflow.config import PipelineConfig
from offsetflow.ranges import TopicPartition

log = logging.getLogger(__name__)


def group_id(cfg: PipelineConfig) -> str:
    return f"offsetflow-{cfg.name}"


def _positions(positions: Mapping[str, int] | Mapping[TopicPartition, int]
               ) -> dict[TopicPartition, int]:
    out: dict[TopicPartition, int] = {}
    for k, v in positions.items():
        if isinstance(k, tuple):
            out[k] = int(v)
        else:
            topic, _, part = str(k).rpartition("/")
            out[(topic, int(part))] = int(v)
    return out


def publish_positions(cfg: PipelineConfig,
                      positions: Mapping[str, int] | Mapping[TopicPartition, int],
                      timeout_s: float = 15.0) -> None:
    tps = [KTopicPartition(t, p, o) for (t, p), o in sorted(_positions(positions).items())]
    if not tps:
        return
    admin = AdminClient(cfg.admin_settings())  # type: ignore[arg-type]
    try:
        futures = admin.alter_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group_id(cfg), tps)], request_timeout=timeout_s)
        for f in futures.values():
            f.result(timeout=timeout_s)
    except KafkaException as e:
        raise RuntimeError(f"publishing offsets of group {group_id(cfg)} failed: {e}") from e
    log.info("published %d positions as consumer group %s", len(tps), group_id(cfg))


def read_group_offsets(cfg: PipelineConfig, timeout_s: float = 15.0) -> dict[TopicPartition, int]:
    """What monitoring tools see (for checks and the status page only)."""
    admin = AdminClient(cfg.admin_settings())  # type: ignore[arg-type]
    futures = admin.list_consumer_group_offsets(
        [ConsumerGroupTopicPartitions(group_id(cfg))], request_timeout=timeout_s)
    out: dict[TopicPartition, int] = {}
    for f in futures.values():
        res = f.result(timeout=timeout_s)
        for tp in res.topic_partitions or []:
            if tp.offset is not None and tp.offset >= 0:
                out[(tp.topic, tp.partition)] = int(tp.offset)
    return out
