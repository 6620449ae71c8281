from tests.tooling.checker import DeadLetter, ProducedRecord, SinkRow, check


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


def tomb(i: int, committed: bool = True) -> ProducedRecord:
    return ProducedRecord(f"k{i}", "", "t", 0, i, committed, tombstone=True)


def dead(i: int) -> DeadLetter:
    return DeadLetter("t", 0, i, "value is null (tombstone)")


def test_tombstones_are_expected_as_dead_letters_exactly_once() -> None:
    produced = [prod(0), tomb(1), prod(2), tomb(3)]
    rep = check(produced, [row(0), row(2)], {("t", 0): 4}, [dead(1), dead(3)])
    assert rep.ok, rep.explain()
    assert rep.expected == 4 and rep.dead_letters == 2

    rep = check(produced, [row(0), row(2)], {("t", 0): 4}, [dead(1)])
    assert rep.lost == ["k3"]
    rep = check(produced, [row(0), row(2)], {("t", 0): 4}, [dead(1), dead(1), dead(3)])
    assert rep.duplicated == ["k1"]


def test_dead_letters_are_judged_like_rows() -> None:
    produced = [prod(0), tomb(1, committed=False), tomb(2), prod(3)]
    rep = check(produced, [row(3)], {("t", 0): 2},
                [dead(0), dead(1), dead(2), DeadLetter("t", 0, 99)])
    assert rep.misrouted == ["r0"]  # a good record dead-lettered instead of written
    assert rep.aborted_visible == ["k1"]
    assert rep.beyond_position == ["k2", "r3"]
    assert rep.unknown == ["dead letter at t[0]@99"]
    assert not rep.ok


def test_tombstones_kept_as_null_rows() -> None:
    produced = [prod(0), tomb(1)]
    null_row = SinkRow(None, None, "t", 0, 1)
    rep = check(produced, [row(0), null_row], {("t", 0): 2}, tombstones="row")
    assert rep.ok, rep.explain()
    # under the dead-letter policy the same row is in the wrong place
    rep = check(produced, [row(0), null_row], {("t", 0): 2})
    assert rep.misrouted == ["k1"]
    # a null row where no tombstone was produced
    rep = check(produced, [row(0), null_row, SinkRow(None, None, "t", 0, 0)], {("t", 0): 2},
                tombstones="row")
    assert rep.unknown == ["null row at t[0]@0"] and rep.duplicated == []


def test_records_the_target_refuses_are_expected_as_dead_letters() -> None:
    """A record over a Kafka output topic's record limit belongs in the dead letters once,
    never in the target (`refused`)."""
    produced = [prod(0), prod(1), prod(2)]
    ok = check(produced, [row(0), row(2)], {("t", 0): 3}, [dead(1)], refused={"r1"})
    assert ok.ok and ok.expected == 3, ok.explain()
    as_row = check(produced, [row(0), row(1), row(2)], {("t", 0): 3}, refused={"r1"})
    assert as_row.misrouted == ["r1"]
    twice = check(produced, [row(0), row(2)], {("t", 0): 3}, [dead(1), dead(1)],
                  refused={"r1"})
    assert twice.duplicated == ["r1"]
