"""Adaptive batch sizing on the real stack (issue 31 item 3): records arrive faster than a
batch can process them within its interval; with fixed caps every batch takes longer than
the last, with `source.rate: {adaptive: pid}` the batch time settles near the interval.

    python include/bench/adaptive_rate.py [--interval 10] [--factor 2] [--fixed 4] [--pid 14]

Needs the stack (Kafka, PostgreSQL; Spark local in this process). Calibrates the capacity
(offsets per second a batch processes, and its fixed cost) from two batches, then produces
at `factor` times what fits in an interval, in a process of its own, and runs the pipeline
on a schedule as the pipeline DAG does (one run at a time; a run that overran starts the
next at once, missed ticks are skipped). Prints one line per batch and a summary (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins")]

from confluent_kafka import Producer  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from offsetflow.config import parse_pipeline  # noqa: E402
from offsetflow.ledger import Ledger  # noqa: E402
from offsetflow.ops.runner import run_cycle  # noqa: E402


def produce(bootstrap: str, topic: str, rate: float, partitions: int, stop: Any,
            start: int = 0) -> None:
    """At `rate` records per second, in 0.1 s steps, until `stop` is set."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000,
                  "queue.buffering.max.messages": 1_000_000})
    t0, i = time.monotonic(), start
    while not stop.is_set():
        due = int((time.monotonic() - t0) * rate) + start
        while i < due:
            body = json.dumps({"event_id": f"e{i}", "seq": i, "amount": i % 1000 / 10,
                               "checksum": "x"}).encode()
            p.produce(topic, body, partition=i % partitions)
            i += 1
            if i % 5000 == 0:
                p.poll(0)
        p.poll(0)
        stop.wait(0.1)
    p.flush(30)


def pipeline(topic: str, dsn: str, bootstrap: str, table: str, rate: dict[str, Any] | None
             ) -> Any:
    raw: dict[str, Any] = {
        "name": table, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest",
                   "max_records_per_partition": 5_000_000},
        "format": {"type": "json", "schema": {"event_id": "string", "seq": "long",
                                              "amount": "double", "checksum": "string"}},
        "sink": {"connection": dsn, "table": table},
        "spark": {"master": "local[2]"},
    }
    if rate:
        raw["source"]["rate"] = rate
    return parse_pipeline(raw, f"<bench {table}>", {})


def make_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        f.result(30)


def lag(dsn: str, cfg: Any) -> tuple[int, int]:
    """(offsets behind, offsets arrived so far)."""
    from offsetflow.ops import kafka_for
    from offsetflow.plan import pending_offsets

    kafka = kafka_for(cfg)
    offsets = kafka.partition_offsets(kafka.partitions(list(cfg.topics)))
    with Ledger(dsn) as ledger:
        behind = sum(pending_offsets(ledger.positions(cfg.name), offsets, "earliest").values())
    return behind, sum(o.latest for o in offsets.values())


