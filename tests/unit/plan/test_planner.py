import pytest

from offsetflow.config import StartingPolicy
from offsetflow.errors import OffsetsResetError, RequestError
from offsetflow.plan import cut_window
from offsetflow.plan.planner import fair_share, plan_batch
from offsetflow.ranges import PartitionOffsets

EARLIEST = StartingPolicy("earliest")
T0, T1, T2 = ("t", 0), ("t", 1), ("t", 2)


def spans(plan):  # noqa: ANN001, ANN201
    return {r.topic_partition: (r.from_offset, r.until_offset) for r in plan.ranges}


def test_continues_from_committed_positions_and_clamps_per_partition() -> None:
    plan = plan_batch({T0: 10, T1: 0}, {T0: PartitionOffsets(0, 100), T1: PartitionOffsets(0, 5)},
                      EARLIEST, max_records_per_partition=30)
    assert spans(plan) == {T0: (10, 40), T1: (0, 5)}
    assert plan.new_partitions == ()
    assert not plan.data_loss


def test_new_partition_uses_starting_policy() -> None:
    offsets = {T0: PartitionOffsets(3, 50), T1: PartitionOffsets(7, 20)}
    assert spans(plan_batch({T0: 50}, offsets, EARLIEST, 100)) == {T0: (50, 50), T1: (7, 20)}
    latest = plan_batch({}, offsets, StartingPolicy("latest"), 100)
    assert spans(latest) == {T0: (50, 50), T1: (20, 20)}
    assert latest.is_empty
    # a partition added after the pipeline started is new data: read from its earliest
    added = plan_batch({T0: 50}, offsets, StartingPolicy("latest"), 100)
    assert spans(added) == {T0: (50, 50), T1: (7, 20)}
    explicit = StartingPolicy("offsets", offsets={"t": {1: 11}})
    plan = plan_batch({}, offsets, explicit, 100)
    assert spans(plan) == {T0: (3, 50), T1: (11, 20)}
    assert set(plan.new_partitions) == {T0, T1}


def test_timestamp_start_uses_resolved_offsets_and_end_when_none() -> None:
    offsets = {T0: PartitionOffsets(0, 50), T1: PartitionOffsets(0, 20)}
    plan = plan_batch({}, offsets, StartingPolicy("timestamp", timestamp_ms=1), 100,
                      by_timestamp={T0: 42, T1: -1})
    assert spans(plan) == {T0: (42, 50), T1: (20, 20)}


def test_nothing_new_is_an_empty_plan_not_an_error() -> None:
    plan = plan_batch({T0: 9}, {T0: PartitionOffsets(0, 9)}, EARLIEST, 10)
    assert plan.is_empty and plan.offset_span == 0


def test_data_loss_is_reported_with_missing_offsets() -> None:
    offsets = {T0: PartitionOffsets(120, 200)}
    plan = plan_batch({T0: 100}, offsets, EARLIEST, 1000, data_loss_policy="fail")
    gap = plan.data_loss[0]
    assert (gap.topic, gap.partition, gap.missing_from, gap.missing_until) == ("t", 0, 100, 120)
    assert gap.count == 20
    assert spans(plan) == {T0: (100, 200)}  # caller must refuse: policy fail
    cont = plan_batch({T0: 100}, offsets, EARLIEST, 1000, data_loss_policy="continue")
    assert spans(cont) == {T0: (120, 200)} and cont.data_loss == plan.data_loss


def test_position_beyond_log_end_is_refused() -> None:
    with pytest.raises(OffsetsResetError, match=r"t\[0\].*500.*beyond the log end 10"):
        plan_batch({T0: 500}, {T0: PartitionOffsets(0, 10)}, EARLIEST, 100)


def test_vanished_partitions_are_reported() -> None:
    plan = plan_batch({T0: 5, ("gone", 0): 3}, {T0: PartitionOffsets(0, 5)}, EARLIEST, 10)
    assert plan.vanished == (("gone", 0),)


@pytest.mark.parametrize(
    ("avail", "cap", "expected"),
    [
        ({T0: 100, T1: 100, T2: 100}, 90, {T0: 30, T1: 30, T2: 30}),
        ({T0: 5, T1: 100, T2: 100}, 90, {T0: 5, T1: 43, T2: 42}),
        ({T0: 5, T1: 10, T2: 100}, 1000, {T0: 5, T1: 10, T2: 100}),
        ({T0: 10, T1: 10}, 3, {T0: 2, T1: 1}),
        ({T0: 10, T1: 10}, 0, {T0: 0, T1: 0}),
    ],
)
def test_fair_share_water_filling(avail, cap, expected) -> None:  # noqa: ANN001
    got = fair_share(avail, cap)
    assert got == expected
    assert sum(got.values()) == min(cap, sum(avail.values()))


