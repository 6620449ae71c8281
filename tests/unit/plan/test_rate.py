"""Adaptive batch sizing: the estimator against values worked out by hand from Spark's
`PIDRateEstimator.compute`, the ledger observation, the caps, and a simulation of a
scheduled pipeline (pure: the real planner and estimator, a model of Kafka and Spark)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from offsetflow.config import RateConfig, StartingPolicy, schedule_interval_s
from offsetflow.plan import PidState, decide_rate, observe, pid_update
from offsetflow.plan.planner import plan_batch
from offsetflow.ranges import PartitionOffsets

PID = RateConfig(adaptive="pid", interval_s=10.0)  # Spark's defaults: 1.0, 0.2, 0.0, 100
AFTER_FIRST = PidState(latest_time_ms=10_000, latest_rate=2500.0, latest_error=0.0,
                       first_run=False)


def test_first_observation_only_seeds_the_estimator() -> None:
    # 5000 records in 2 s: 2500/s becomes the latest rate; Spark returns None
    step = pid_update(PidState(), PID, 10_000, time_ms=10_000, records=5000,
                      processing_ms=2000, scheduling_ms=0)
    assert step.rate is None
    assert step.state == AFTER_FIRST


def test_update_matches_sparks_formula_by_hand() -> None:
    # processing rate 30000 / 15 s = 2000/s; error = 2500 - 2000 = 500;
    # historical = 5000 ms * 2000 / 10000 ms = 1000; d_error = (500 - 0) / 10 s = 50;
    # new = 2500 - 1.0 * 500 - 0.2 * 1000 - 0.0 * 50 = 1800
    step = pid_update(AFTER_FIRST, PID, 10_000, time_ms=20_000, records=30_000,
                      processing_ms=15_000, scheduling_ms=5000)
    assert (step.error, step.historical_error, step.d_error) == (500.0, 1000.0, 50.0)
    assert step.rate == pytest.approx(1800.0)
    assert step.state == PidState(20_000, 1800.0, 500.0, False)
    # with derived: 0.5 the derivative term takes 0.5 * 50 = 25 more
    derived = dataclasses.replace(PID, derived=0.5)
    assert pid_update(AFTER_FIRST, derived, 10_000, 20_000, 30_000, 15_000,
                      5000).rate == pytest.approx(1775.0)
    # next batch: 18000 in 9 s = 2000/s, on time: error = 1800 - 2000 = -200, new = 2000;
    # d_error = (-200 - 500) / 10 = -70
    nxt = pid_update(step.state, PID, 10_000, 30_000, 18_000, 9000, 0)
    assert nxt.rate == pytest.approx(2000.0)
    assert nxt.d_error == pytest.approx(-70.0)


def test_min_rate_bounds_the_estimate() -> None:
    # 10 records in 1 s: 1800 - (1800 - 10) = 10, below min_rate 100
    state = PidState(20_000, 1800.0, 500.0, False)
    assert pid_update(state, PID, 10_000, 30_000, 10, 1000, 0).rate == 100.0


@pytest.mark.parametrize(("time_ms", "records", "processing_ms"),
                         [(20_000, 100, 1000), (30_000, 0, 1000), (30_000, 100, 0)])
def test_skipped_like_spark(time_ms: int, records: int, processing_ms: int) -> None:
    state = PidState(20_000, 1800.0, 500.0, False)
    step = pid_update(state, PID, 10_000, time_ms, records, processing_ms, 0)
    assert step.rate is None and step.state == state and step.skipped


T = datetime(2026, 1, 1, tzinfo=UTC)


def at(s: float | None) -> datetime | None:
    return None if s is None else T + timedelta(seconds=s)


def row(batch_id: int, status: str, offsets: int, planned: float, started: float | None = None,
        finished: float | None = None) -> dict[str, Any]:
    return {"batch_id": batch_id, "status": status, "offsets": offsets,
            "planned_at": at(planned), "started_at": at(started), "finished_at": at(finished)}


def test_observation_from_the_ledger() -> None:
    # batch 2 was planned 25 s after batch 1 with a 10 s interval, when batch 1's run (which
    # overran) committed: 15 s late; it ran 12 s
    obs = observe([row(2, "committed", 3000, 25, 26, 38), row(1, "committed", 100, 0, 1, 25)],
                  10.0)
    assert obs is not None
    assert (obs.batch_id, obs.records, obs.processing_ms, obs.scheduling_ms) == (
        2, 3000, 12_000, 15_000)
    assert observe([row(1, "committed", 100, 0, 1, 2)], 10.0).scheduling_ms == 0  # type: ignore[union-attr]
    assert observe([], 10.0) is None
    # the driver's timings win over started -> finished (the commit's transaction start)
    timed = {**row(2, "committed", 3000, 25, 26, 28),
             "timings": {"prepare_s": 1.0, "read_stage_s": 9.5, "commit_s": 0.5,
                         "commit_overlapped_s": 2.0}}
    assert observe([timed], 10.0).processing_ms == 11_000  # type: ignore[union-attr]


def test_decision_caps_and_record() -> None:
    obs = observe([row(2, "committed", 30_000, 20, 25, 40), row(1, "committed", 5000, 10, 11, 13)],
                  10.0)
    previous = {"rate": None, "state": dataclasses.asdict(AFTER_FIRST)}
    d = decide_rate(PID, previous, obs, max_records_per_batch=None)
    # observed: 30000 in 15 s = 2000/s, planned 0 s late (10 s after batch 1): 2500 - 500
    assert d.rate == pytest.approx(2000.0) and d.max_records == 20_000 and d.limit == "rate"
    capped = decide_rate(PID, previous, obs, max_records_per_batch=12_000)
    assert (capped.max_records, capped.limit) == (12_000, "max_records_per_batch")
    rec = d.record()
    assert rec["rate"] == 2000.0 and rec["observed"]["batch_id"] == 2
    assert rec["state"]["latest_rate"] == pytest.approx(2000.0)
    assert "batch 2: 30000 offsets" in rec["why"]
    # the same observation again (a re-plan after an empty plan): nothing new, rate kept
    again = decide_rate(PID, rec, obs, None)
    assert again.rate == pytest.approx(2000.0) and "rate kept" in again.why
    # no record and nothing committed yet: the caps only
    none = decide_rate(PID, None, None, 500)
    assert (none.rate, none.max_records, none.limit) == (None, 500, "max_records_per_batch")


def test_schedule_interval() -> None:
    assert schedule_interval_s("*/5 * * * *") == 300
    assert schedule_interval_s("@hourly") == 3600
    assert schedule_interval_s(None) is None and schedule_interval_s("@once") is None


# -- simulation ------------------------------------------------------------------------------

def simulate(arrival: float, capacity: float, interval: float, batches: int,
             adaptive: bool, overhead: float = 5.0) -> list[dict[str, float]]:
    """A scheduled pipeline over one partition: records arrive at `arrival`/s; a batch of n
    offsets takes `overhead + n / capacity` s; runs are due every `interval` s and a run
    that overruns delays the next (Airflow's max_active_runs=1 queue). Each plan goes through
    `observe`, `decide_rate` and `plan_batch` with the ledger rows a real run would leave."""
    rate_cfg = RateConfig(adaptive="pid", interval_s=interval)
    tp = ("t", 0)
    rows: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    position, due, free_at = 0, interval, 0.0
    out = []
    for k in range(batches):
        start = max(due, free_at)
        latest = int(arrival * start)
        cap = None
        if adaptive:
            d = decide_rate(rate_cfg, previous, observe(rows[::-1][:2], interval), None)
            cap, previous = d.max_records, d.record()
        plan = plan_batch({tp: position} if k else {}, {tp: PartitionOffsets(0, latest)},
                          StartingPolicy("earliest"), 10**12, cap)
        n = plan.offset_span
        took = overhead + n / capacity
        rows.append(row(k + 1, "committed", n, start, start, start + took))
        position += n
        free_at = start + took
        out.append({"start": start, "records": n, "took": took, "late": start - due,
                    "lag": int(arrival * free_at) - position})
        due = max(due + interval, free_at // interval * interval)
    return out


def test_simulation_over_capacity_batch_time_converges_near_the_interval() -> None:
    # arrivals twice what a batch can process in its interval (capacity 1000/s, 2000/s in)
    fixed = simulate(2000, 1000, 60, 40, adaptive=False)
    pid = simulate(2000, 1000, 60, 40, adaptive=True)
    # fixed caps: every batch takes all the lag, so each one takes longer than the last
    assert fixed[9]["took"] > 10 * 60 and fixed[9]["took"] > fixed[4]["took"] * 1.5
    # PID: the last 20 batches each take about the interval, and start about on time
    tail = pid[-20:]
    assert all(0.85 * 60 <= b["took"] <= 1.15 * 60 for b in tail), [b["took"] for b in tail]
    assert max(b["late"] for b in tail) < 0.5 * 60
    # what a batch reads converges to what fits in the interval: (60 - 5) s * 1000/s
    assert tail[-1]["records"] == pytest.approx(55_000, rel=0.05)


def test_simulation_below_capacity_lag_stays_bounded() -> None:
    # arrivals at half the capacity: batches take what arrived, the lag never builds up
    pid = simulate(500, 1000, 60, 40, adaptive=True)
    assert max(b["lag"] for b in pid) <= 500 * 60 * 1.2
    assert all(b["took"] < 60 for b in pid[1:])
    assert pid[-1]["records"] == pytest.approx(500 * 60, rel=0.05)


@pytest.mark.parametrize("gains", [{"proportional": 1e308},
                                   {"proportional": 1e308, "derived": 1e308}])
def test_an_update_that_overflows_keeps_the_last_rate(gains: dict[str, float]) -> None:
    # finite gains whose terms overflow to inf (or inf - inf = nan) on a batch processed
    # faster than the last rate (300000 offsets in 15 s = 20000/s > 2500/s): the plan must
    # still be sized (a finite cap, a record jsonb takes), not raise on every plan
    cfg = dataclasses.replace(PID, **gains)
    previous = {"rate": 2500.0, "state": dataclasses.asdict(AFTER_FIRST)}
    obs = observe([row(2, "committed", 300_000, 20, 25, 40),
                   row(1, "committed", 5000, 10, 11, 13)], 10.0)
    assert obs is not None
    d = decide_rate(cfg, previous, obs, None)
    assert d.rate == 2500.0 and d.max_records == 25_000 and "overflowed" in d.why
    json.loads(json.dumps(d.record(), allow_nan=False))


def test_an_idle_gap_is_not_a_scheduling_delay() -> None:
    # batch 1 ran 5 s of its 60 s interval; then nothing arrived for an hour (plans found
    # nothing to read, no batch); batch 2 read a burst at 2000/s. Nothing waited behind a
    # run: Spark plans an empty batch every interval, so its scheduling delay is never idle
    # time. Counted as an hour late, the integral term would throw the rate to min_rate
    # right when the burst needs it.
    rows = [row(2, "committed", 20_000, 3600, 3600, 3610), row(1, "committed", 5000, 0, 0, 5)]
    obs = observe(rows, 60.0)
    assert obs is not None and obs.scheduling_ms == 0
    state = dataclasses.asdict(PidState(int(at(0).timestamp() * 1000), 2000.0, 0.0, False))  # type: ignore[union-attr]
    d = decide_rate(dataclasses.replace(PID, interval_s=60.0), {"rate": 2000.0,
                                                                "state": state}, obs, None)
    assert d.rate == pytest.approx(2000.0), d.why
    # a run that overran its interval still delays the next: that is the backlog
    overran = observe([row(2, "committed", 20_000, 90, 90, 100),
                       row(1, "committed", 5000, 0, 0, 90)], 60.0)
    assert overran is not None and overran.scheduling_ms == 30_000


def test_a_clock_that_went_back_does_not_freeze_the_estimator() -> None:
    # batch 1 was planned while the ledger's clock ran an hour ahead (corrected since, or a
    # failover to another server): the state's latest time is in the future. Batch 2 is a
    # new batch all the same; "no batch since the last estimate" until the clock catches up
    # would keep the rate frozen (at min_rate, maybe) for that hour
    ahead = int(at(3600).timestamp() * 1000)  # type: ignore[union-attr]
    previous = {"rate": 100.0, "observed": {"batch_id": 1},
                "state": dataclasses.asdict(PidState(ahead, 100.0, 0.0, False))}
    obs = observe([row(2, "committed", 20_000, 60, 60, 70), row(1, "committed", 6000, 0, 0, 5)],
                  60.0)
    d = decide_rate(dataclasses.replace(PID, interval_s=60.0), previous, obs, None)
    assert d.step is not None and not d.step.skipped, d.why
    assert d.rate == pytest.approx(2000.0) and d.state.latest_time_ms > ahead
    # the same batch observed again is still no new batch
    again = decide_rate(dataclasses.replace(PID, interval_s=60.0), d.record(), obs, None)
    assert "rate kept" in again.why and again.rate == pytest.approx(2000.0)


def due(r: dict[str, Any], at_s: float, source: str = "schedule") -> dict[str, Any]:
    return {**r, "due_at": at(at_s), "due_source": source}


def test_the_scheduling_delay_is_the_wait_behind_the_previous_run_from_the_due_time() -> None:
    # batch 2's run was due at 60 s (its data interval end) and planned at 61 s; batch 1's
    # run overran to 90 s (max_active_runs=1 held batch 2's run back), batch 2 started at 92:
    # 30 s behind batch 1 past its due time (plan times, with batch 1 planned at 0, also
    # see it); the 2 s of task start-up after batch 1 finished are not backlog
    rows = [due(row(2, "committed", 20_000, 61, 92, 100), 60),
            due(row(1, "committed", 5000, 0, 0, 90), 0)]
    obs = observe(rows, 60.0)
    assert obs is not None and obs.scheduling_ms == 30_000
    # due -> started alone is no backlog: batch 1 had long committed (at 5 s) when batch 2
    # was due, and batch 2 started 30 s late (Airflow start-up, a pool queue, a clock offset)
    late_start = [due(row(2, "committed", 20_000, 61, 90, 100), 60),
                  due(row(1, "committed", 5000, 0, 0, 5), 0)]
    assert observe(late_start, 60.0).scheduling_ms == 0  # type: ignore[union-attr]
    # so a constant 300 s due -> started offset never pins the rate: each batch observes 0
    # a manual run's due time is its trigger's: real too (batch 1 ran until 70 s)
    triggered = [due(row(2, "committed", 20_000, 61, 72, 80), 60, "trigger"),
                 due(row(1, "committed", 5000, 0, 0, 70), 0)]
    assert observe(triggered, 60.0).scheduling_ms == 10_000  # type: ignore[union-attr]
    # the first batch has no run to wait behind
    first = [due(row(1, "committed", 5000, 61, 90, 100), 60)]
    assert observe(first, 60.0).scheduling_ms == 0  # type: ignore[union-attr]
    # no real due time (planned before migration 0011, or by the CLI: its due time is the
    # plan's own): estimated from plan times as before
    for r2 in (row(2, "committed", 20_000, 90, 91, 100),
               due(row(2, "committed", 20_000, 90, 91, 100), 90, "plan")):
        assert observe([r2, row(1, "committed", 5000, 0, 0, 90)],
                       60.0).scheduling_ms == 30_000  # type: ignore[union-attr]
    # an idle gap is still no delay: the run after an idle hour was due when it ran
    idle = [due(row(2, "committed", 20_000, 3600, 3600, 3610), 3600),
            due(row(1, "committed", 5000, 0, 0, 5), 0)]
    assert observe(idle, 60.0).scheduling_ms == 0  # type: ignore[union-attr]
