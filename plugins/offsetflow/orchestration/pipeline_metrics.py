"""Per-pipeline Airflow stats, through Airflow's own `Stats` (StatsD, Datadog or OTel, as
configured in `[metrics]`; nothing is sent when metrics are off). Pure: what to send; `emit`
sends it.

The pipeline is the tag ``pipeline``, never part of a name, so one alert rule or dashboard
covers every pipeline. Plain StatsD has no tags: turn on ``[metrics]
statsd_influxdb_enabled`` (Airflow appends ``,pipeline=<name>`` to the name, InfluxDB/Telegraf
style, which Telegraf and Prometheus' statsd_exporter read as a tag), or Datadog
(``statsd_datadog_enabled``) or OTel, which carry tags natively.

    offsetflow.lag                 gauge: offsets behind Kafka's last stable offsets; sent on
                                   every plan, every failed run and after every publish
    offsetflow.oldest_unread_age   gauge: seconds since the oldest record not yet committed
                                   was written (0: nothing unread); sent with the lag
    offsetflow.batches             counter: committed batches
    offsetflow.records_read        counter
    offsetflow.rows_written        counter
    offsetflow.dead_letters        counter: records routed to the dead-letter table
    offsetflow.batches_failed      counter: runs of a batch that failed
    offsetflow.batches_retried     counter: runs of a batch an earlier run failed
    offsetflow.batches_abandoned   counter: batches a plan abandoned (unreadable)
    offsetflow.commit_duration     timer (StatsD: milliseconds): the commit, per batch
    offsetflow.batch_duration      timer: its last run's start to its commit, per batch
    offsetflow.batch_rate          gauge: records/s an adaptive rate sized the batch for
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

PREFIX = "offsetflow"
TAG = "pipeline"


@dataclass(frozen=True)
class Metric:
    kind: str  # incr | gauge | timing
    name: str
    value: float


def _name(what: str) -> str:
    return f"{PREFIX}.{what}"


def batch_metrics(batches: Iterable[Mapping[str, Any]]) -> list[Metric]:
    """What to send for published batches (figures as publish_task logs them)."""
    out: list[Metric] = []
    for b in batches:
        out += [Metric("incr", _name("batches"), 1),
                Metric("incr", _name("records_read"), int(b.get("records_read") or 0)),
                Metric("incr", _name("rows_written"), int(b.get("rows_written") or 0)),
                Metric("incr", _name("dead_letters"), int(b.get("bad_records") or 0))]
        timings = b.get("timings") or {}
        if timings.get("commit_s") is not None:
            out.append(Metric("timing", _name("commit_duration"), float(timings["commit_s"])))
        if b.get("duration_s") is not None:
            out.append(Metric("timing", _name("batch_duration"), float(b["duration_s"])))
    return out


def lag_metrics(lag: int | None, oldest_unread_age_s: float | None) -> list[Metric]:
    """The lag gauges (each left out when it could not be measured)."""
    out = []
    if lag is not None:
        out.append(Metric("gauge", _name("lag"), lag))
    if oldest_unread_age_s is not None:
        out.append(Metric("gauge", _name("oldest_unread_age"), round(oldest_unread_age_s, 3)))
    return out


def count(what: str, n: int) -> list[Metric]:
    """A counter (`batches_failed`, `batches_retried`, `batches_abandoned`), if n > 0."""
    return [Metric("incr", _name(what), n)] if n > 0 else []


def rate_metric(rate: float | None) -> list[Metric]:
    return [] if rate is None else [Metric("gauge", _name("batch_rate"), round(rate, 3))]


# Airflow's Stats, as a task process (or a test) has it loaded and initialized
STATS_MODULES = ("airflow.sdk.observability.stats",
                 "airflow.sdk._shared.observability.metrics.stats")


def stats_loaded() -> bool:
    """In an Airflow process (its task runner initializes Stats). Outside one (a script
    calling the task functions) nothing would be sent, and importing Airflow would take over
    the process's logging: nothing is measured or sent there."""
    return any(m in sys.modules for m in STATS_MODULES)


def emit(pipeline: str, metrics: Iterable[Metric]) -> None:
    """Send through Airflow's Stats (nothing outside an Airflow process: `stats_loaded`)."""
    if not stats_loaded():
        return
    from airflow.sdk.observability.stats import Stats

    tags = {TAG: pipeline}
    for m in metrics:
        if m.kind == "incr":
            Stats.incr(m.name, int(m.value), tags=tags)
        elif m.kind == "gauge":
            Stats.gauge(m.name, m.value, tags=tags)
        else:
            Stats.timing(m.name, timedelta(seconds=m.value), tags=tags)
