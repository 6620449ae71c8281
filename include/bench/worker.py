"""One engine's runs in a process of its own: `worker.py <spec.json>` (started by bench.py).

A warm engine starts its Spark once (timed, reported apart), does untimed warm-up runs of
the main data set's size (`--warmup-runs`, 2: measured, the JVM's JIT compiler still spent
1.1-1.4 core-seconds in each of the two runs after a single warm-up, 0.2 in the third) so
the Python workers, the JDBC/Kafka clients and the JIT are warm, then the timed runs.
Results go to the spec's `result_file` as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import engines
import engines_avro
import engines_kafka
from cluster import CLUSTER_ENGINES
from dag_path import DAG_SUFFIX, dag_path_run
from engines import dataset_from_dict, timed_runs

from offsetflow.config import parse_pipeline

log = logging.getLogger("bench.worker")


def main(spec_path: str) -> int:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("py4j", "offsetflow", "pyspark"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    engine: str = spec["engine"]
    ctx: dict[str, Any] = spec["ctx"]
    jobs = [(j["label"], dataset_from_dict(j["dataset"]), int(j["runs"])) for j in spec["jobs"]]
    warmup = dataset_from_dict(spec["warmup"])
    if engine == "spark-builtin-iceberg":  # a Spark of its own: engines_iceberg_spark.py
        from engines_iceberg_spark import builtin_iceberg_engine

        Path(spec["result_file"]).write_text(json.dumps(
            builtin_iceberg_engine(jobs, warmup, ctx), indent=1))
        return 0
    os.environ["OFFSETFLOW_TASK_METRICS_DIR"] = ctx["metrics_dir"]
    roots = [os.getpid(), *spec.get("extra_pids", [])]
    spark_start_s = 0.0
    spark: Any = None
    t = time.perf_counter()
    if engine in ("offsetflow-local", "offsetflow-connect", "offsetflow-cluster",
                  "offsetflow-kafka", "offsetflow-kafka-cluster", "offsetflow-kafka-stage",
                  "offsetflow-kafka-cluster-files", "offsetflow-iceberg",
                  "offsetflow-avro"):
        from offsetflow.job import build_spark

        ctx["launch"] = "connect" if engine == "offsetflow-connect" else "submit"
        raw = engines.offsetflow_config(warmup, "bench_session", "OFFSETFLOW_BENCH_DSN",
                                        ctx["bootstrap"], ctx["launch"], ctx["connect_url"],
                                        ctx["max_offsets_per_task"])
        if engine in CLUSTER_ENGINES:  # the standalone master, executors from the archive
            raw["spark"].update(master=ctx["cluster_master"], conf=ctx["cluster_conf"])
        spark = build_spark(parse_pipeline(raw, "<bench>", os.environ), f"bench-{engine}")

        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            if engine in ("offsetflow-kafka", "offsetflow-kafka-cluster"):
                return engines_kafka.offsetflow_kafka_run(spark, ds, name, ctx)
            if engine == "offsetflow-kafka-stage":
                return engines_kafka.offsetflow_kafka_run(spark, ds, name, ctx,
                                                          task_files="off")
            if engine == "offsetflow-kafka-cluster-files":
                return engines_kafka.offsetflow_kafka_run(spark, ds, name, ctx,
                                                          task_files="shared")
            if engine == "offsetflow-iceberg":
                import engines_iceberg

                return engines_iceberg.offsetflow_iceberg_run(spark, ds, name, ctx)
            if engine == "offsetflow-avro":
                return engines_avro.offsetflow_avro_run(spark, ds, name, ctx)
            if engine == "offsetflow-connect" and f"{DAG_SUFFIX}_" in name:
                return dag_path_run(ds, name, ctx)  # as a scheduled DAG run's tasks
            return engines.offsetflow_warm_run(spark, ds, name, ctx)
    elif engine == "spark-builtin-kafka":
        spark = engines.builtin_session(f"bench-{engine}")

        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            return engines_kafka.builtin_kafka_run(spark, ds, name, ctx)
    elif engine == "spark-builtin-avro":
        spark = engines_avro.builtin_avro_session(f"bench-{engine}")

        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            return engines_avro.builtin_avro_run(spark, ds, name, ctx)
    elif engine == "spark-builtin":
        spark = engines.builtin_session(f"bench-{engine}")

        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            return engines.builtin_run(spark, ds, name, ctx)
    elif engine == "offsetflow-submit":
        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            return engines.offsetflow_submit_run(ds, name, ctx)
    elif engine == "baseline":
        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            return engines.baseline_run(ds, name, ctx)
    elif engine == "bare-parallel":
        import bare

        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            return bare.bare_parallel_run(ds, name, ctx)
    elif engine in ("source-floor", "sink-floor"):
        import floors

        floor_run = floors.source_floor_run if engine == "source-floor" \
            else floors.sink_floor_run

        def run(ds: engines.DataSet, name: str) -> dict[str, Any]:
            return floor_run(ds, name, ctx)
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    spark_start_s = time.perf_counter() - t
    if engine != "offsetflow-submit":  # a cold engine has nothing to warm
        for i in range(int(ctx.get("warmup_runs", 1))):
            t = time.perf_counter()
            run(warmup, engines.run_name(engine, "warmup", i))
            log.info("%s: session start %.1fs, warm-up run %d %.1fs", engine, spark_start_s,
                     i + 1, time.perf_counter() - t)
    results = timed_runs(engine, jobs, run, roots)
    Path(spec["result_file"]).write_text(json.dumps(
        {"engine": engine, "spark_start_s": round(spark_start_s, 3), "results": results},
        indent=1))
    if spark is not None and engine != "offsetflow-connect":
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
