"""How the Kafka sink reads the stage without a sort (`segments`): one segment per
sub-range in source order, read from the part that holds it (whole when it holds only
that one), and no such read (the sorted one) when the markers name no layout of the
batch's split."""

from __future__ import annotations

from offsetflow.ranges import OffsetRange, split_ranges
from offsetflow.sinks.kafka.order import Segment, ready, segments
from offsetflow.stage import pack

RANGES = [OffsetRange("in", 0, 0, 40), OffsetRange("in", 1, 0, 40),
          OffsetRange("a", 2, 5, 15)]


def test_one_sub_range_per_part_reads_each_part_whole_in_the_sorted_reads_order() -> None:
    split = split_ranges(RANGES, 20)  # in/0 x2, in/1 x2, a/2
    got = segments(split, {k: None if k % 2 else (k,) for k in range(len(split))})
    assert got is not None
    assert [(g.part, g.range.topic, g.range.partition, g.range.from_offset, g.alone)
            for g in got] == [(4, "a", 2, 5, True), (0, "in", 0, 0, True),
                              (1, "in", 0, 20, True), (2, "in", 1, 0, True),
                              (3, "in", 1, 20, True)]


def test_packed_parts_are_read_sub_range_by_sub_range_in_source_order() -> None:
    split = split_ranges(RANGES, 10)  # 9 sub-ranges into 3 parts
    packing = pack(split, 3, None)
    assert any(len(g) > 1 for g in packing.groups)
    got = segments(split, dict(enumerate(packing.groups)))
    assert got is not None
    # a pack of many small ranges would be scanned once per range: sorted instead
    assert segments(split, dict(enumerate(packing.groups)), max_scans=2) is None
    assert [g.range for g in got] == sorted(
        split, key=lambda r: (r.topic, r.partition, r.from_offset))
    assert all(not g.alone for g in got if len(packing.groups[g.part]) > 1)
    assert all(g.range in packing.ranges(g.part) for g in got)


def test_markers_that_name_no_layout_of_the_split_mean_the_sorted_read() -> None:
    split = split_ranges(RANGES, 20)
    assert segments(split, {0: (0, 1), 1: (1,)}) is None  # one sub-range in two parts
    assert segments(split, {0: (9,)}) is None  # no such sub-range
    assert segments(split, {}) == []
    # two sub-ranges of one partition that overlap (not a split of this batch)
    overlapping = [OffsetRange("in", 0, 0, 30), OffsetRange("in", 0, 20, 40)]
    assert segments(overlapping, {0: None, 1: None}) is None
    assert segments(overlapping[:1], {0: None}) == [Segment(0, overlapping[0], True)]


def test_while_the_tasks_stage_a_segment_waits_for_the_earlier_ones_of_its_partition() -> None:
    split = split_ranges(RANGES, 20)  # in/0 x2, in/1 x2, a/2: part k is sub-range k
    plan = segments(split, {k: (k,) for k in range(len(split))})
    assert plan is not None
    at = {(g.range.topic, g.range.partition, g.range.from_offset): i
          for i, g in enumerate(plan)}
    # in/0's second part staged first: nothing of in/0 goes yet; in/1's first part goes
    assert ready(plan, set(), {1, 2}) == [at[("in", 1, 0)]]
    # in/0's first part staged: both of in/0 go, in offset order
    assert ready(plan, {at[("in", 1, 0)]}, {0, 1, 2}) == [at[("in", 0, 0)],
                                                         at[("in", 0, 20)]]
    # what is done is never ready again; a part staged with its predecessor done goes
    done = {at[("in", 0, 0)], at[("in", 0, 20)], at[("in", 1, 0)]}
    assert ready(plan, done, {0, 1, 2}) == []
    assert ready(plan, done, {0, 1, 2, 3, 4}) == [at[("a", 2, 5)], at[("in", 1, 20)]]
    # a packed part: each of its sub-ranges waits for its own partition's turn
    packed = segments(split, {0: (0, 3), 1: (1,), 2: (2,), 3: (4,)})
    assert packed is not None
    got = [(packed[i].range.partition, packed[i].range.from_offset)
           for i in ready(packed, set(), {0})]
    assert got == [(0, 0)]  # its in/1 [20, 40) waits for part 2's in/1 [0, 20)
