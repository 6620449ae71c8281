"""OffsetRange: the half-open `[from_offset, until_offset)` range of one topic-partition.

As in Spark's direct approach a range names offsets, not records: transaction markers,
aborted and compacted records mean it may hold fewer records than `until - from`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from offsetflow.errors import InvalidRangeError

TopicPartition = tuple[str, int]


@dataclass(frozen=True, order=True)
class OffsetRange:
    topic: str
    partition: int
    from_offset: int
    until_offset: int

    def __post_init__(self) -> None:
        if not self.topic:
            raise InvalidRangeError("OffsetRange needs a topic")
        if self.partition < 0:
            raise InvalidRangeError(f"{self.topic}: partition {self.partition} is negative")
        if self.from_offset < 0:
            raise InvalidRangeError(
                f"{self.topic}[{self.partition}]: from_offset {self.from_offset} is negative"
            )
        if self.until_offset < self.from_offset:
            raise InvalidRangeError(
                f"{self.topic}[{self.partition}]: until_offset {self.until_offset} "
                f"< from_offset {self.from_offset}"
            )

    @property
    def topic_partition(self) -> TopicPartition:
        return (self.topic, self.partition)

    @property
    def span(self) -> int:
        """Number of offsets covered; an upper bound on the record count, not the count."""
        return self.until_offset - self.from_offset

    @property
    def is_empty(self) -> bool:
        return self.until_offset == self.from_offset

    def contains(self, offset: int) -> bool:
        return self.from_offset <= offset < self.until_offset

    def split(self, max_span: int) -> list[OffsetRange]:
        """Cut into consecutive sub-ranges of at most `max_span` offsets (for parallelism)."""
        if max_span <= 0:
            raise InvalidRangeError(f"max_span must be positive, got {max_span}")
        if self.is_empty:
            return [self]
        parts = -(-self.span // max_span)
        size = -(-self.span // parts)  # even sizes, the last one may be shorter
        return [
            OffsetRange(self.topic, self.partition, start, min(start + size, self.until_offset))
            for start in range(self.from_offset, self.until_offset, size)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "partition": self.partition,
            "from_offset": self.from_offset,
            "until_offset": self.until_offset,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OffsetRange:
        return cls(str(d["topic"]), int(d["partition"]), int(d["from_offset"]),
                   int(d["until_offset"]))

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}] [{self.from_offset}, {self.until_offset})"


def split_ranges(ranges: Iterable[OffsetRange], max_span: int | None) -> list[OffsetRange]:
    """Split every non-empty range into sub-ranges no larger than `max_span`; drop empty ones."""
    out: list[OffsetRange] = []
    for r in ranges:
        if r.is_empty:
            continue
        out.extend(r.split(max_span) if max_span else [r])
    return out


def check_disjoint(ranges: Iterable[OffsetRange]) -> None:
    """Raise if two ranges of one partition overlap (a planning bug we refuse to run)."""
    by_tp: dict[TopicPartition, list[OffsetRange]] = {}
    for r in ranges:
        by_tp.setdefault(r.topic_partition, []).append(r)
    for tp, rs in by_tp.items():
        rs.sort(key=lambda r: r.from_offset)
        for a, b in zip(rs, rs[1:], strict=False):
            if b.from_offset < a.until_offset:
                raise InvalidRangeError(f"{tp[0]}[{tp[1]}]: ranges {a} and {b} overlap")


@dataclass(frozen=True)
class PartitionOffsets:
    """What Kafka says about one partition: `latest` is the last stable offset under
    read_committed (nothing at or beyond it may be read yet)."""

    earliest: int
    latest: int


@dataclass(frozen=True)
class DataLossGap:
    topic: str
    partition: int
    missing_from: int
    missing_until: int

    @property
    def count(self) -> int:
        return self.missing_until - self.missing_from
