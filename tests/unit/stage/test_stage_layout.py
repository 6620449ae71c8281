"""Which staged parts belong to the batch's current stage layout (offsetflow.stage.layout)."""

from __future__ import annotations

from offsetflow.ranges import OffsetRange, split_ranges
from offsetflow.stage import Marker, Packing
from offsetflow.stage.layout import foreign_markers, foreign_reason

SPLIT = split_ranges([OffsetRange("t", 0, 0, 100), OffsetRange("t", 1, 0, 100)], 50)


def rows(part: int, per_tp: dict[str, list[int]], generation: int | None = 3) -> Marker:
    return Marker("rows", part, generation, per_tp)


def test_a_part_of_the_current_generation_within_its_sub_range_is_kept() -> None:
    assert foreign_reason(rows(1, {"t/0": [50, 50, 99]}), 3, SPLIT) is None
    assert foreign_reason(rows(2, {"t/1": [3, 10, 20]}), 3, SPLIT) is None
    assert foreign_reason(rows(3, {}), 3, SPLIT) is None  # nothing read: aborted records


def test_another_or_no_generation_is_foreign_whatever_it_holds() -> None:
    why = foreign_reason(rows(1, {"t/0": [50, 50, 99]}, generation=2), 3, SPLIT)
    assert why is not None and "generation 2" in why
    assert foreign_reason(rows(1, {"t/0": [50, 50, 99]}, generation=None), 3, SPLIT)
    assert foreign_reason(Marker("bad", 0, 2, None), 3, None)  # bad records too


def test_offsets_outside_the_parts_sub_range_are_foreign() -> None:
    # an old split's part 1 (t[0] [0, 50) of a split by 50 as part 0, ...)
    assert "outside its sub-range" in (foreign_reason(rows(1, {"t/0": [50, 0, 49]}), 3, SPLIT)
                                        or "")
    assert foreign_reason(rows(1, {"t/0": [50, 50, 100]}), 3, SPLIT)  # until is exclusive
    assert foreign_reason(rows(2, {"t/0": [1, 60, 60]}), 3, SPLIT)  # another partition
    assert foreign_reason(rows(4, {"t/1": [1, 60, 60]}), 3, SPLIT)  # beyond the split


def test_without_a_split_only_the_generation_tells() -> None:
    """Transform path: parts are Spark's partitions, any offsets may be in any part."""
    assert foreign_reason(rows(7, {"t/0": [5, 0, 99], "t/1": [5, 3, 4]}), 3, None) is None


def test_foreign_markers_in_part_order_with_reasons() -> None:
    got = foreign_markers([rows(3, {"t/1": [1, 99, 99]}), rows(0, {"t/0": [1, 0, 0]}, 1),
                           rows(1, {"t/0": [1, 0, 0]})], 3, SPLIT)
    assert [m.part for m, _ in got] == [0, 1]


# part 0 reads t[0] [0, 50) and t[1] [50, 100); part 1 reads t[0] [50, 100) and t[1] [0, 50)
PACKED = Packing(tuple(SPLIT), ((0, 3), (1, 2)))


def packed(part: int, subranges: list[int] | None, per_tp: dict[str, list[int]]) -> Marker:
    return Marker("rows", part, 3, per_tp, subranges)


def test_a_packed_part_that_read_its_sub_ranges_is_kept() -> None:
    assert foreign_reason(packed(0, [0, 3], {"t/0": [50, 0, 49], "t/1": [50, 50, 99]}), 3,
                          PACKED) is None
    assert foreign_reason(packed(1, [1, 2], {}), 3, PACKED) is None


def test_a_packed_part_naming_other_sub_ranges_is_foreign() -> None:
    why = foreign_reason(packed(1, [1], {"t/0": [50, 50, 99]}), 3, PACKED)
    assert why is not None and "read sub-ranges [1]" in why and "[1, 2]" in why
    # a marker that names none stands for sub-range `part` alone (written before packing)
    assert foreign_reason(packed(0, None, {"t/0": [50, 0, 49]}), 3, PACKED)
    assert foreign_reason(packed(2, [2], {}), 3, PACKED)  # beyond the packing's parts


def test_offsets_outside_a_packed_parts_sub_ranges_are_foreign() -> None:
    why = foreign_reason(packed(0, [0, 3], {"t/1": [50, 0, 49]}), 3, PACKED)
    assert why is not None and "outside its sub-ranges" in why
    assert foreign_reason(packed(0, [0, 3], {"t/0": [2, 49, 50]}), 3, PACKED)


def test_a_plain_split_is_one_sub_range_per_part() -> None:
    assert foreign_reason(packed(1, [1], {"t/0": [50, 50, 99]}), 3, SPLIT) is None
    assert foreign_reason(packed(1, [1], {"t/0": [50, 50, 99]}), 3,
                          Packing.identity(SPLIT)) is None