def scheduled(cfg: Any, dsn: str, spark: Any, interval: float, batches: int,
              label: str) -> list[dict[str, Any]]:
    """Run `batches` cycles on the schedule's ticks (see the module docstring)."""
    out: list[dict[str, Any]] = []
    due = time.monotonic()
    t0 = due
    for _ in range(batches):
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)  # a script standing in for the scheduler
        start = time.monotonic()
        res = run_cycle(cfg, dsn, spark, "bench")
        took = time.monotonic() - start
        b = res.plan.batch
        rate = res.plan.rate
        behind, arrived = lag(dsn, cfg)
        row = {"phase": label, "at_s": round(start - t0, 1), "late_s": round(start - due, 1),
               "batch": b.batch_id if b else None, "offsets": b.offset_span if b else 0,
               "took_s": round(took, 1),
               "rate": round(rate.rate, 1) if rate and rate.rate else None,
               "limit": rate.limit if rate else "caps", "lag_after": behind,
               "arrived": arrived, "at_end_s": round(time.monotonic() - t0, 1)}
        print(json.dumps(row), flush=True)
        out.append(row)
        end = time.monotonic()
        # the next tick after this one; a run that overran starts the next at once
        due = max(due + interval, t0 + (end - t0) // interval * interval)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--fixed", type=int, default=4)
    ap.add_argument("--pid", type=int, default=14)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--capacity", type=float, help="offsets/s (skips the calibration)")
    ap.add_argument("--overhead", type=float, default=0.0, help="s per batch, with --capacity")
    a = ap.parse_args()
    dsn, bootstrap = os.environ["OFFSETFLOW_PG_DSN"], os.environ["OFFSETFLOW_KAFKA_BOOTSTRAP"]
    from offsetflow.job import build_spark

    with Ledger(dsn) as ledger:
        ledger.upgrade()
    u = uuid.uuid4().hex[:6]
    spark = build_spark(pipeline("x", dsn, bootstrap, "x", None), "offsetflow-pid-bench")
    capacity, overhead = (a.capacity, a.overhead) if a.capacity \
        else calibrate(dsn, bootstrap, spark, u, a.partitions)
    fits = capacity * max(a.interval - overhead, 0.1 * a.interval)
    arrival = a.factor * fits / a.interval
    print(json.dumps({"capacity_per_s": round(capacity), "overhead_s": round(overhead, 2),
                      "fits_in_interval": round(fits), "arrival_per_s": round(arrival)}),
          flush=True)
    summary: dict[str, Any] = {"interval_s": a.interval, "capacity_per_s": round(capacity),
                               "overhead_s": round(overhead, 2),
                               "arrival_per_s": round(arrival)}
    for label, rate, n in (("fixed", None, a.fixed),
                           ("pid", {"adaptive": "pid", "interval_s": a.interval}, a.pid)):
        if n <= 0:
            continue
        topic = f"pid_{label}_{u}"
        make_topic(bootstrap, topic, a.partitions)
        cfg = pipeline(topic, dsn, bootstrap, f"pid_{label}_{u}", rate)
        stop = multiprocessing.Event()
        proc = multiprocessing.Process(target=produce, args=(bootstrap, topic, arrival,
                                                             a.partitions, stop))
        proc.start()
        try:
            time.sleep(a.interval)  # the first tick: one interval of arrivals is waiting
            rows = scheduled(cfg, dsn, spark, a.interval, n, label)
        finally:
            stop.set()
            proc.join(60)
        summary[label] = {"took_s": [r["took_s"] for r in rows],
                          "offsets": [r["offsets"] for r in rows],
                          "lag_after": [r["lag_after"] for r in rows],
                          "arrived": [r["arrived"] for r in rows],
                          "rate": [r["rate"] for r in rows]}
    print(json.dumps({"summary": summary}), flush=True)
    spark.stop()


def calibrate(dsn: str, bootstrap: str, spark: Any, u: str, partitions: int
              ) -> tuple[float, float]:
    """Two batches of different sizes (after a warm-up one): capacity and fixed cost."""
    topic = f"pid_cal_{u}"
    make_topic(bootstrap, topic, partitions)
    small, big = 20_000, 200_000
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                  "batch.num.messages": 10000,
                  "queue.buffering.max.messages": 1_000_000})
    for i in range(small + big):
        p.produce(topic, json.dumps({"event_id": f"c{i}", "seq": i, "amount": 1.0,
                                     "checksum": "x"}).encode(), partition=i % partitions)
        if i % 5000 == 0:
            p.poll(0)
    p.flush(60)
    cal = pipeline(topic, dsn, bootstrap, f"pid_cal_{u}", None)
    times = []
    for n in (small // 4, small, big):  # the first one warms Spark up
        c = dataclasses.replace(cal, max_records_per_batch=n)
        t = time.monotonic()
        run_cycle(c, dsn, spark, "bench")
        times.append((n, time.monotonic() - t))
    (n1, t1), (n2, t2) = times[1], times[2]
    capacity = (n2 - n1) / (t2 - t1)
    print(json.dumps({"calibration": times}), flush=True)
    return capacity, max(0.0, t1 - n1 / capacity)


if __name__ == "__main__":
    main()
