"""`make bench`: OffsetFlow against Spark's built-in Kafka source, a single-process baseline
and the machine's floor (one consumer reading the rows unparsed; binary COPY of them into the
target with its unique index: `floors.py`).

    python include/bench/bench.py [--records 1000000] [--partitions 6] [--runs 3]
                                  [--scaling 100000,1000000,5000000] [--scaling-runs 3]
                                  [--partition-scaling 100,1000] [--partition-records 100000]
                                  [--many-partitions 1000] [--many-partition-records 10]
                                  [--memory-records 10000000] [--memory-runs 1] [--warmup-runs 2]
                                  [--out bench-results]

Needs the local stack (`make up`); starts the Spark Connect server and the Spark standalone
cluster (master + two 1-core workers, executors from the packed environment) itself. Every engine
runs in a process of its own, one after another (never two at once on the same cores), on
the same offset ranges, into the same kind of table. Writes `results.json`, `results.md`
and `results.png` to the output folder and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import report
from cluster import CLUSTER_ENGINES, cluster_pids, cluster_was_up, start_cluster
from dag_path import DAG_SUFFIX
from dataset import DataSet, ensure_dataset
from engines import BENCH_SCHEMA, ROOT, dataset_to_dict
from engines_avro import AVRO_ENGINES, ensure_avro_dataset
from psycopg2 import sql

from offsetflow.config import parse_pipeline
from offsetflow.config.schema import DEFAULT_MAX_OFFSETS_PER_TASK
from offsetflow.ledger import Ledger
from offsetflow.plan import plan_next
from offsetflow.source import KafkaMetadata
from offsetflow.stage.metrics import load_task_metrics

log = logging.getLogger("bench")
ENGINES = ("source-floor", "sink-floor", "baseline", "bare-parallel", "spark-builtin",
           "offsetflow-local", "offsetflow-connect", "offsetflow-submit", "offsetflow-cluster",
           "offsetflow-iceberg",
           # Kafka -> Kafka (include/bench/engines_kafka.py)
           "spark-builtin-kafka", "offsetflow-kafka", "offsetflow-kafka-cluster",
           # the same with `sink.task_files` (tasks write task files, no PostgreSQL stage)
           "offsetflow-kafka-stage", "offsetflow-kafka-cluster-files",
           # Spark's Kafka source writing Iceberg (include/bench/engines_iceberg_spark.py)
           "spark-builtin-iceberg",
           # Confluent wire-format Avro -> PostgreSQL (include/bench/engines_avro.py)
           "spark-builtin-avro", "offsetflow-avro")
STACK = ["bash", str(ROOT / "include" / "stack" / "stack.sh")]
# timings that run inside another stage's wall time, so not stacked in the chart: the
# commit's tail insert is part of commit_s, its part moves run during read_stage_s
INNER_STAGES = ("commit_insert_s", "commit_overlapped_s", "kafka_extent_s", "kafka_read_wait_s",
                "kafka_produce_s", "kafka_flush_s", "kafka_commit_s")


def label_of(records: int) -> str:
    if records % 1_000_000 == 0:
        return f"{records // 1_000_000}M"
    if records % 1000 == 0:
        return f"{records // 1000}k"
    return str(records)


def bench_database(admin_dsn: str) -> str:
    """A fresh database for the run: the benchmark never touches the user's ledger."""
    name = "offsetflow_bench"
    conn = psycopg2.connect(admin_dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    conn.close()
    dsn = psycopg2.extensions.make_dsn(admin_dsn, dbname=name)
    with Ledger(dsn) as ledger:
        ledger.upgrade()
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
            sql.Identifier(BENCH_SCHEMA)))
    conn.close()
    return dsn


