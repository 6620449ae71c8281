"""Batch timings: when a batch was due and what follows from its timestamps (scheduling
delay, processing time, total delay, input and processing rate), as Spark's Streaming
Statistics shows them per batch. Pure: the commit transaction computes `batch_stats` from
the batch's row and keeps it in `offsetflow.batches.stats`; the plugin page reads it back.

Spark's definitions, mapped onto a ledger batch:

- scheduling delay: due -> started (the start of the attempt that committed; time lost to
  failed attempts and to waiting for a slot is scheduling delay, as a queued Spark batch's);
- processing time: started -> committed (read, stage, quality, commit);
- total delay: due -> committed (= scheduling delay + processing time);
- input rate: records / the scheduling interval (due time since the previous scheduled
  batch's due time); None for backfills and replays, whose records arrived long ago;
- processing rate: records / processing time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

DUE_SOURCES = ("schedule", "trigger", "plan")


@dataclass(frozen=True)
class Due:
    """When a batch was due and what said so: an Airflow run's schedule (its data interval
    end), a trigger's time (manual runs, backfills, replays), or the plan itself (CLI)."""

    at: datetime | None  # None: the plan's own time (the ledger's now())
    source: str = "plan"

    def __post_init__(self) -> None:
        if self.source not in DUE_SOURCES:
            raise ValueError(f"due source must be one of {DUE_SOURCES}, not {self.source!r}")
        if self.at is not None and self.at.tzinfo is None:
            raise ValueError("a due time needs a time zone")


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    """end - start in seconds, never negative (Airflow's clock and the ledger database's
    may differ by a little: a due time a few ms after the start is no delay)."""
    if start is None or end is None:
        return None
    return round(max(0.0, (end - start).total_seconds()), 3)


def _rate(records: int | None, seconds: float | None) -> float | None:
    if records is None or not seconds:
        return None
    return round(records / seconds, 3)


def batch_stats(*, due_at: datetime | None, started_at: datetime | None,
                staged_at: datetime | None, committed_at: datetime | None,
                records: int | None, interval_s: float | None) -> dict[str, Any]:
    """The derived figures of one batch (module docstring); a figure whose inputs are
    unknown is None. `interval_s`: the scheduling interval behind the input rate (None for
    backfills, replays and a pipeline's first batch)."""
    processing = _seconds(started_at, committed_at)
    return {
        "scheduling_delay_s": _seconds(due_at, started_at),
        "processing_s": processing,
        "read_stage_s": _seconds(started_at, staged_at),
        "commit_phase_s": _seconds(staged_at, committed_at),
        "total_delay_s": _seconds(due_at, committed_at),
        "interval_s": None if interval_s is None else round(interval_s, 3),
        "input_rate": _rate(records, interval_s),
        "processing_rate": _rate(records, processing),
    }
