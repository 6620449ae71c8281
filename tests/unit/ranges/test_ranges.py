import pytest

from offsetflow.errors import InvalidRangeError
from offsetflow.ranges import OffsetRange, check_disjoint, split_ranges


@pytest.mark.parametrize(
    ("topic", "partition", "frm", "until"),
    [("", 0, 0, 1), ("t", -1, 0, 1), ("t", 0, -1, 1), ("t", 0, 5, 4)],
)
def test_invalid_ranges_are_refused(topic: str, partition: int, frm: int, until: int) -> None:
    with pytest.raises(InvalidRangeError):
        OffsetRange(topic, partition, frm, until)


def test_half_open_semantics() -> None:
    r = OffsetRange("t", 0, 10, 20)
    assert r.span == 10
    assert r.contains(10) and r.contains(19)
    assert not r.contains(20) and not r.contains(9)
    assert OffsetRange("t", 0, 7, 7).is_empty


@pytest.mark.parametrize(
    ("frm", "until", "max_span", "expected"),
    [
        (0, 10, 5, [(0, 5), (5, 10)]),
        (0, 10, 3, [(0, 3), (3, 6), (6, 9), (9, 10)]),
        (0, 11, 4, [(0, 4), (4, 8), (8, 11)]),
        (5, 6, 100, [(5, 6)]),
        (3, 3, 2, [(3, 3)]),
    ],
)
def test_split_covers_range_exactly(frm: int, until: int, max_span: int,
                                    expected: list[tuple[int, int]]) -> None:
    parts = OffsetRange("t", 1, frm, until).split(max_span)
    assert [(p.from_offset, p.until_offset) for p in parts] == expected
    assert all(p.span <= max_span for p in parts)


def test_split_ranges_drops_empty_and_checks_disjoint() -> None:
    rs = [OffsetRange("a", 0, 0, 10), OffsetRange("a", 1, 4, 4), OffsetRange("b", 0, 0, 3)]
    out = split_ranges(rs, 4)
    assert sum(r.span for r in out) == 13
    assert all(not r.is_empty for r in out)
    check_disjoint(out)
    with pytest.raises(InvalidRangeError, match="overlap"):
        check_disjoint([OffsetRange("a", 0, 0, 10), OffsetRange("a", 0, 9, 12)])


def test_dict_round_trip() -> None:
    r = OffsetRange("orders", 3, 100, 250)
    assert OffsetRange.from_dict(r.to_dict()) == r
