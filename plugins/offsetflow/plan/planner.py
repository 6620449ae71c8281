"""Planning as pure code: committed positions + Kafka offsets in, OffsetRanges out.

This is the "driver" half of the direct approach (Spark's KafkaOffsetRangeCalculator):
no I/O here, so every rule (starting policy, data loss, rate limits, fair sharing of a
total cap, window cutting for backfills) is unit-tested from value tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from offsetflow.config import StartingPolicy
from offsetflow.errors import OffsetsResetError, RequestError, TopicRecreatedError
from offsetflow.ranges import DataLossGap, OffsetRange, PartitionOffsets, TopicPartition


@dataclass(frozen=True)
class Plan:
    ranges: tuple[OffsetRange, ...]
    new_partitions: tuple[TopicPartition, ...] = ()
    data_loss: tuple[DataLossGap, ...] = ()
    # partitions that have a position but are gone from Kafka (deleted topic/partitions)
    vanished: tuple[TopicPartition, ...] = field(default_factory=tuple)

    @property
    def is_empty(self) -> bool:
        return all(r.is_empty for r in self.ranges)

    @property
    def offset_span(self) -> int:
        return sum(r.span for r in self.ranges)


def resolve_start(
    tp: TopicPartition,
    policy: StartingPolicy,
    offsets: PartitionOffsets,
    by_timestamp: Mapping[TopicPartition, int] | None = None,
) -> int:
    """Starting offset of a partition that has no committed position."""
    if policy.kind == "earliest":
        return offsets.earliest
    if policy.kind == "latest":
        return offsets.latest
    if policy.kind == "timestamp":
        if by_timestamp is None or tp not in by_timestamp:
            raise ValueError(f"{tp[0]}[{tp[1]}]: timestamp start was not resolved")
        # Kafka answers -1 (end) when no record is at or after the timestamp.
        found = by_timestamp[tp]
        return offsets.latest if found < 0 else found
    if policy.kind == "offsets":
        explicit = policy.offsets.get(tp[0], {})
        # a partition not listed (e.g. discovered later) starts at the earliest offset
        return explicit.get(tp[1], offsets.earliest)
    raise ValueError(f"unknown starting policy {policy.kind!r}")


def check_topic_identity(committed_ids: Mapping[TopicPartition, str | None],
                         current_ids: Mapping[str, str], pipeline: str | None = None) -> None:
    """Refuse positions that belong to an earlier incarnation of a topic; the error lists
    every partition of the first such topic, so one reset covers them all."""
    stale: dict[tuple[str, str], list[int]] = {}
    for (topic, partition), old in sorted(committed_ids.items()):
        new = current_ids.get(topic)
        if old and new and old != new:
            stale.setdefault((topic, old), []).append(partition)
    if stale:
        (topic, old), partitions = next(iter(sorted(stale.items())))
        raise TopicRecreatedError(topic, old, current_ids[topic], partitions, pipeline)


def fair_share(spans: Mapping[TopicPartition, int], cap: int,
               priority: Mapping[TopicPartition, int] | None = None) -> dict[TopicPartition, int]:
    """Split a total record cap across partitions by water-filling: small partitions get
    all they have, the rest share what is left equally. The remainder of the division goes
    to the highest `priority` first (the lag, default the span; ties: lowest partition):
    with a cap below the number of partitions the remainder is all there is, and always
    giving it to the lowest partitions would never read the others."""
    prio = priority if priority is not None else spans
    if cap < 0:
        raise ValueError("cap must not be negative")
    alloc: dict[TopicPartition, int] = {}
    remaining = cap
    pending = sorted(spans.items(), key=lambda kv: (kv[1], kv[0]))
    while pending:
        share = remaining // len(pending)
        small = [(tp, s) for tp, s in pending if s <= share]
        if not small:
            extra = remaining - share * len(pending)
            for i, (tp, s) in enumerate(sorted(pending, key=lambda kv: (-prio.get(kv[0], 0),
                                                                        kv[0]))):
                alloc[tp] = min(s, share + (1 if i < extra else 0))
            return alloc
        for tp, s in small:
            alloc[tp] = s
            remaining -= s
        pending = [(tp, s) for tp, s in pending if tp not in alloc]
    return alloc


def plan_batch(
    committed: Mapping[TopicPartition, int],
    offsets: Mapping[TopicPartition, PartitionOffsets],
    starting: StartingPolicy,
    max_records_per_partition: int,
    max_records_per_batch: int | None = None,
    data_loss_policy: str = "fail",
    by_timestamp: Mapping[TopicPartition, int] | None = None,
) -> Plan:
    """Plan the next batch of one pipeline.

    Steps: start every partition at its committed position (the starting policy applies on
    the pipeline's first plan; partitions added later start at their earliest offset);
    record a gap where the start fell out of retention
    and, under `continue`, move the start to the earliest offset; refuse a position beyond
    the log end; clamp each range by the per-partition limit, then the total cap fairly.
    The caller records gaps in the ledger and raises for the `fail` policy.
    """
    starts: dict[TopicPartition, int] = {}
    gaps: list[DataLossGap] = []
    new: list[TopicPartition] = []
    first_plan = not committed
    for tp in sorted(offsets):
        off = offsets[tp]
        if tp in committed:
            start = committed[tp]
        elif first_plan or starting.kind == "offsets":
            start = resolve_start(tp, starting, off, by_timestamp)
            new.append(tp)
        else:
            # a partition added after the pipeline started: everything in it is new data,
            # so it is read from its earliest offset whatever the starting policy said
            start = off.earliest
            new.append(tp)
        if start > off.latest:
            raise OffsetsResetError(tp[0], tp[1], start, off.latest)
        if start < off.earliest:
            gaps.append(DataLossGap(tp[0], tp[1], start, off.earliest))
            if data_loss_policy == "continue":
                start = off.earliest
        starts[tp] = start

    spans = {tp: min(offsets[tp].latest - s, max_records_per_partition)
             for tp, s in starts.items()}
    if max_records_per_batch is not None:
        lag = {tp: offsets[tp].latest - s for tp, s in starts.items()}
        spans = fair_share(spans, max_records_per_batch, priority=lag)
    ranges = tuple(OffsetRange(tp[0], tp[1], starts[tp], starts[tp] + spans[tp])
                   for tp in sorted(starts))
    vanished = tuple(sorted(tp for tp in committed if tp not in offsets))
    return Plan(ranges=ranges, new_partitions=tuple(new), data_loss=tuple(gaps),
                vanished=vanished)


def cut_window(
    window: Mapping[TopicPartition, tuple[int, int]], records_per_batch: int
) -> list[tuple[OffsetRange, ...]]:
    """Cut a backfill window `{tp: (from, until)}` into consecutive batches whose ranges
    together cover at most `records_per_batch` offsets, shared fairly across partitions."""
    if records_per_batch <= 0:
        raise RequestError("records per batch must be positive")
    pos = {tp: lo for tp, (lo, hi) in window.items()}
    for tp, (lo, hi) in window.items():
        if hi < lo:
            raise RequestError(f"{tp[0]}[{tp[1]}]: until {hi} < from {lo}")
    batches: list[tuple[OffsetRange, ...]] = []
    while True:
        spans = {tp: window[tp][1] - pos[tp] for tp in window if window[tp][1] > pos[tp]}
        if not spans:
            return batches
        alloc = fair_share(spans, records_per_batch)
        batch = tuple(OffsetRange(tp[0], tp[1], pos[tp], pos[tp] + n)
                      for tp, n in sorted(alloc.items()) if n > 0)
        if not batch:  # cap smaller than the number of partitions: one offset each
            tp = min(spans)
            batch = (OffsetRange(tp[0], tp[1], pos[tp], pos[tp] + 1),)
        for r in batch:
            pos[r.topic_partition] = r.until_offset
        batches.append(batch)