def test_total_cap_is_applied_after_per_partition_limit() -> None:
    offsets = {T0: PartitionOffsets(0, 1000), T1: PartitionOffsets(0, 4),
               T2: PartitionOffsets(0, 1000)}
    plan = plan_batch({}, offsets, EARLIEST, max_records_per_partition=300,
                      max_records_per_batch=104)
    assert spans(plan) == {T0: (0, 50), T1: (0, 4), T2: (0, 50)}


def test_cut_window_covers_window_in_order_without_overlap() -> None:
    window = {T0: (10, 35), T1: (0, 5)}
    batches = cut_window(window, 10)
    covered: dict = {}
    for b in batches:
        assert sum(r.span for r in b) <= 10
        for r in b:
            assert covered.get(r.topic_partition, window[r.topic_partition][0]) == r.from_offset
            covered[r.topic_partition] = r.until_offset
    assert covered == {T0: 35, T1: 5}
    with pytest.raises(RequestError):
        cut_window({T0: (5, 4)}, 10)


def test_recreated_topic_is_refused() -> None:
    from offsetflow.errors import TopicRecreatedError
    from offsetflow.plan.planner import check_topic_identity

    check_topic_identity({T0: "a", T1: None}, {"t": "a"})
    with pytest.raises(TopicRecreatedError, match="t was deleted and recreated"):
        check_topic_identity({T0: "a"}, {"t": "b"})
    # every partition still on the old id is named, with the command that resets them
    with pytest.raises(TopicRecreatedError, match=r"partition\(s\) \[0, 1\] belong to the "
                                                  r"old topic.*reset-position -p orders "
                                                  r"--topic t --all-partitions") as ei:
        check_topic_identity({T0: "a", T1: "a", ("u", 0): "x"}, {"t": "b", "u": "x"},
                             "orders")
    assert ei.value.partitions == (0, 1)


def test_lag_rows_and_time_headroom() -> None:
    from offsetflow.ops.status import lag_rows, with_times

    rows = lag_rows({T0: 10, T1: 5, ("gone", 0): 3},
                    {T0: PartitionOffsets(0, 40), T1: PartitionOffsets(8, 8),
                     T2: PartitionOffsets(2, 9)})
    by = {(r.topic, r.partition): r for r in rows}
    assert by[T0].lag == 30 and by[T0].retention_headroom == 10
    assert by[T2].committed is None and by[T2].lag == 7  # new partition: from earliest
    assert by[("gone", 0)].latest is None and by[("gone", 0)].lag is None
    timed = {(r.topic, r.partition): r for r in with_times(
        rows, {T0: 1_000_000 - 90_000}, {"t": 100_000, "gone": None}, now_ms=1_000_000)}
    assert timed[T0].lag_seconds == 90 and timed[T0].headroom_seconds == 10
    assert timed[T0].warning is not None and "ages out in 10s" in timed[T0].warning
    assert timed[T1].warning is not None and "data loss" in timed[T1].warning
    assert timed[T2].lag_seconds == 0.0 and timed[T2].warning is None


def test_total_cap_below_partition_count_serves_every_partition_in_turn() -> None:
    """max_records_per_batch smaller than the number of partitions: the remainder went to
    the lowest partitions every time, so the others were never read (lag grew forever)."""
    tps = [("t", p) for p in range(5)]
    committed = {tp: 0 for tp in tps}
    for step in range(6):
        # producers write one record per partition between plans; the per-partition limit
        # clamps every span to the same value
        offsets = {tp: PartitionOffsets(0, 100 + step) for tp in tps}
        plan = plan_batch(committed, offsets, EARLIEST, max_records_per_partition=10,
                          max_records_per_batch=2)
        assert plan.offset_span == 2
        for r in plan.ranges:
            committed[r.topic_partition] = r.until_offset
    assert all(v > 0 for v in committed.values()), committed


def test_fair_share_remainder_goes_to_the_largest_lag_first() -> None:
    assert fair_share({T0: 10, T1: 10, T2: 10}, 2, priority={T0: 5, T1: 50, T2: 40}) == \
        {T0: 0, T1: 1, T2: 1}
