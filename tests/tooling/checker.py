"""Exactly-once checker: what was produced against what the sink holds.

Pure. The producer side records every record it wrote (unique id, payload checksum, its
coordinates from the delivery report, and whether its transaction committed); the sink side
is the target rows and the ledger's positions. The verdict:
  - every committed record below the position of its partition is in the sink exactly once,
    with the same payload;
  - nothing at or beyond a position is in the sink;
  - nothing from an aborted transaction is in the sink.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from offsetflow.ranges import TopicPartition


@dataclass(frozen=True)
class ProducedRecord:
    record_id: str
    checksum: str
    topic: str
    partition: int
    offset: int
    committed: bool = True  # False: its transaction was aborted


@dataclass(frozen=True)
class SinkRow:
    record_id: str
    checksum: str
    topic: str
    partition: int
    offset: int


@dataclass
class CheckReport:
    produced: int = 0
    expected: int = 0  # committed and below the positions
    found: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    beyond_position: list[str] = field(default_factory=list)
    aborted_visible: list[str] = field(default_factory=list)
    corrupted: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.beyond_position
                    or self.aborted_visible or self.corrupted or self.unknown)

    def summary(self) -> dict[str, int]:
        return {"produced": self.produced, "expected": self.expected, "found": self.found,
                "lost": len(self.lost), "duplicated": len(self.duplicated),
                "beyond_position": len(self.beyond_position),
                "aborted_visible": len(self.aborted_visible),
                "corrupted": len(self.corrupted), "unknown": len(self.unknown)}

    def explain(self, limit: int = 5) -> str:
        parts = [f"{k}={v}" for k, v in self.summary().items()]
        for name in ("lost", "duplicated", "beyond_position", "aborted_visible", "corrupted",
                     "unknown"):
            ids = getattr(self, name)
            if ids:
                parts.append(f"{name} e.g. {ids[:limit]}")
        return ", ".join(parts)


def check(produced: Iterable[ProducedRecord], rows: Iterable[SinkRow],
          positions: Mapping[TopicPartition, int]) -> CheckReport:
    rep = CheckReport()
    by_id: dict[str, ProducedRecord] = {}
    for p in produced:
        by_id[p.record_id] = p
    rep.produced = len(by_id)
    seen: Counter[str] = Counter()
    for row in rows:
        rep.found += 1
        seen[row.record_id] += 1
        src = by_id.get(row.record_id)
        if src is None:
            rep.unknown.append(row.record_id)
            continue
        if not src.committed:
            rep.aborted_visible.append(row.record_id)
        if row.offset >= positions.get((row.topic, row.partition), 0):
            rep.beyond_position.append(row.record_id)
        if (row.checksum != src.checksum or (row.topic, row.partition, row.offset)
                != (src.topic, src.partition, src.offset)):
            rep.corrupted.append(row.record_id)
    rep.duplicated = sorted(rid for rid, n in seen.items() if n > 1)
    for rid, src in by_id.items():
        if src.committed and src.offset < positions.get((src.topic, src.partition), 0):
            rep.expected += 1
            if seen[rid] == 0:
                rep.lost.append(rid)
    rep.lost.sort()
    return rep
