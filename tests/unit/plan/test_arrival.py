"""What counts as new data for the waiting sensor (offsetflow.plan.arrival, pure)."""

from __future__ import annotations

from offsetflow.plan import describe, pending_offsets
from offsetflow.ranges import PartitionOffsets

OFF = {("t", 0): PartitionOffsets(0, 10), ("t", 1): PartitionOffsets(5, 5)}


def test_positions_current_means_nothing_pending() -> None:
    assert pending_offsets({("t", 0): 10, ("t", 1): 5}, OFF, "earliest") == {}


def test_offsets_beyond_the_position_are_pending() -> None:
    assert pending_offsets({("t", 0): 7, ("t", 1): 5}, OFF, "earliest") == {("t", 0): 3}


def test_first_plan_under_latest_has_nothing_but_earliest_has_everything() -> None:
    assert pending_offsets({}, OFF, "latest") == {}
    assert pending_offsets({}, OFF, "earliest") == {("t", 0): 10}


def test_partition_added_later_counts_from_its_earliest_offset() -> None:
    offsets = {**OFF, ("t", 2): PartitionOffsets(2, 6)}
    got = pending_offsets({("t", 0): 10, ("t", 1): 5}, offsets, "latest")
    assert got == {("t", 2): 4}


def test_position_behind_retention_counts_only_what_is_still_there() -> None:
    offsets = {("t", 0): PartitionOffsets(8, 10)}
    assert pending_offsets({("t", 0): 3}, offsets, "earliest") == {("t", 0): 2}


def test_describe_is_json_keys() -> None:
    assert describe({("a.b", 3): 4}) == {"a.b/3": 4}


def test_a_failed_batchs_retry_waits_double_per_failure_up_to_an_hour() -> None:
    from offsetflow.plan.arrival import RETRY_CAP_S, retry_wait

    assert retry_wait(0, 0.0, 30.0) == 0.0  # never failed
    assert retry_wait(1, 0.0, 30.0) == 30.0  # the first failure: one poll interval
    assert retry_wait(1, 10.0, 30.0) == 20.0
    assert retry_wait(3, 0.0, 30.0) == 120.0
    assert retry_wait(3, 500.0, 30.0) == 0.0  # due
    assert retry_wait(40, 0.0, 30.0) == RETRY_CAP_S == 900.0
    assert retry_wait(2, -5.0, 30.0) == 60.0  # a clock behind the failure: the full wait


def test_an_open_batch_waits_while_its_run_lives_and_by_attempts_once_it_died() -> None:
    import math

    from offsetflow.plan import open_batch_retry

    held = ("pid 9 (client local, application offsetflow, connected 2026-01-01 UTC)",)
    live = open_batch_retry(7, "running", 2, 1.0, held, 30.0)
    assert live is not None and (live.state, live.wait_s) == ("live", math.inf)
    assert (live.holders, live.running_s) == (held, 1.0)
    # a live run counts whatever the status says (another run of it failed meanwhile)
    failed_but_live = open_batch_retry(7, "failed", 2, 1.0, held, 30.0)
    assert failed_but_live is not None and failed_but_live.state == "live"
    died = open_batch_retry(7, "running", 3, 20.0, (), 30.0)
    assert died is not None and (died.state, died.wait_s) == ("died", 100.0)
    failed = open_batch_retry(7, "failed", 1, 10.0, (), 30.0)
    assert failed is not None and (failed.state, failed.wait_s) == ("failed", 20.0)
    unknown = open_batch_retry(7, "running", 3, None, (), 30.0)
    assert unknown is not None and unknown.wait_s == 0.0  # no start recorded: due
    assert open_batch_retry(7, "planned", 0, None, (), 30.0) is None