def plan_benchmark(bootstrap: str, dsn: str, partitions: int, reps: int) -> dict[str, Any]:
    """Planning cost with `partitions` partitions: the first plan (positions created), then
    re-plans of the same ranges (open batch abandoned in between), then a plan with nothing
    new. Pure Kafka metadata + ledger work; no Spark."""
    ds = ensure_dataset(bootstrap, partitions, partitions)  # one record per partition
    name = f"bench_plan_{uuid.uuid4().hex[:6]}"
    raw = {"name": name, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": [ds.topic], "starting": "earliest"},
           "format": {"type": "json", "schema": {"event_id": "string"}},
           "sink": {"connection": "${OFFSETFLOW_BENCH_DSN}", "table": f"{BENCH_SCHEMA}.{name}"}}
    cfg = parse_pipeline(raw, "<bench plan>", os.environ)
    kafka = KafkaMetadata(cfg.admin_settings(), cfg.isolation_level)
    out: dict[str, Any] = {"partitions": partitions}
    with Ledger(dsn) as ledger:
        t = time.perf_counter()
        first = plan_next(cfg, ledger, kafka, started_by="bench")
        out["first_plan_s"] = round(time.perf_counter() - t, 3)
        assert first.batch is not None and len(first.batch.ranges) == partitions
        times = []
        bid = first.batch.batch_id
        for _ in range(reps):
            ledger.abandon(bid, "benchmark re-plan")
            t = time.perf_counter()
            again = plan_next(cfg, ledger, kafka, started_by="bench")
            times.append(time.perf_counter() - t)
            assert again.batch is not None and len(again.batch.ranges) == partitions
            bid = again.batch.batch_id
        out["replan_s"] = {"median": round(statistics.median(times), 3),
                           "min": round(min(times), 3), "max": round(max(times), 3)}
        ledger.abandon(bid, "benchmark done")
        with ledger.transaction() as cur:
            cur.execute("UPDATE offsetflow.positions SET next_offset = 1 WHERE pipeline = %s",
                        (name,))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            empty = plan_next(cfg, ledger, kafka, started_by="bench")
            times.append(time.perf_counter() - t)
            assert empty.batch is None
        out["nothing_new_plan_s"] = round(statistics.median(times), 3)
    log.info("planning %d partitions: first %.3fs, re-plan median %.3fs, nothing new %.3fs",
             partitions, out["first_plan_s"], out["replan_s"]["median"],
             out["nothing_new_plan_s"])
    return out


def _memory_probe(ds: DataSet, records: int, tasks: int = 1) -> dict[str, Any]:
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("range_memory.py")),
                        ds.topic, "0", str(records), "--tasks", str(tasks)],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"memory probe of {tasks} x {records} records failed:\n"
                           f"{p.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return result


def range_memory(ds: DataSet) -> list[dict[str, Any]]:
    """Peak RSS of one task-equivalent process per range size, on partition 0 of `ds`."""
    largest = ds.ranges[0].until_offset
    out = []
    for n in sorted({min(n, largest) for n in (20_000, 100_000, largest)}):
        out.append(_memory_probe(ds, n))
        log.info("one task reading %s[0] [0, %d): peak RSS %.0f MB", ds.topic, n,
                 out[-1]["peak_rss_mb"])
    return out


def worker_reuse_memory(ds: DataSet, tasks: int = 30) -> dict[str, Any]:
    """RSS of one process running `tasks` tasks of up to 100,000 records in a row, as a
    reused Spark Python worker does: flat after the first tasks means nothing is kept."""
    m = _memory_probe(ds, min(100_000, ds.ranges[0].until_offset), tasks)
    marks = milestones(len(m["rss_mb_after_task"]))
    log.info("one process running %d tasks of %d records: RSS %s MB after tasks %s, "
             "Arrow holds %s MB after the last", tasks, m["records"],
             "/".join(str(m["rss_mb_after_task"][i - 1]) for i in marks),
             "/".join(map(str, marks)), m["arrow_held_mb_after_task"][-1])
    return m


def milestones(tasks: int) -> list[int]:
    """The task numbers a memory series is reported at: the first, the tenth, the last."""
    return sorted({1, min(10, tasks), tasks})


