"""Adaptive batch sizing (`source.rate: {adaptive: pid}`): Spark Streaming's PID rate
estimator (`PIDRateEstimator`, `spark.streaming.backpressure.pid.*`), as pure code.

Spark keeps the estimator's state in the driver's memory; OffsetFlow keeps it in the ledger:
each scheduled batch records the rate it was sized for, why, and the state after the update
(`RateDecision.record`), and the next plan starts from that record and the observation of
the last committed batch. So a plan is a function of the ledger, and a re-plan repeats it.

The update is Spark's, term for term (rates in records per second, times in milliseconds):

    processing_rate = records / processing_ms * 1000
    error           = latest_rate - processing_rate
    historical      = scheduling_ms * processing_rate / interval_ms      (the integral)
    d_error         = (error - latest_error) / ((time_ms - latest_time_ms) / 1000)
    new_rate        = max(latest_rate - proportional * error - integral * historical
                          - derived * d_error, min_rate)

skipped unless time_ms > latest_time_ms, records > 0 and processing_ms > 0 (and when the
update overflows: large gains; the last rate and state are kept); the first
update only takes the processing rate as its latest rate (no estimate yet). A batch is sized
for `rate * interval` offsets (Spark's `maxMessagesPerPartition` times the partitions),
within the configured caps: `max_records_per_batch` and `max_records_per_partition` win over
the rate, and `min_rate` only bounds the rate.

What OffsetFlow observes of a batch (`observe`): its records are its offsets (Spark's direct
Kafka stream counts its ranges' offsets too); its time is when it was planned; its
processing time is its last run's steps as the driver timed them (`batches.timings`); its
scheduling delay is the wait behind the previous run: from its real due time
(`batches.due_at`, the DAG run's data interval end or the trigger's time, migration 0011)
until the previous batch finished or its own run started, whichever came first. A run that
waited behind an overrunning one is the backlog Spark's integral term reads; Airflow's
start-up, a pool queue or a clock offset are not (the batch's own statistics, due ->
started, still show them); an idle gap is none (no run was due). A batch with no
real due time (planned before 0011, or by the CLI, whose due time is the plan itself) is
estimated from plan times instead: how much later than one interval after the previous
scheduled batch it was planned while that batch was still running (`scheduling_delay_ms`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from offsetflow.config import RateConfig


@dataclass(frozen=True)
class PidState:
    """Spark's estimator fields after an update; `first_run` until the first observation."""

    latest_time_ms: int = -1
    latest_rate: float = -1.0
    latest_error: float = -1.0
    first_run: bool = True


@dataclass(frozen=True)
class Observation:
    """One committed batch as the estimator sees it."""

    batch_id: int
    time_ms: int
    records: int
    processing_ms: int
    scheduling_ms: int

    @property
    def processing_rate(self) -> float:
        return self.records / self.processing_ms * 1000


@dataclass(frozen=True)
class PidStep:
    """One update: the new state, the rate (None: no estimate, Spark's `None`) and terms."""

    state: PidState
    rate: float | None
    error: float = 0.0
    historical_error: float = 0.0
    d_error: float = 0.0
    skipped: str = ""  # why nothing was updated


def pid_update(state: PidState, rate: RateConfig, interval_ms: float, time_ms: int,
               records: int, processing_ms: int, scheduling_ms: int) -> PidStep:
    """Spark's `PIDRateEstimator.compute` (see the module docstring)."""
    if not (time_ms > state.latest_time_ms and records > 0 and processing_ms > 0):
        why = ("no batch since the last estimate" if time_ms <= state.latest_time_ms
               else "the batch read nothing or took no time")
        return PidStep(state, None, skipped=why)
    delay_since_update = (time_ms - state.latest_time_ms) / 1000
    processing_rate = records / processing_ms * 1000
    error = state.latest_rate - processing_rate
    historical = scheduling_ms * processing_rate / interval_ms
    d_error = (error - state.latest_error) / delay_since_update
    new_rate = max(state.latest_rate - rate.proportional * error
                   - rate.integral * historical - rate.derived * d_error, rate.min_rate)
    if not all(math.isfinite(v) for v in (processing_rate, error, historical, d_error,
                                          new_rate)):
        # large gains overflow (inf, inf - inf = nan): such a state would size nothing
        # (ceil(inf)) and the ledger's jsonb refuses it, on every plan from then on
        return PidStep(state, None, skipped="the update overflowed (are the gains too large?)")
    if state.first_run:
        return PidStep(PidState(time_ms, processing_rate, 0.0, False), None, error,
                       historical, d_error)
    return PidStep(PidState(time_ms, new_rate, error, False), new_rate, error, historical,
                   d_error)


