"""Per-partition lag and recent batches: the operator's view (CLI, plugin page, JSON)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from offsetflow.config import PipelineConfig
from offsetflow.errors import KafkaUnavailableError
from offsetflow.ledger import Ledger
from offsetflow.planner import PartitionOffsets
from offsetflow.ranges import TopicPartition


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    committed: int | None
    earliest: int | None
    latest: int | None
    lag: int | None  # offsets between the committed position and the latest offset
    retention_headroom: int | None  # offsets the position is ahead of the earliest one


def lag_rows(committed: Mapping[TopicPartition, int],
             offsets: Mapping[TopicPartition, PartitionOffsets]) -> list[PartitionLag]:
    """Pure: join ledger positions with Kafka offsets; a partition absent on one side shows
    None there (new partition not read yet, or a partition gone from Kafka)."""
    rows = []
    for tp in sorted(set(committed) | set(offsets)):
        c = committed.get(tp)
        o = offsets.get(tp)
        start = c if c is not None else (o.earliest if o else None)
        rows.append(PartitionLag(
            tp[0], tp[1], c, o.earliest if o else None, o.latest if o else None,
            (o.latest - start) if o is not None and start is not None else None,
            (c - o.earliest) if o is not None and c is not None else None))
    return rows


def pipeline_status(cfg: PipelineConfig, dsn: str, recent: int = 10) -> dict[str, Any]:
    from offsetflow.runner import kafka_for

    with Ledger(dsn) as ledger:
        committed = ledger.positions(cfg.name)
        batches = ledger.recent_batches(cfg.name, recent)
    kafka_error = None
    offsets: dict[TopicPartition, PartitionOffsets] = {}
    try:
        k = kafka_for(cfg)
        offsets = k.partition_offsets(k.partitions(k.topics(cfg.topics, cfg.topic_pattern)))
    except KafkaUnavailableError as e:
        kafka_error = str(e)
    rows = lag_rows(committed, offsets)
    return {
        "pipeline": cfg.name,
        "kafka_error": kafka_error,
        "partitions": [asdict(r) for r in rows],
        "total_lag": sum(r.lag or 0 for r in rows),
        "batches": [b.to_dict() for b in batches],
    }


def format_status(st: Mapping[str, Any]) -> str:
    lines = [f"pipeline {st['pipeline']}  total lag {st['total_lag']}"]
    if st.get("kafka_error"):
        lines.append(f"  kafka: {st['kafka_error']}")
    lines.append(f"  {'topic':<24}{'part':>5}{'committed':>12}{'latest':>12}{'lag':>10}")
    for p in st["partitions"]:
        lines.append(f"  {p['topic']:<24}{p['partition']:>5}{_n(p['committed']):>12}"
                     f"{_n(p['latest']):>12}{_n(p['lag']):>10}")
    lines.append("  recent batches:")
    for b in st["batches"]:
        span = sum(r["until_offset"] - r["from_offset"] for r in b["ranges"])
        lines.append(f"    #{b['batch_id']:<6}{b['kind']:<10}{b['status']:<10}"
                     f"offsets {span:<9}rows {_n(b['rows_written']):<9}"
                     f"{(b['error'] or '')[:80]}")
    return "\n".join(lines)


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)