def start_connect(metrics_dir: Path) -> tuple[int, float]:
    """(Re)start the project's Spark Connect server with task metrics on; (pid, seconds)."""
    subprocess.run([*STACK, "connect-stop"], check=True)
    t = time.perf_counter()
    env = {**os.environ, "OFFSETFLOW_TASK_METRICS_DIR": str(metrics_dir)}
    subprocess.run([*STACK, "connect-start"], check=True, env=env)
    pid = int((ROOT / ".stack" / "connect" / "connect.pid").read_text())
    return pid, round(time.perf_counter() - t, 3)


def run_engine(engine: str, jobs: list[dict[str, Any]], warmup: DataSet, ctx: dict[str, Any],
               out: Path, extra_pids: list[int]) -> dict[str, Any]:
    spec = {"engine": engine, "ctx": ctx, "jobs": jobs, "warmup": dataset_to_dict(warmup),
            "extra_pids": extra_pids, "result_file": str(out / f"raw-{engine}.json")}
    spec_file = out / f"spec-{engine}.json"
    spec_file.write_text(json.dumps(spec))
    log.info("== %s: %s", engine, ", ".join(f"{j['label']} x{j['runs']}" for j in jobs))
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "worker.py"),
                           str(spec_file)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"benchmark engine {engine} failed (exit {proc.returncode}); "
                         f"see its output above")
    return json.loads(Path(spec["result_file"]).read_text())  # type: ignore[no-any-return]


def spark_worker_rss(raw_results: list[dict[str, Any]], metrics_dir: Path
                     ) -> dict[str, Any] | None:
    """RSS at each task's end of the busiest Python worker behind these runs' batches (its
    warm-up tasks included: they ran in the same worker)."""
    docs = load_task_metrics(metrics_dir)
    batch_ids = {r["batch_id"] for r in raw_results if "batch_id" in r}
    pids = {d["pid"] for d in docs if d["batch_id"] in batch_ids}
    return report.worker_rss_by_task(d for d in docs if d["pid"] in pids)


