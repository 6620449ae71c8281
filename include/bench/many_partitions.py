"""Many partitions, little data: one batch of P partitions x R records end to end (plan, read,
stage, commit) on a warm local Spark, the shape issue 19 measured at ~74 ms per range.

    python include/bench/many_partitions.py [--partitions 200] [--records-per-partition 10]
                                            [--runs 3] [--out bench-results/many.json]

Needs the local stack (`source .stack/env.sh`). One warm-up run first (Python workers and
the JVM warm), then `--runs` timed ones, each its own pipeline from the topic's start.
`make bench` runs the same at 1,000 x 10 (`--many-partitions`); this script is the quick
look on its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import engines
from dataset import DataSet, ensure_dataset

from offsetflow.config import parse_pipeline
from offsetflow.config.schema import DEFAULT_MAX_OFFSETS_PER_TASK

log = logging.getLogger("bench.many")


def warm_session(ds: DataSet, ctx: dict[str, Any]) -> Any:
    """A local[2] SparkSession built as the warm local engine builds it."""
    from offsetflow.job import build_spark

    raw = engines.offsetflow_config(ds, "bench_session", "OFFSETFLOW_BENCH_DSN",
                                    ctx["bootstrap"], "submit", ctx["connect_url"],
                                    ctx["max_offsets_per_task"])
    return build_spark(parse_pipeline(raw, "<bench>", os.environ), "bench-many-partitions")


def many_partition_runs(spark: Any, ds: DataSet, ctx: dict[str, Any], runs: int
                        ) -> dict[str, Any]:
    """One untimed warm-up, then `runs` timed batches of the whole data set."""
    tag = f"{ds.partitions}p{ds.records // max(ds.partitions, 1)}"
    engines.offsetflow_warm_run(spark, ds, engines.run_name("many", f"{tag}warm", 0), ctx)
    results = []
    for i in range(runs):
        res = engines.offsetflow_warm_run(spark, ds, engines.run_name("many", tag, i), ctx)
        log.info("%d partitions x %d records, run %d: %.2fs (%s)", ds.partitions,
                 ds.records // ds.partitions, i + 1, res["wall_s"], res["stages"])
        results.append({"wall_s": round(res["wall_s"], 3), "stages": res["stages"]})
    walls = [r["wall_s"] for r in results]
    return {"partitions": ds.partitions, "records": ds.records,
            "wall_s": {"median": statistics.median(walls), "min": min(walls),
                       "max": max(walls)},
            "ms_per_partition": round(1000 * statistics.median(walls) / ds.partitions, 2),
            "runs": results}


def main(argv: list[str] | None = None) -> int:
    from bench import bench_database

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--partitions", type=int, default=200)
    ap.add_argument("--records-per-partition", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the result as JSON here too")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("py4j", "offsetflow", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    admin_dsn = os.environ.get("OFFSETFLOW_PG_DSN")
    bootstrap = os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP")
    if not admin_dsn or not bootstrap:
        raise SystemExit("OFFSETFLOW_PG_DSN / OFFSETFLOW_KAFKA_BOOTSTRAP are not set; run "
                         "`make up` and `source .stack/env.sh`")
    dsn = bench_database(admin_dsn)
    os.environ["OFFSETFLOW_BENCH_DSN"] = dsn
    ctx = {"dsn": dsn, "bootstrap": bootstrap, "launch": "submit",
           "connect_url": "sc://127.0.0.1:15002",
           "max_offsets_per_task": DEFAULT_MAX_OFFSETS_PER_TASK,
           "metrics_dir": os.environ.get("OFFSETFLOW_TASK_METRICS_DIR", "/nonexistent")}
    ds = ensure_dataset(bootstrap, args.partitions * args.records_per_partition,
                        args.partitions)
    t = time.perf_counter()
    spark = warm_session(ds, ctx)
    log.info("session start %.1fs", time.perf_counter() - t)
    try:
        out = many_partition_runs(spark, ds, ctx, args.runs)
    finally:
        spark.stop()
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
