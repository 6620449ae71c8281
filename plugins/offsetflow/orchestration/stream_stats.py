"""The "Streaming statistics" view of one pipeline (like Spark's Streaming tab): per batch its
input rate, scheduling delay, processing time and total delay over time and as histograms,
the recent batches with their ranges and stage split, lag per partition, and which batches
were replays, backfills or failed on the way. Pure: built from the same status document the
CLI's `offsetflow status --json` prints (`offsetflow.ops.pipeline_status`), whose batches
carry the timings the commit kept in the ledger (`offsetflow.ledger.timing`). The plugin
renders it; the charts are drawn in the browser with the vendored Chart.js.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

# (key in a batch's stats, title, unit): the four of Spark's tab, then the processing rate
METRICS = (
    ("input_rate", "Input rate", "records/s"),
    ("scheduling_delay_s", "Scheduling delay", "s"),
    ("processing_s", "Processing time", "s"),
    ("total_delay_s", "Total delay", "s"),
    ("processing_rate", "Processing rate", "records/s"),
)


def histogram(values: Sequence[float], bins: int = 10) -> list[dict[str, Any]]:
    """Equal-width bins from the smallest to the largest value (one bin when they are all
    equal); each {lo, hi, count}; the last bin includes its upper edge."""
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi == lo:
        return [{"lo": lo, "hi": hi, "count": len(values)}]
    n = max(1, bins)
    width = (hi - lo) / n
    counts = [0] * n
    for v in values:
        counts[min(n - 1, int((v - lo) / width))] += 1
    return [{"lo": round(lo + i * width, 3), "hi": round(lo + (i + 1) * width, 3),
             "count": c} for i, c in enumerate(counts)]


def summary(values: Sequence[float]) -> dict[str, float | None]:
    """avg, median and max of a metric (None without values), as Spark's tab heads them."""
    if not values:
        return {"avg": None, "p50": None, "max": None, "n": 0}
    ordered = sorted(values)
    mid = len(ordered) // 2
    p50 = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"avg": round(sum(ordered) / len(ordered), 3), "p50": round(p50, 3),
            "max": round(ordered[-1], 3), "n": len(ordered)}


def _time(v: Any) -> datetime | None:
    if not v:
        return None
    t = datetime.fromisoformat(str(v))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def stage_split(stats: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A batch's processing time split into read+stage and the rest (quality, commit), as
    fractions for the bar the table draws; None before the batch committed."""
    if not stats:
        return None
    read, rest = stats.get("read_stage_s"), stats.get("commit_phase_s")
    if read is None or rest is None:
        return None
    total = read + rest
    frac = read / total if total > 0 else 1.0
    return {"read_stage_s": read, "commit_phase_s": rest, "read_pct": round(100 * frac, 1),
            "commit_pct": round(100 * (1 - frac), 1)}


def batch_row(b: Mapping[str, Any]) -> dict[str, Any]:
    """One batch as the page's table and charts show it."""
    stats = b.get("stats") or {}
    due = _time(b.get("due_at")) or _time(b.get("planned_at"))
    ranges = b.get("ranges") or []
    return {
        "batch_id": b["batch_id"], "kind": b["kind"], "status": b["status"],
        "attempts": b.get("attempts") or 0,
        # failed on the way: an attempt before the one that committed, or failed now
        "had_failure": b["status"] == "failed" or (b.get("attempts") or 0) > 1,
        "due": due.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if due else "-",
        "due_label": due.astimezone(UTC).strftime("%H:%M:%S") if due else f"#{b['batch_id']}",
        "due_source": b.get("due_source") or "-",
        "records": b.get("records_read"), "rows_written": b.get("rows_written"),
        "offsets": sum(r["until_offset"] - r["from_offset"] for r in ranges),
        "ranges": [f"{r['topic']}[{r['partition']}] {r['from_offset']:,}–{r['until_offset']:,}"
                   for r in ranges],
        "stats": {k: stats.get(k) for k, _, _ in METRICS},
        "split": stage_split(stats),
        "error": b.get("error"),
    }


def stats_view(status: Mapping[str, Any]) -> dict[str, Any]:
    """The page's data from a pipeline's status document (batches newest first, as the
    ledger returns them): chart series oldest first, histograms, summaries, the recent
    batches, partitions, and the replays/backfills and failures among the batches."""
    rows = [batch_row(b) for b in reversed(status.get("batches") or [])]
    done = [r for r in rows if r["status"] == "committed"]
    metrics = []
    for key, title, unit in METRICS:
        points = [{"batch_id": r["batch_id"], "label": r["due_label"], "kind": r["kind"],
                   "had_failure": r["had_failure"], "value": r["stats"][key]}
                  for r in done if r["stats"][key] is not None]
        values = [float(p["value"]) for p in points]
        metrics.append({"key": key, "title": title, "unit": unit, "points": points,
                        "histogram": histogram(values), "summary": summary(values)})
    return {
        "pipeline": status["pipeline"],
        "batches": rows,
        "recent": list(reversed(rows)),
        "metrics": metrics,
        "windows": [r for r in reversed(rows) if r["kind"] in ("replay", "backfill")],
        "failures": [r for r in reversed(rows) if r["had_failure"]],
        "partitions": status.get("partitions") or [],
        "total_lag": status.get("total_lag"),
        "kafka_error": status.get("kafka_error"),
        "committed": len(done),
    }


def chart_data(view: Mapping[str, Any]) -> dict[str, Any]:
    """What the page's script draws (JSON in the page): per metric its timeline and its
    histogram; nothing else (no errors, no connection details)."""
    return {"metrics": [{
        "key": m["key"], "title": m["title"], "unit": m["unit"],
        "labels": [p["label"] for p in m["points"]],
        "values": [p["value"] for p in m["points"]],
        "batch_ids": [p["batch_id"] for p in m["points"]],
        "kinds": [p["kind"] for p in m["points"]],
        "failed": [p["had_failure"] for p in m["points"]],
        "bins": [_bin_label(h, m["unit"]) for h in m["histogram"]],
        "counts": [h["count"] for h in m["histogram"]],
    } for m in view["metrics"]]}


def _bin_label(h: Mapping[str, Any], unit: str) -> str:
    def f(v: float) -> str:
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f"{f(h['lo'])}–{f(h['hi'])} {unit}"