def chart(summary: dict[str, Any], main_label: str, path: Path,
          range_mem: list[dict[str, Any]], reuse: dict[str, list[float]]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(14, 15))
    grid = fig.add_gridspec(3, 2)
    ax1, ax2 = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax3, ax4 = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    ax5 = fig.add_subplot(grid[2, :])
    engines = [e for e in ENGINES if main_label in summary.get(e, {})]
    med = [summary[e][main_label]["records_per_s"]["median"] for e in engines]
    rps = [summary[e][main_label]["records_per_s"] for e in engines]
    lo = [m - r["min"] for r, m in zip(rps, med, strict=True)]
    hi = [r["max"] - m for r, m in zip(rps, med, strict=True)]
    ax1.bar(engines, med, yerr=[lo, hi], capsize=4,
            color=["#888", "#c66", "#36c", "#39c", "#9bd", "#6ab", "#6a6", "#c96",
                   "#693"][:len(engines)])
    ax1.set_title(f"{main_label} records: records/s (median, min-max)")
    ax1.tick_params(axis="x", rotation=20)
    for e in ("offsetflow-local", "baseline"):
        pts = sorted((v["records"], v["records_per_s"]["median"])
                     for v in summary.get(e, {}).values())
        if len(pts) > 1:
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=e)
    ax2.set_xscale("log")
    ax2.set_title("scaling: records/s by batch size")
    ax2.set_xlabel("records in the batch")
    ax2.legend()
    # wall-clock split by stage (stacked), so the largest cost is visible at a glance
    left = [0.0] * len(engines)
    keys: list[str] = []
    for e in engines:
        keys += [k for k in summary[e][main_label]["stages_s"] if k not in keys]
    cmap = plt.get_cmap("tab20")
    for i, k in enumerate(keys):
        vals = [summary[e][main_label]["stages_s"].get(k, 0.0) for e in engines]
        if k in INNER_STAGES:
            continue
        ax3.barh(engines, vals, left=left, color=cmap(i % 20), label=k.removesuffix("_s"))
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax3.set_title(f"{main_label} records: wall seconds by stage (median)")
    ax3.legend(fontsize=8, loc="lower right")
    for e in ("offsetflow-local", "baseline"):
        pts = sorted((v["records"], v["peak_py_worker_rss_mb"] or v["peak_rss_mb"])
                     for v in summary.get(e, {}).values())
        if len(pts) > 1:
            ax4.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                     label=f"{e} ({'largest Python worker' if e != 'baseline' else 'process'})")
    if range_mem:
        ax4.plot([m["records"] for m in range_mem], [m["peak_rss_mb"] for m in range_mem],
                 marker="s", label="one task, by records in its range")
    ax4.set_xscale("log")
    ax4.set_ylim(bottom=0)
    ax4.set_title("peak memory (MB) by batch size (worker: highest of all its tasks)")
    ax4.set_xlabel("records in the batch")
    ax4.legend(fontsize=8)
    for name, rss in reuse.items():
        ax5.plot(range(1, len(rss) + 1), rss, marker=".", label=name)
    ax5.set_ylim(bottom=0)
    ax5.set_title("RSS (MB) of one process at the end of each task it ran: must level off")
    ax5.set_xlabel("tasks the process has run")
    ax5.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per engine (>= 3)")
    ap.add_argument("--cold-runs", type=int, default=3)
    ap.add_argument("--warmup-runs", type=int, default=2,
                    help="untimed runs of the main data set's size before a warm engine's "
                         "timed runs (every engine the same)")
    ap.add_argument("--small-records", type=int, default=1000)
    ap.add_argument("--small-runs", type=int, default=5)
    ap.add_argument("--scaling", default="100000,1000000,5000000",
                    help="comma-separated sizes for the scaling runs ('' to skip)")
    ap.add_argument("--scaling-runs", type=int, default=3,
                    help="timed runs per scaling size (baseline and warm local OffsetFlow)")
    ap.add_argument("--plan-partitions", type=int, default=1000)
    ap.add_argument("--partition-scaling", default="100,1000",
                    help="partition counts for end-to-end runs of --partition-records records "
                         "(warm local OffsetFlow; '' to skip)")
    ap.add_argument("--partition-records", type=int, default=100_000)
    ap.add_argument("--many-partitions", type=int, default=1000,
                    help="many small partitions, end to end warm local (0 to skip)")
    ap.add_argument("--many-partition-records", type=int, default=10,
                    help="records per partition of the --many-partitions run")
    ap.add_argument("--memory-records", type=int, default=10_000_000,
                    help="the memory-flat run: warm local OffsetFlow on this many records, its "
                         "Python worker's peak (memory per task) against the main data set's "
                         "(0 to skip)")
    ap.add_argument("--memory-runs", type=int, default=1)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--max-offsets-per-task", type=int, default=DEFAULT_MAX_OFFSETS_PER_TASK,
                    help="OffsetFlow's split of ranges into Spark tasks (the built-in source "
                         "gets the same task count through minPartitions)")
    ap.add_argument("--out", default=str(ROOT / "bench-results"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("offsetflow").setLevel(logging.WARNING)
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engine(s) {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    out = Path(args.out).resolve()  # engines hand it to other processes (a Spark warehouse URI)
    out.mkdir(parents=True, exist_ok=True)
    metrics_dir = out / "task-metrics"
    shutil.rmtree(metrics_dir, ignore_errors=True)  # batch ids restart with the database
    started = time.time()

    admin_dsn = os.environ.get("OFFSETFLOW_PG_DSN")
    bootstrap = os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP")
    if not admin_dsn or not bootstrap:
        raise SystemExit("OFFSETFLOW_PG_DSN / OFFSETFLOW_KAFKA_BOOTSTRAP are not set; run "
                         "`make up` and `source .stack/env.sh` (make bench does both)")
    dsn = bench_database(admin_dsn)
    os.environ["OFFSETFLOW_BENCH_DSN"] = dsn
    params = psycopg2.extensions.parse_dsn(dsn)
    ctx = {"dsn": dsn, "bootstrap": bootstrap, "metrics_dir": str(metrics_dir),
           "out_dir": str(out), "max_offsets_per_task": args.max_offsets_per_task,
           "connect_url": os.environ.get("OFFSETFLOW_SPARK_CONNECT_URL",
                                         "sc://127.0.0.1:15002"),
           "jdbc_url": (f"jdbc:postgresql://{params.get('host', '127.0.0.1')}:"
                        f"{params.get('port', 5432)}/{params['dbname']}"
                        "?stringtype=unspecified&reWriteBatchedInserts=true"),
           "pg_user": params.get("user", ""), "pg_password": params.get("password", ""),
           "warmup_runs": max(args.warmup_runs, 0)}

    main_label = label_of(args.records)
    small_label = label_of(args.small_records)
    log.info("data sets: %s on %d partitions (+ %s, scaling %s)", main_label, args.partitions,
             small_label, args.scaling or "none")
    main_ds = ensure_dataset(bootstrap, args.records, args.partitions)
    # the same records as Avro in the Confluent wire format, for the Avro engines
    avro_ds = None
    if set(engines) & set(AVRO_ENGINES):
        ctx["registry_url"] = os.environ.get("OFFSETFLOW_SCHEMA_REGISTRY_URL")
        if not ctx["registry_url"]:
            raise SystemExit("OFFSETFLOW_SCHEMA_REGISTRY_URL is not set: the Avro engines "
                             "need the stack's schema registry (make up starts it)")
        avro_ds = ensure_avro_dataset(bootstrap, ctx["registry_url"], args.records,
                                      args.partitions)
    small_ds = ensure_dataset(bootstrap, args.small_records, args.partitions)
    scaling = [ensure_dataset(bootstrap, int(n), args.partitions)
               for n in args.scaling.split(",") if n and int(n) != args.records]

    plan = plan_benchmark(bootstrap, dsn, args.plan_partitions, reps=5) \
        if args.plan_partitions else None
    largest_ds = max([main_ds, *scaling], key=lambda d: d.records)
    range_mem = range_memory(largest_ds)
    reuse_mem = worker_reuse_memory(largest_ds)

    def job(ds: DataSet, runs: int, label: str | None = None) -> dict[str, Any]:
        return {"label": label or label_of(ds.records), "dataset": dataset_to_dict(ds),
                "runs": runs}

    by_partitions = [(f"{label_of(args.partition_records)}_{p}p", args.partition_records,
                      int(p)) for p in args.partition_scaling.split(",") if p]
    many_label = None
    if args.many_partitions:
        many = args.many_partitions * args.many_partition_records
        many_label = f"{label_of(many)}_{args.many_partitions}p"
        by_partitions.append((many_label, many, args.many_partitions))
    partition_jobs = [job(ensure_dataset(bootstrap, n, p), args.scaling_runs, label)
                      for label, n, p in by_partitions]
    memory_label = label_of(args.memory_records) if args.memory_records else None
    memory_jobs = [job(ensure_dataset(bootstrap, args.memory_records, args.partitions),
                       args.memory_runs)] \
        if args.memory_records and args.memory_records != args.records \
        and all(d.records != args.memory_records for d in scaling) else []

    jobs = {
        "source-floor": [job(main_ds, args.runs)],
        "sink-floor": [job(main_ds, args.runs)],
        "baseline": [job(main_ds, args.runs)] + [job(d, args.scaling_runs) for d in scaling],
        "bare-parallel": [job(main_ds, args.runs)],
        "spark-builtin": [job(main_ds, args.runs)],
        "offsetflow-local": [job(small_ds, args.small_runs), job(main_ds, args.runs)]
        + [job(d, args.scaling_runs) for d in scaling] + partition_jobs + memory_jobs,
        # the warm session, then (last: each ends the process's session) the plan, run and
        # publish tasks of a scheduled DAG run, the run task on a session of its own
        "offsetflow-connect": [job(small_ds, args.small_runs), job(main_ds, args.runs),
                               job(small_ds, args.small_runs, f"{small_label}{DAG_SUFFIX}")],
        "offsetflow-submit": [job(small_ds, args.cold_runs), job(main_ds, args.cold_runs)],
        "offsetflow-cluster": [job(main_ds, args.runs)],
        "spark-builtin-kafka": [job(main_ds, args.runs)],
        "offsetflow-kafka": [job(main_ds, args.runs)],
        "offsetflow-kafka-cluster": [job(main_ds, args.runs)],  # the same on the cluster
        "offsetflow-kafka-stage": [job(main_ds, args.runs)],  # sink.task_files: off
        "offsetflow-kafka-cluster-files": [job(main_ds, args.runs)],
        "offsetflow-iceberg": [job(main_ds, args.runs)],  # the Iceberg sink (issue 17)
        "spark-builtin-iceberg": [job(main_ds, args.runs)],
        **({e: [job(avro_ds, args.runs)] for e in AVRO_ENGINES} if avro_ds else {}),
    }
    raw: dict[str, Any] = {}
    connect_start_s = None
    connect_was_up = "connect   up" in subprocess.run([*STACK, "status"], capture_output=True,
                                                      text=True).stdout
    started_cluster = False  # the cluster this run started
    for i, engine in enumerate(engines):
        extra: list[int] = []
        if engine == "offsetflow-connect":
            pid, connect_start_s = start_connect(metrics_dir)
            extra = [pid]
        try:
            if engine in CLUSTER_ENGINES:
                started_cluster = started_cluster or not cluster_was_up()
                ctx.update(start_cluster(metrics_dir))
                extra = cluster_pids()
            # every warm engine is warmed on the main data set's size, so the JIT of the
            # JVM engines has seen the real volume before anything is timed
            warm = avro_ds if engine in AVRO_ENGINES and avro_ds else main_ds
            raw[engine] = run_engine(engine, jobs[engine], warm, ctx, out, extra)
        finally:
            if engine == "offsetflow-connect":  # it runs with bench metrics on: not for reuse
                subprocess.run([*STACK, "connect-stop"], check=True)
                if connect_was_up:  # make up's server, which the shipped pipelines use
                    subprocess.run([*STACK, "connect-start"], check=True)
            # stopped unless the next engine uses it: an idle cluster's daemons are not
            # left in the other engines' CPU figures
            if started_cluster and not set(engines[i + 1:i + 2]) & CLUSTER_ENGINES.keys():
                subprocess.run([*STACK, "spark-cluster-stop"], check=True)
                started_cluster = False
    results = [r for e in raw.values() for r in e["results"]]
    summary = report.summarise(results)
    fixed: dict[str, Any] = {f"{e} session start (once)": raw[e]["spark_start_s"]
                             for e in raw
                             if e not in ("baseline", "bare-parallel", "offsetflow-submit")
                             and "skipped" not in raw[e]}
    fixed.update({f"{e} SKIPPED": raw[e]["skipped"] for e in raw if "skipped" in raw[e]})
    if connect_start_s is not None:
        fixed["Spark Connect server start (once)"] = connect_start_s
    if plan:
        fixed[f"first plan, {plan['partitions']} partitions"] = plan["first_plan_s"]
        fixed[f"re-plan, {plan['partitions']} partitions (median)"] = plan["replan_s"]["median"]
        fixed[f"plan with nothing new, {plan['partitions']} partitions"] = \
            plan["nothing_new_plan_s"]
    for m in range_mem:
        fixed[f"peak RSS (MB) of one task reading a {m['records']:,.0f}-record range"] = \
            m["peak_rss_mb"]
    reuse_rss = reuse_mem["rss_mb_after_task"]
    for i in milestones(len(reuse_rss)):
        fixed[f"RSS (MB) of one task-equivalent process after task {i} of {len(reuse_rss)} "
              f"in a row ({reuse_mem['records']:,} records each)"] = reuse_rss[i - 1]
    fixed["Arrow memory (MB) still held after the last of those tasks"] = \
        reuse_mem["arrow_held_mb_after_task"][-1]
    reuse_series = {f"probe: {reuse_mem['records']:,} records a task, read + parse + encode":
                    reuse_rss}
    worker = spark_worker_rss(raw.get("offsetflow-local", {}).get("results", []), metrics_dir)
    if worker:
        w_rss = worker["rss_mb_after_task"]
        for i in milestones(len(w_rss)):
            fixed[f"RSS (MB) of the busiest Spark Python worker (warm local, all batch sizes) "
                  f"after task {i} of {len(w_rss)}"] = w_rss[i - 1]
        reuse_series["Spark Python worker, warm local (every batch of the run, in order)"] = \
            w_rss
    by_parts = report.partition_scaling(summary, by_partitions)
    for row in by_parts:
        fixed[f"end to end (plan + read + commit), {row['records']:,} records on "
              f"{row['partitions']:,} partitions (median s; plan {row['plan_s']} s)"] = \
            row["wall_s"]
    cluster_ratios = {f"{c}/{local}@{main_label}": report.ratio(summary, c, local, main_label)
                      for c, local in CLUSTER_ENGINES.items()}
    for (c, local), r in zip(CLUSTER_ENGINES.items(), cluster_ratios.values(), strict=True):
        if r is not None:
            fixed[f"standalone cluster (2 x 1-core executors) / local[2], records/s at "
                  f"{main_label}: {c} / {local}"] = r
    goal_rows = report.goals(summary, main_label, small_label,
                             (plan["partitions"], max(plan["first_plan_s"],
                                                      plan["replan_s"]["median"]))
                             if plan else None)
    goal_rows += report.speed_goals(summary, main_label, small_label, many_label)
    goal_rows += report.iceberg_ratios(summary, main_label)
    goal_rows += report.avro_ratios(summary, main_label)
    goal_rows += report.memory_goal(summary, main_label, memory_label)
    doc = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
           "duration_s": round(time.time() - started, 1),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "platform": platform.platform()},
           "args": vars(args), "avg_record_bytes": round(main_ds.avg_record_bytes, 1),
           "summary": summary, "goals": goal_rows, "fixed_cost": fixed, "planning": plan,
           "partition_scaling": by_parts, "range_memory": range_mem,
           "worker_reuse_memory": reuse_mem,
           "spark_worker_memory": worker,
           "ratios": {
               f"{w}/{o}@{main_label}": report.ratio(summary, w, o, main_label)
               for w in ("offsetflow-local", "offsetflow-connect", "offsetflow-submit",
                         "offsetflow-cluster", "offsetflow-iceberg")
               for o in ("spark-builtin", "baseline")}
           | cluster_ratios
           | {f"offsetflow-iceberg/offsetflow-local@{main_label}":
                  report.ratio(summary, "offsetflow-iceberg", "offsetflow-local", main_label)}
           # Kafka -> Kafka: exactly-once (one transaction per batch) / at-least-once
           | {f"{w}/spark-builtin-kafka@{main_label}": report.ratio(
               summary, w, "spark-builtin-kafka", main_label)
              for w in ("offsetflow-kafka", "offsetflow-kafka-stage")}
           | {f"offsetflow-iceberg/spark-builtin-iceberg@{main_label}": report.ratio(
               summary, "offsetflow-iceberg", "spark-builtin-iceberg", main_label)}
           # Confluent wire-format Avro: against Spark's from_avro, and against JSON on
           # OffsetFlow's own path (the same records, the same columns)
           | {f"offsetflow-avro/spark-builtin-avro@{main_label}": report.ratio(
               summary, "offsetflow-avro", "spark-builtin-avro", main_label),
              f"offsetflow-avro/offsetflow-local@{main_label}": report.ratio(
               summary, "offsetflow-avro", "offsetflow-local", main_label)}
           | {f"{w}/floor@{main_label}": (round(summary[w][main_label]["wall_s"]["median"]
                                                / low[1], 3))
              for w in report.WARM_OFFSETFLOW
              if (low := report.floor(summary, main_label)) and main_label in summary.get(w, {})},
           "runs": results}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    md = report.markdown(summary, goal_rows, fixed, cores=os.cpu_count() or 1)
    (out / "results.md").write_text(md)
    chart(summary, main_label, out / "results.png", range_mem, reuse_series)
    print(md)
    log.info("results in %s (results.json, results.md, results.png); took %.0fs", out,
             time.time() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
