"""Exactly-once checker: what was produced against what the sink holds.

Pure. The producer side records every record it wrote (unique id, payload checksum, its
coordinates from the delivery report, whether its transaction committed, and whether it was
a tombstone); the sink side is the target rows, the pipeline's dead letters and the ledger's
positions. The verdict:
  - every committed record below the position of its partition is delivered exactly once,
    with the same payload: a record as a target row, a tombstone where the pipeline's
    tombstone policy puts it (a dead letter today: `bad_records: dead_letter`; or a row with
    null payload columns), a record the target refuses as a dead letter;
  - nothing at or beyond a position is in the sink or the dead letters;
  - nothing from an aborted transaction is in either.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from offsetflow.ranges import TopicPartition

Coordinates = tuple[str, int, int]
TOMBSTONE_POLICIES = ("dead_letter", "row")


@dataclass(frozen=True)
class ProducedRecord:
    record_id: str
    checksum: str
    topic: str
    partition: int
    offset: int
    committed: bool = True  # False: its transaction was aborted
    tombstone: bool = False  # a null value (key only)

    @property
    def coordinates(self) -> Coordinates:
        return (self.topic, self.partition, self.offset)


@dataclass(frozen=True)
class SinkRow:
    record_id: str | None  # None: a row with null payload columns (a tombstone kept as a row)
    checksum: str | None
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class DeadLetter:
    topic: str
    partition: int
    offset: int
    error: str = ""


@dataclass
class CheckReport:
    produced: int = 0
    expected: int = 0  # committed and below the positions
    found: int = 0  # target rows
    dead_letters: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    beyond_position: list[str] = field(default_factory=list)
    aborted_visible: list[str] = field(default_factory=list)
    corrupted: list[str] = field(default_factory=list)
    misrouted: list[str] = field(default_factory=list)  # a row where a dead letter belongs, or back
    unknown: list[str] = field(default_factory=list)

    VIOLATIONS = ("lost", "duplicated", "beyond_position", "aborted_visible", "corrupted",
                  "misrouted", "unknown")

    @property
    def ok(self) -> bool:
        return not any(getattr(self, name) for name in self.VIOLATIONS)

    def summary(self) -> dict[str, int]:
        return {"produced": self.produced, "expected": self.expected, "found": self.found,
                "dead_letters": self.dead_letters,
                **{name: len(getattr(self, name)) for name in self.VIOLATIONS}}

    def explain(self, limit: int = 5) -> str:
        parts = [f"{k}={v}" for k, v in self.summary().items()]
        for name in self.VIOLATIONS:
            ids = getattr(self, name)
            if ids:
                parts.append(f"{name} e.g. {ids[:limit]}")
        return ", ".join(parts)


def _label(coords: Coordinates) -> str:
    return f"{coords[0]}[{coords[1]}]@{coords[2]}"


def check(produced: Iterable[ProducedRecord], rows: Iterable[SinkRow],
          positions: Mapping[TopicPartition, int],
          dead_letters: Iterable[DeadLetter] = (),
          tombstones: str = "dead_letter",
          refused: Collection[str] = frozenset()) -> CheckReport:
    """Judge the sink. `tombstones`: where the pipeline puts a null value ("dead_letter": a
    dead letter at its coordinates; "row": a target row with null payload columns).
    `refused`: ids of records the target cannot take as they are (e.g. over a Kafka output
    topic's record size limit), which belong in the dead letters, never in the target."""
    if tombstones not in TOMBSTONE_POLICIES:
        raise ValueError(f"tombstones must be one of {TOMBSTONE_POLICIES}, not {tombstones!r}")
    rep = CheckReport()
    by_id: dict[str, ProducedRecord] = {}
    by_coords: dict[Coordinates, ProducedRecord] = {}
    for p in produced:
        by_id[p.record_id] = p
        by_coords[p.coordinates] = p
    rep.produced = len(by_id)
    in_rows: Counter[str] = Counter()
    in_dead: Counter[str] = Counter()

    def visible(src: ProducedRecord, coords: Coordinates, where: str) -> None:
        if not src.committed:
            rep.aborted_visible.append(src.record_id)
        if coords[2] >= positions.get((coords[0], coords[1]), 0):
            rep.beyond_position.append(src.record_id)
        wants_dead = (src.tombstone and tombstones == "dead_letter") or src.record_id in refused
        if wants_dead != (where == "dead_letter"):
            rep.misrouted.append(src.record_id)

    for row in rows:
        rep.found += 1
        coords = (row.topic, row.partition, row.offset)
        if row.record_id is None:  # null payload: only a tombstone kept as a row looks so
            src = by_coords.get(coords)
            if src is None or not src.tombstone:
                rep.unknown.append(f"null row at {_label(coords)}")
                continue
        else:
            found = by_id.get(row.record_id)
            if found is None:
                rep.unknown.append(row.record_id)
                continue
            src = found
            if row.checksum != src.checksum or coords != src.coordinates:
                rep.corrupted.append(src.record_id)
        in_rows[src.record_id] += 1
        visible(src, coords, "row")
    for dl in dead_letters:
        rep.dead_letters += 1
        coords = (dl.topic, dl.partition, dl.offset)
        dsrc = by_coords.get(coords)
        if dsrc is None:
            rep.unknown.append(f"dead letter at {_label(coords)}")
            continue
        in_dead[dsrc.record_id] += 1
        visible(dsrc, coords, "dead_letter")
    rep.duplicated = sorted(rid for rid in by_id if in_rows[rid] + in_dead[rid] > 1)
    for rid, src in by_id.items():
        if src.committed and src.offset < positions.get((src.topic, src.partition), 0):
            rep.expected += 1
            if in_rows[rid] + in_dead[rid] == 0:
                rep.lost.append(rid)
    for name in CheckReport.VIOLATIONS:
        getattr(rep, name).sort()
    return rep
