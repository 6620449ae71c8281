"""Per-pipeline Airflow stats after a publish: lag, records read, rows written, dead letters
and commit time, through Airflow's own `Stats` (StatsD, Datadog or OTel, as configured in
`[metrics]`; nothing is sent when metrics are off).

Names (the pipeline name is a valid stat name segment: ``[a-z][a-z0-9_]*``):

    offsetflow.<pipeline>.records_read     counter, per committed batch
    offsetflow.<pipeline>.rows_written     counter
    offsetflow.<pipeline>.dead_letters     counter (records routed to the dead-letter table)
    offsetflow.<pipeline>.batches          counter
    offsetflow.<pipeline>.commit_duration  timer (StatsD: milliseconds), per batch
    offsetflow.<pipeline>.lag              gauge: offsets behind Kafka's last stable offsets
                                           after the commit (absent when Kafka did not answer)

Each also carries the tag ``pipeline`` for backends with tags (OTel, Datadog).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

PREFIX = "offsetflow"


@dataclass(frozen=True)
class Metric:
    kind: str  # incr | gauge | timing
    name: str
    value: float


def batch_metrics(pipeline: str, batches: Iterable[Mapping[str, Any]],
                  lag: int | None) -> list[Metric]:
    """What to send for the published batches (figures as publish_task logs them)."""
    base = f"{PREFIX}.{pipeline}"
    out: list[Metric] = []
    for b in batches:
        out += [Metric("incr", f"{base}.batches", 1),
                Metric("incr", f"{base}.records_read", int(b.get("records_read") or 0)),
                Metric("incr", f"{base}.rows_written", int(b.get("rows_written") or 0)),
                Metric("incr", f"{base}.dead_letters", int(b.get("bad_records") or 0))]
        commit_s = (b.get("timings") or {}).get("commit_s")
        if commit_s is not None:
            out.append(Metric("timing", f"{base}.commit_duration", float(commit_s)))
    if lag is not None:
        out.append(Metric("gauge", f"{base}.lag", lag))
    return out


def emit(pipeline: str, metrics: Iterable[Metric]) -> None:
    from airflow.sdk.observability.stats import Stats

    tags = {"pipeline": pipeline}
    for m in metrics:
        if m.kind == "incr":
            Stats.incr(m.name, int(m.value), tags=tags)
        elif m.kind == "gauge":
            Stats.gauge(m.name, m.value, tags=tags)
        else:
            Stats.timing(m.name, timedelta(seconds=m.value), tags=tags)
