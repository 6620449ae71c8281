"""Which staged parts belong to the batch's current stage layout (pure; no I/O).

A part's marker is only worth skipping a task for, and committing, if it was written under
the layout the commit assumes: the stage generation the batch has now (a zombie stages under
an older one), and on the fused path, where part `k` reads the sub-ranges `groups[k]` of the
batch's `Packing` of `split_ranges(batch.ranges, batch.split_offsets)` (part `k` is
sub-range `k` when the batch is not packed), exactly those sub-ranges and only their
offsets. Anything else is a part of another layout: committing it would skip rows or count
some twice."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from offsetflow.ranges import OffsetRange
from offsetflow.stage.packing import Packing


@dataclass(frozen=True)
class Marker:
    """One `staged_parts` row, as far as the layout check needs it."""

    kind: str  # rows | bad
    part: int
    generation: int | None
    per_partition: Mapping[str, Any] | None  # rows: {"topic/partition": [count, lo, hi]}
    # the sub-ranges the part read (fused path); None: a marker that does not say, which
    # stands for sub-range `part` alone (the layout before packing)
    subranges: Sequence[int] | None = None


Layout = Packing | Sequence[OffsetRange] | None


def _packing(split: Layout) -> Packing | None:
    if split is None or isinstance(split, Packing):
        return split
    return Packing.identity(split)


def foreign_reason(m: Marker, generation: int, split: Layout) -> str | None:
    """Why marker `m` is not of the current layout, or None if it is. `split`: the packing
    of sub-ranges part numbers stand for (fused path; a plain list of sub-ranges: one per
    part), None where parts are Spark's partitions of a transform's output (only the
    generation tells)."""
    if m.generation != generation:
        return (f"part {m.part} ({m.kind}) was staged under stage generation {m.generation}, "
                f"the batch's stage is generation {generation} (an older attempt, still "
                f"running when a newer one rebuilt the stage)")
    packing = _packing(split)
    if packing is None or m.kind != "rows":
        return None
    if not 0 <= m.part < len(packing.groups):
        return (f"part {m.part} is not one of the {len(packing.groups)} parts of the batch's "
                f"split")
    group = packing.groups[m.part]
    said = tuple(int(i) for i in m.subranges) if m.subranges is not None else (m.part,)
    if said != tuple(group):
        return (f"part {m.part} read sub-ranges {list(said)} of the batch's split, the "
                f"batch's part {m.part} is sub-ranges {list(group)}")
    ranges = packing.ranges(m.part)
    for tp, (n, lo, hi) in (m.per_partition or {}).items():
        if int(n) == 0:
            continue
        mine = [r for r in ranges if tp == f"{r.topic}/{r.partition}"]
        if not (any(r.contains(int(lo)) for r in mine)
                and any(r.contains(int(hi)) for r in mine)):
            plural = "s" if len(ranges) > 1 else ""
            return (f"part {m.part} holds offsets {lo}..{hi} of {tp}, outside its "
                    f"sub-range{plural} {', '.join(str(r) for r in ranges)}")
    return None


def foreign_markers(markers: Iterable[Marker], generation: int,
                    split: Layout) -> list[tuple[Marker, str]]:
    """The markers not of the current layout, each with its reason, in part order."""
    out = [(m, why) for m in markers
           if (why := foreign_reason(m, generation, split)) is not None]
    return sorted(out, key=lambda x: (x[0].part, x[0].kind))
