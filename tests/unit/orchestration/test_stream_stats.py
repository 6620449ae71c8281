"""The Streaming statistics view (issue 31 item 2): histograms, summaries, which batches are
replays, backfills or failed on the way, and where a DAG run's due time comes from."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from offsetflow.orchestration.operators import due_time
from offsetflow.orchestration.stream_stats import (
    chart_data,
    histogram,
    stage_split,
    stats_view,
    summary,
)

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC)


def test_histogram_bins_cover_every_value_once() -> None:
    h = histogram([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], bins=5)
    assert [b["count"] for b in h] == [2, 2, 2, 2, 3]  # the top edge is in the last bin
    assert h[0]["lo"] == 0 and h[-1]["hi"] == 10
    assert histogram([3.0, 3.0]) == [{"lo": 3.0, "hi": 3.0, "count": 2}]
    assert histogram([]) == []


def test_summary() -> None:
    assert summary([4, 1, 3, 2]) == {"avg": 2.5, "p50": 2.5, "max": 4, "n": 4}
    assert summary([]) == {"avg": None, "p50": None, "max": None, "n": 0}


def test_stage_split() -> None:
    assert stage_split({"read_stage_s": 3.0, "commit_phase_s": 1.0}) == {
        "read_stage_s": 3.0, "commit_phase_s": 1.0, "read_pct": 75.0, "commit_pct": 25.0}
    assert stage_split(None) is None and stage_split({"read_stage_s": 1.0}) is None


def _batch(bid: int, kind: str = "scheduled", status: str = "committed", attempts: int = 1,
           **stats: Any) -> dict[str, Any]:
    return {"batch_id": bid, "kind": kind, "status": status, "attempts": attempts,
            "due_at": (T0 + timedelta(minutes=bid)).isoformat(), "due_source": "schedule",
            "planned_at": None, "records_read": 10, "rows_written": 10, "error": None,
            "ranges": [{"topic": "t", "partition": 0, "from_offset": bid * 10,
                        "until_offset": bid * 10 + 10}],
            "stats": stats or None}


def test_view_orders_charts_oldest_first_and_names_windows_and_failures() -> None:
    batches = [  # as the ledger returns them: newest first
        _batch(4, status="failed", attempts=1),
        _batch(3, kind="replay", processing_s=2.0, total_delay_s=3.0),
        _batch(2, attempts=2, processing_s=5.0, total_delay_s=9.0, input_rate=1.5),
        _batch(1, processing_s=1.0, total_delay_s=1.5),
    ]
    v = stats_view({"pipeline": "p", "batches": batches, "partitions": [], "total_lag": 0})
    proc = next(m for m in v["metrics"] if m["key"] == "processing_s")
    assert [p["batch_id"] for p in proc["points"]] == [1, 2, 3]  # committed only, in order
    assert [p["had_failure"] for p in proc["points"]] == [False, True, False]
    assert proc["summary"]["max"] == 5.0 and sum(h["count"] for h in proc["histogram"]) == 3
    rate = next(m for m in v["metrics"] if m["key"] == "input_rate")
    assert [p["batch_id"] for p in rate["points"]] == [2]
    assert [b["batch_id"] for b in v["windows"]] == [3]
    assert [b["batch_id"] for b in v["failures"]] == [4, 2]
    assert [b["batch_id"] for b in v["recent"]] == [4, 3, 2, 1]
    charts = chart_data(v)
    c = next(m for m in charts["metrics"] if m["key"] == "processing_s")
    assert c["values"] == [1.0, 5.0, 2.0] and c["kinds"] == ["scheduled", "scheduled", "replay"]
    assert c["labels"] == ["12:01:00", "12:02:00", "12:03:00"]
    assert len(c["bins"]) == len(c["counts"]) and sum(c["counts"]) == 3


def test_due_time_of_each_kind_of_run() -> None:
    end, after, started = T0, T0 + timedelta(seconds=5), T0 + timedelta(seconds=9)

    def run(kind: str) -> dict[str, Any]:
        return {"dag_run": SimpleNamespace(run_type=kind, data_interval_end=end,
                                           logical_date=T0 - timedelta(minutes=5),
                                           run_after=after, start_date=started)}

    assert (due_time(run("scheduled")).at, due_time(run("scheduled")).source) == \
        (end, "schedule")
    assert (due_time(run("manual")).at, due_time(run("manual")).source) == (after, "trigger")
    assert due_time(run("asset_triggered")).at == after
    # Airflow's own backfill walks past intervals: due when it got to the run
    assert (due_time(run("backfill")).at, due_time(run("backfill")).source) == \
        (started, "trigger")
    assert due_time({}).source == "plan" and due_time({}).at is None
    naive = {"dag_run": SimpleNamespace(run_type="scheduled",
                                        data_interval_end=datetime(2026, 1, 1))}
    assert due_time(naive).at == datetime(2026, 1, 1, tzinfo=UTC)
