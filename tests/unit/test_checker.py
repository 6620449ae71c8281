from tests.tooling.checker import ProducedRecord, SinkRow, check


def prod(i: int, committed: bool = True, partition: int = 0) -> ProducedRecord:
    return ProducedRecord(f"r{i}", f"c{i}", "t", partition, i, committed)


def row(i: int, checksum: str | None = None, partition: int = 0) -> SinkRow:
    return SinkRow(f"r{i}", checksum or f"c{i}", "t", partition, i)


def test_exactly_once_passes() -> None:
    rep = check([prod(0), prod(1), prod(2, committed=False), prod(3)],
                [row(0), row(1), row(3)], {("t", 0): 4})
    assert rep.ok and rep.expected == 3 and rep.found == 3


def test_each_violation_is_reported() -> None:
    produced = [prod(i) for i in range(6)] + [prod(6, committed=False)]
    rows = [row(0), row(0), row(2, checksum="bad"), row(5), row(6), SinkRow("zz", "x", "t", 0, 1)]
    rep = check(produced, rows, {("t", 0): 5})
    assert rep.duplicated == ["r0"]
    assert rep.lost == ["r1", "r3", "r4"]
    assert rep.corrupted == ["r2"]
    assert rep.beyond_position == ["r5", "r6"]
    assert rep.aborted_visible == ["r6"]
    assert rep.unknown == ["zz"]
    assert not rep.ok
    assert "lost=3" in rep.explain()