def _ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


# the driver's steps of a run, as it records them in `batches.timings` (seconds)
RUN_STEPS = ("prepare_s", "read_stage_s", "quality_s", "commit_s")


def processing_ms(b: Mapping[str, Any]) -> int | None:
    """A committed batch's processing time: its last run's steps as the driver timed them;
    without those, its start to its commit (`finished_at` is the commit transaction's start,
    which the part-wise commit opens while parts are still being staged: too short)."""
    timings = b.get("timings") or {}
    if timings.get("read_stage_s") is not None:
        return int(round(1000 * sum(float(timings.get(k) or 0) for k in RUN_STEPS)))
    if b.get("started_at") is None or b.get("finished_at") is None:
        return None
    return _ms(b["finished_at"]) - _ms(b["started_at"])


# due times that a schedule or a trigger set (the CLI's "plan" is the plan's own time)
REAL_DUE = ("schedule", "trigger")


def scheduling_delay_ms(b: Mapping[str, Any], before: Mapping[str, Any] | None,
                        interval_s: float) -> float:
    """How long `b` waited past its due time *behind `before`'s run*: the backlog the rate
    controls. With a real due time (`due_at` of a schedule or a trigger): from due until
    `before` finished or `b` started, whichever came first. Airflow's task start-up, a queue
    for a pool slot or a clock offset between Airflow and the ledger are not this pipeline's
    backlog, and counted (due -> started, the batch's own statistic) a constant 300 s of
    them would hold the rate at `min_rate` for good (review of the due-time change).
    Without a real due time, estimated from plan times: how long `b` waited behind
    `before`'s run past one interval after `before` was planned, only while `before` was
    still running. Either way an idle gap (plans that found nothing to read plan no batch)
    is no delay: Spark plans an empty batch every interval, so its scheduling delay never
    holds idle time, and counted here the integral term would throw the rate to `min_rate`
    when the next burst comes."""
    if b.get("due_at") is not None and b.get("started_at") is not None \
            and b.get("due_source") in REAL_DUE:
        if before is None or before.get("finished_at") is None:
            return 0
        return min(_ms(b["started_at"]), _ms(before["finished_at"])) - _ms(b["due_at"])
    if before is None:
        return 0
    busy_until = _ms(b["planned_at"])
    if before.get("finished_at") is not None:
        busy_until = min(busy_until, _ms(before["finished_at"]))
    return busy_until - _ms(before["planned_at"]) - interval_s * 1000


def observe(batches: Sequence[Mapping[str, Any]], interval_s: float) -> Observation | None:
    """The last committed scheduled batch of `batches` (ledger rows, newest first: batch_id,
    status, offsets, planned_at, started_at, finished_at, timings, due_at, due_source), or
    None."""
    for i, b in enumerate(batches):
        if b["status"] != "committed":
            continue
        took = processing_ms(b)
        if took is None:
            return None
        late = scheduling_delay_ms(b, batches[i + 1] if i + 1 < len(batches) else None,
                                   interval_s)
        return Observation(batch_id=int(b["batch_id"]), time_ms=_ms(b["planned_at"]),
                           records=int(b["offsets"]), processing_ms=took,
                           scheduling_ms=int(max(0, late)))
    return None


