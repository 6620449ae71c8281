"""Packing sub-ranges into tasks (offsetflow.stage.packing): a table of cases, as Spark's
KafkaOffsetRangeCalculatorSuite."""

from __future__ import annotations

import pytest

from offsetflow.errors import InvalidRangeError
from offsetflow.ranges import OffsetRange, split_ranges
from offsetflow.stage import Packing, pack, task_count


def r(p: int, lo: int, hi: int, topic: str = "t") -> OffsetRange:
    return OffsetRange(topic, p, lo, hi)


def small(n: int, span: int = 10) -> list[OffsetRange]:
    return [r(p, 0, span) for p in range(n)]


@pytest.mark.parametrize("split,tasks,max_span,groups", [
    # no more sub-ranges than tasks: one each, part k = sub-range k (the old layout)
    ([r(0, 0, 10), r(1, 0, 5)], 8, 100_000, [(0,), (1,)]),
    ([], 8, 100_000, []),
    # a batch packed before packing existed (no task count recorded)
    (small(20), None, 100_000, [(i,) for i in range(20)]),
    # many equal small ranges: round robin by position, split order inside a part
    (small(6), 2, 100_000, [(0, 2, 4), (1, 3, 5)]),
    (small(7), 3, 100_000, [(0, 3, 6), (1, 4), (2, 5)]),
    # heaviest first into the lightest part: the big range gets a part nearly to itself
    ([r(0, 0, 10), r(1, 0, 5000), r(2, 0, 10), r(3, 0, 10)], 2, 100_000,
     [(1,), (0, 2, 3)]),
    # a batch larger than tasks x max_span keeps its parallelism: 6 sub-ranges of 50 cannot
    # go into 2 parts of about 100 offsets each (plus the seek cost of 5 per range)
    (split_ranges([r(0, 0, 150), r(1, 0, 150)], 50), 2, 50, [(i,) for i in range(6)]),
    # two full sub-ranges and four tiny ones: 134 offsets' worth needs 3 parts of about 55
    (split_ranges([r(0, 0, 100)], 50) + small(4, 1), 2, 50, [(0,), (1,), (2, 3, 4, 5)]),
])
def test_pack(split: list[OffsetRange], tasks: int | None, max_span: int,
              groups: list[tuple[int, ...]]) -> None:
    got = pack(split, tasks, max_span, seek_cost=5)
    assert [list(g) for g in got.groups] == [list(g) for g in groups]
    assert got.split == tuple(split)


def test_every_sub_range_is_in_exactly_one_part_and_parts_are_balanced() -> None:
    split = split_ranges([r(p, 0, 10 + p) for p in range(500)], 100_000)
    got = pack(split, task_count(2), 100_000)
    assert len(got.groups) == 8
    flat = sorted(i for g in got.groups for i in g)
    assert flat == list(range(len(split)))
    loads = [sum(split[i].span + 1000 for i in g) for g in got.groups]
    assert max(loads) - min(loads) <= max(s.span for s in split) + 1000


def test_the_same_batch_packs_the_same_way_every_time() -> None:
    split = small(100)
    assert pack(split, 8, 1000) == pack(list(split), 8, 1000)


def test_no_max_span_packs_into_exactly_the_tasks() -> None:
    assert len(pack(small(100, 10_000_000), 4, None).groups) == 4


def test_identity_and_ranges_of_a_part() -> None:
    split = small(3)
    assert Packing.identity(split).groups == ((0,), (1,), (2,))
    assert pack(split * 1, 1, None).ranges(0) == split


def test_a_task_count_below_one_is_refused() -> None:
    with pytest.raises(InvalidRangeError, match="positive number of tasks"):
        pack(small(3), 0, 100)
    assert task_count(0) == task_count(1) == 4
