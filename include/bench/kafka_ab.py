"""A/B of the Kafka sink's stage read, interleaved in one warm local Spark session:
`sorted` (one query that sorts the whole stage by topic, partition, offset) against
`parts` (the stage parts read segment by segment as stored, no sort:
`offsetflow.sinks.kafka.order`), on the same data set, each run into a fresh output topic
checked with read_committed; then Spark's built-in at-least-once Kafka -> Kafka path on the
same data in a process of its own (`worker.py`), for the ratio.

    python include/bench/kafka_ab.py [--records 200000] [--partitions 6] [--runs 3]
                                     [--out bench-results/kafka-ab] [--no-builtin]

Needs the stack (`stack.sh up`, `source .stack/env.sh`). Prints a table of medians.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import engines
import engines_kafka
from bench import bench_database, run_engine
from dataset import ensure_dataset
from engines import dataset_to_dict

from offsetflow.config import parse_pipeline
from offsetflow.config.schema import DEFAULT_MAX_OFFSETS_PER_TASK
from offsetflow.sinks.kafka import KafkaTopicSink

KEYS = ("wall_s", "commit_s", "kafka_order_s", "kafka_extent_s", "kafka_read_wait_s",
        "kafka_produce_s", "kafka_flush_s", "kafka_commit_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench-results/kafka-ab")
    ap.add_argument("--no-builtin", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("py4j", "offsetflow", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    bootstrap = os.environ["OFFSETFLOW_KAFKA_BOOTSTRAP"]
    dsn = bench_database(os.environ["OFFSETFLOW_PG_DSN"])
    os.environ["OFFSETFLOW_BENCH_DSN"] = dsn
    os.environ["OFFSETFLOW_TASK_METRICS_DIR"] = str(out / "task-metrics")
    ds = ensure_dataset(bootstrap, args.records, args.partitions)
    ctx: dict[str, Any] = {
        "dsn": dsn, "bootstrap": bootstrap, "metrics_dir": str(out / "task-metrics"),
        "out_dir": str(out), "max_offsets_per_task": DEFAULT_MAX_OFFSETS_PER_TASK,
        "connect_url": "sc://127.0.0.1:1", "launch": "submit", "warmup_runs": 1}
    from offsetflow.job import build_spark

    raw = engines.offsetflow_config(ds, "ab_session", "OFFSETFLOW_BENCH_DSN", bootstrap,
                                    "submit", ctx["connect_url"], ctx["max_offsets_per_task"])
    spark = build_spark(parse_pipeline(raw, "<ab>", os.environ), "bench-kafka-ab")
    results: dict[str, list[dict[str, float]]] = {"sorted": [], "parts": []}
    order = [("sorted", "parts"), ("parts", "sorted")]
    n = 0
    for i in range(args.runs + 1):  # the first round warms up (untimed)
        for mode in order[i % 2]:
            KafkaTopicSink.read_parts = mode == "parts"
            n += 1
            r = engines_kafka.offsetflow_kafka_run(spark, ds, f"ab_{mode}_{n}", ctx)
            row = {"wall_s": round(r["wall_s"], 3), **{k: r["stages"].get(k, 0.0)
                                                      for k in KEYS if k != "wall_s"}}
            logging.info("%s%s: %s (load %s)", mode, " (warm-up)" if i == 0 else "", row,
                         os.getloadavg())
            if i:
                results[mode].append(row)
    spark.stop()
    summary = {m: {k: statistics.median(r[k] for r in rows) for k in KEYS}
               for m, rows in results.items()}
    builtin = None
    if not args.no_builtin:
        got = run_engine("spark-builtin-kafka",
                         [{"label": "ab", "dataset": dataset_to_dict(ds), "runs": args.runs}],
                         ds, {**ctx, "warmup_runs": 1}, out, [])
        builtin = statistics.median(float(r["wall_s"]) for r in got["results"])
    (out / "ab.json").write_text(json.dumps({"runs": results, "median": summary,
                                             "builtin": builtin}, indent=1, default=str))
    print(f"{'median of ' + str(args.runs):<22}" + "".join(f"{m:>12}" for m in summary))
    for k in KEYS:
        print(f"{k:<22}" + "".join(f"{summary[m][k]:>12.3f}" for m in summary))
    print("spark-builtin-kafka wall_s median:", builtin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