@dataclass(frozen=True)
class RateDecision:
    """How the next scheduled batch is sized: `max_records` (None: by the caps only)."""

    rate: float | None  # records per second
    max_records: int | None  # the total cap this plan uses (rate and max_records_per_batch)
    limit: str  # what decides the total: "rate", "max_records_per_batch" or "none"
    why: str
    state: PidState
    step: PidStep | None = None
    observation: Observation | None = None
    interval_s: float = 0.0

    def record(self) -> dict[str, Any]:
        """What the ledger keeps with the batch (`batches.rate`)."""
        out: dict[str, Any] = {
            "adaptive": "pid", "rate": _round(self.rate), "interval_s": self.interval_s,
            "max_records": self.max_records, "limit": self.limit, "why": self.why,
            "state": asdict(self.state)}
        if self.observation is not None:
            o = self.observation
            out["observed"] = {**asdict(o), "processing_rate": _round(o.processing_rate)}
        if self.step is not None and not self.step.skipped:
            out["terms"] = {"error": _round(self.step.error),
                            "historical_error": _round(self.step.historical_error),
                            "d_error": _round(self.step.d_error)}
        return out


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def state_of(record: Mapping[str, Any] | None) -> PidState:
    """The estimator state a batch's rate record left (a fresh one without a record)."""
    if not record or not isinstance(record.get("state"), Mapping):
        return PidState()
    s = record["state"]
    return PidState(int(s["latest_time_ms"]), float(s["latest_rate"]),
                    float(s["latest_error"]), bool(s["first_run"]))


def observed_time_ms(previous: Mapping[str, Any] | None, state: PidState,
                     observation: Observation) -> int:
    """The observation's time for the update. A batch newer than the one the state last
    observed is a new observation even when the ledger's clock says otherwise (it ran ahead
    when the state was written, then was corrected, or a failover changed servers): then
    its time is the state's plus its processing time, or the estimator would keep its rate
    until the clock caught up. The same batch again stays no new observation."""
    seen = previous.get("observed") if previous else None
    seen_id = seen.get("batch_id") if isinstance(seen, Mapping) else None
    if isinstance(seen_id, int) and observation.batch_id > seen_id \
            and observation.time_ms <= state.latest_time_ms:
        return state.latest_time_ms + max(1, observation.processing_ms)
    return observation.time_ms


def decide_rate(rate: RateConfig, previous: Mapping[str, Any] | None,
                observation: Observation | None,
                max_records_per_batch: int | None) -> RateDecision:
    """Size the next scheduled batch: update the estimator of the `previous` rate record
    (the newest batch that has one) with `observation` (the last committed batch), then
    turn the rate into a total record cap within `max_records_per_batch`."""
    assert rate.adaptive == "pid" and rate.interval_s, "pid needs source.rate.interval_s"
    interval_s = rate.interval_s
    state = state_of(previous)
    kept = previous.get("rate") if previous else None
    step: PidStep | None = None
    if observation is None:
        new_rate, why = kept, "no committed batch to observe yet"
    else:
        step = pid_update(state, rate, interval_s * 1000,
                          observed_time_ms(previous, state, observation),
                          observation.records, observation.processing_ms,
                          observation.scheduling_ms)
        state = step.state
        o = observation
        seen = (f"batch {o.batch_id}: {o.records} offsets in {o.processing_ms / 1000:.3f} s "
                f"= {o.processing_rate:.1f}/s, {o.scheduling_ms / 1000:.3f} s late")
        if step.skipped:
            new_rate, why = kept, f"{step.skipped} ({seen}): rate kept"
        elif step.rate is None:
            new_rate, why = kept, (f"first observation ({seen}); the estimator starts from "
                                   f"it and sizes from the next batch on")
        else:
            new_rate = step.rate
            why = (f"{seen}; error {step.error:.1f}/s, historical {step.historical_error:.1f}"
                   f"/s, d_error {step.d_error:.3f}/s^2 -> {new_rate:.1f}/s"
                   + (" (min_rate)" if new_rate == rate.min_rate else ""))
    offsets = None if new_rate is None else float(new_rate) * interval_s
    # a rate so high that rate * interval overflows limits nothing
    by_rate = max(1, math.ceil(offsets)) if offsets is not None and math.isfinite(offsets) \
        else None
    caps = [(n, c) for n, c in (("rate", by_rate),
                                ("max_records_per_batch", max_records_per_batch))
            if c is not None]
    limit, total = min(caps, key=lambda nc: nc[1]) if caps else ("none", None)
    if limit == "max_records_per_batch" and by_rate is not None:
        why += f"; {by_rate} offsets for {interval_s:g} s capped by max_records_per_batch"
    return RateDecision(rate=None if new_rate is None else float(new_rate), max_records=total,
                        limit=limit, why=why, state=state, step=step, observation=observation,
                        interval_s=interval_s)
