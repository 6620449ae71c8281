"""Batch timings (issue 31 item 1): the figures the commit derives from a batch's times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from offsetflow.ledger import Due, batch_stats

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_spark_definitions_from_due_start_staged_and_commit() -> None:
    s = batch_stats(due_at=at(0), started_at=at(4), staged_at=at(10), committed_at=at(12),
                    records=600, interval_s=60)
    assert s == {"scheduling_delay_s": 4.0, "processing_s": 8.0, "read_stage_s": 6.0,
                 "commit_phase_s": 2.0, "total_delay_s": 12.0, "interval_s": 60.0,
                 "input_rate": 10.0, "processing_rate": 75.0}
    # total delay = scheduling delay + processing time, as on Spark's tab
    assert s["total_delay_s"] == s["scheduling_delay_s"] + s["processing_s"]


def test_unknown_inputs_give_unknown_figures() -> None:
    s = batch_stats(due_at=None, started_at=at(4), staged_at=None, committed_at=at(12),
                    records=None, interval_s=None)
    assert s["scheduling_delay_s"] is None and s["total_delay_s"] is None
    assert s["read_stage_s"] is None and s["commit_phase_s"] is None
    assert s["input_rate"] is None and s["processing_rate"] is None
    assert s["processing_s"] == 8.0


def test_a_replay_has_no_input_rate_but_a_processing_rate() -> None:
    s = batch_stats(due_at=at(0), started_at=at(1), staged_at=at(2), committed_at=at(3),
                    records=100, interval_s=None)
    assert s["input_rate"] is None and s["processing_rate"] == 50.0


def test_clock_skew_is_no_negative_delay() -> None:
    """Airflow's clock (the due time) may be a little ahead of the ledger database's."""
    s = batch_stats(due_at=at(0.05), started_at=at(0), staged_at=at(1), committed_at=at(2),
                    records=10, interval_s=0)
    assert s["scheduling_delay_s"] == 0.0 and s["total_delay_s"] == 1.95
    assert s["input_rate"] is None  # no interval: no rate (not a division by zero)


def test_due_needs_a_known_source_and_a_time_zone() -> None:
    assert Due(None).source == "plan"
    with pytest.raises(ValueError, match="due source"):
        Due(T0, "cron")
    with pytest.raises(ValueError, match="time zone"):
        Due(datetime(2026, 1, 1), "schedule")
