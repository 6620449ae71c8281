"""Which staged parts belong to the batch's current stage layout (pure; no I/O).

A part's marker is only worth skipping a task for, and committing, if it was written under
the layout the commit assumes: the stage generation the batch has now (a zombie stages under
an older one), and on the fused path, where part `k` is sub-range `k` of
`split_ranges(batch.ranges, batch.split_offsets)`, only offsets of that sub-range. Anything
else is a part of another layout: committing it would skip rows or count some twice."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offsetflow.ranges import OffsetRange


@dataclass(frozen=True)
class Marker:
    """One `staged_parts` row, as far as the layout check needs it."""

    kind: str  # rows | bad
    part: int
    generation: int | None
    per_partition: Mapping[str, Any] | None  # rows: {"topic/partition": [count, lo, hi]}


def foreign_reason(m: Marker, generation: int, split: Sequence[OffsetRange] | None
                   ) -> str | None:
    """Why marker `m` is not of the current layout, or None if it is. `split`: the
    sub-ranges part numbers stand for (fused path), None where parts are Spark's partitions
    of a transform's output (only the generation tells)."""
    if m.generation != generation:
        return (f"part {m.part} ({m.kind}) was staged under stage generation {m.generation}, "
                f"the batch's stage is generation {generation} (an older attempt, still "
                f"running when a newer one rebuilt the stage)")
    if split is None or m.kind != "rows":
        return None
    if not 0 <= m.part < len(split):
        return f"part {m.part} is not one of the {len(split)} sub-ranges of the batch's split"
    r = split[m.part]
    for tp, (n, lo, hi) in (m.per_partition or {}).items():
        if int(n) == 0:
            continue
        if tp != f"{r.topic}/{r.partition}" or not (r.contains(int(lo)) and r.contains(int(hi))):
            return (f"part {m.part} holds offsets {lo}..{hi} of {tp}, outside its sub-range "
                    f"{r}")
    return None


def foreign_markers(markers: Iterable[Marker], generation: int,
                    split: Sequence[OffsetRange] | None) -> list[tuple[Marker, str]]:
    """The markers not of the current layout, each with its reason, in part order."""
    out = [(m, why) for m in markers
           if (why := foreign_reason(m, generation, split)) is not None]
    return sorted(out, key=lambda x: (x[0].part, x[0].kind))
