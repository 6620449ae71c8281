"""Packing a batch's sub-ranges into Spark tasks (pure; no I/O).

A task costs a fixed set-up (scheduling, a Kafka consumer, a PostgreSQL connection, a stage
part and its marker) that dwarfs reading ten records: 500 partitions with ten records each
spent ~74 ms per range. So small sub-ranges share a task, which reads them one after the
other with one consumer (a seek each) into one stage part; large ranges are still split by
`spark.max_offsets_per_task` first (`ranges.split_ranges`), and a task takes about that many
offsets at most, so a large batch keeps its parallelism and its retry granularity.

The packing is a function of the batch alone (its split, and the task count recorded on its
first run), so every attempt of a batch, a zombie included, draws the same parts: part `k`
is `Packing.groups[k]`, and a stage marker records which sub-ranges its part read.
Like Spark's `KafkaOffsetRangeCalculator`, the rules are a small table of cases
(tests/unit/stage/test_packing.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from offsetflow.errors import InvalidRangeError
from offsetflow.ranges import OffsetRange

# tasks per core a batch is packed into: enough that a slow task does not leave cores idle
# at the end, few enough that set-up stays small next to reading
TASKS_PER_CORE = 4
# what one more range costs a task (an assign and a fetch round trip), in offsets' worth of
# reading, so a hundred near-empty ranges are not all packed into one task
SEEK_COST = 1000


@dataclass(frozen=True)
class Packing:
    """The sub-ranges of a batch's split and which of them each stage part reads."""

    split: tuple[OffsetRange, ...]
    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def identity(cls, split: Sequence[OffsetRange]) -> Packing:
        """One task per sub-range (part k is sub-range k): the layout before packing."""
        return cls(tuple(split), tuple((i,) for i in range(len(split))))

    def ranges(self, part: int) -> list[OffsetRange]:
        return [self.split[i] for i in self.groups[part]]


def task_count(cores: int, tasks_per_core: int = TASKS_PER_CORE) -> int:
    """How many tasks a batch is packed into on `cores` cores (at least one)."""
    return max(1, cores) * tasks_per_core


def pack(split: Sequence[OffsetRange], tasks: int | None, max_span: int | None,
         seek_cost: int = SEEK_COST) -> Packing:
    """Pack `split` (sub-ranges, none larger than `max_span`) into about `tasks` parts.

    None for `tasks` (a batch whose first run predates packing): one part per sub-range.
    A part holds about `max_span` offsets (plus `seek_cost` per range) at most, so there
    are more parts than `tasks` when the batch is larger than `tasks * max_span`; with no more
    sub-ranges than parts, each sub-range is its own part (part k = sub-range k, as
    before). Otherwise heaviest first into the lightest part (LPT; ties by position, so the
    result is deterministic); within a part the sub-ranges stay in split order."""
    if tasks is None:
        return Packing.identity(split)
    if tasks <= 0:
        raise InvalidRangeError(f"a batch is packed into a positive number of tasks, not "
                                f"{tasks}")
    weights = [r.span + seek_cost for r in split]
    parts = tasks
    if max_span:
        cap = max_span + seek_cost
        parts = max(tasks, -(-sum(weights) // cap))
    if len(split) <= parts:
        return Packing.identity(split)
    loads = [(0, p) for p in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(split)), key=lambda i: (-weights[i], i)):
        load, p = heapq.heappop(loads)
        groups[p].append(i)
        heapq.heappush(loads, (load + weights[i], p))
    return Packing(tuple(split), tuple(tuple(sorted(g)) for g in groups if g))
