"""How the Kafka sink reads a batch's stage in source order without sorting it (pure; no I/O).

On the fused path every task COPYs the records of its sub-ranges (`Packing.groups[part]` of
the batch's split) into a stage part of its own, one sub-range after the other, each in
offset order. So the stage is read in source order as a list of segments, one per
sub-range in (topic, partition, offset) order, each the rows of its part as they are
stored (a plain scan; filtered to the sub-range when the part holds several). For a batch
of one sub-range per part that is the sorted read's order, record for record.

A heap scan's order is PostgreSQL's storage order, not a promise: the driver checks every
record's offset as it produces it (`offsetflow.sinks.kafka.sink`), and a surprise falls
back to the sorted read instead of producing out of order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from offsetflow.ranges import OffsetRange


@dataclass(frozen=True)
class Segment:
    """The rows of one sub-range, in stage part `part`; `alone`: the part holds no other
    sub-range (read whole, no filter)."""

    part: int
    range: OffsetRange
    alone: bool


# a part holding more sub-ranges than this is scanned once per sub-range that many times;
# such parts are packs of small ranges, whose batch is cheaper to sort than to scan again
MAX_SCANS_PER_PART = 4


def segments(split: Sequence[OffsetRange], parts: Mapping[int, Sequence[int] | None],
             max_scans: int = MAX_SCANS_PER_PART) -> list[Segment] | None:
    """The segments of the stage in source order: `split` is the batch's sub-ranges,
    `parts` each staged part's sub-ranges as its marker names them (None: part k is
    sub-range k, the layout before packing). None when the markers do not describe
    disjoint sub-ranges of the split, or a part holds more than `max_scans` of them (then
    the stage is read sorted)."""
    out: list[Segment] = []
    seen: set[int] = set()
    for part, subranges in parts.items():
        held = [part] if subranges is None else [int(i) for i in subranges]
        if len(held) > max_scans:
            return None
        for i in held:
            if not 0 <= i < len(split) or i in seen:
                return None
            seen.add(i)
            out.append(Segment(part, split[i], len(held) == 1))
    out.sort(key=lambda s: (s.range.topic, s.range.partition, s.range.from_offset))
    for a, b in zip(out, out[1:], strict=False):
        if a.range.topic_partition == b.range.topic_partition and \
                b.range.from_offset < a.range.until_offset:
            return None
    return out


def ready(plan: Sequence[Segment], done: Collection[int], staged: Collection[int]
          ) -> list[int]:
    """While the tasks still stage (the part-wise overlap): the indices into `plan` (the
    stage's segments in source order, `segments`) that may be produced now, in plan order:
    not `done`, their part `staged`, and every earlier segment of their topic/partition
    done or ready too. A part staged out of turn waits for the parts holding the earlier
    sub-ranges of its partitions, so each partition's records go out in offset order."""
    out: list[int] = []
    blocked: set[tuple[str, int]] = set()
    for i, seg in enumerate(plan):
        tp = seg.range.topic_partition
        if i in done or tp in blocked:
            continue
        if seg.part in staged:
            out.append(i)
        else:
            blocked.add(tp)
    return out
