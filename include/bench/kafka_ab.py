"""A/B of one switch of the Kafka sink's commit, interleaved in one warm local Spark session:
`off` and `on` are the runs with the `KafkaTopicSink` class attribute named by `--switch`
False and True (`read_parts`: the stage sorted against read part by part,
`offsetflow.sinks.kafka.order`; `plain_loop`: the general produce loop against the one for
records that need no check; `overlap`: producing after the last task against producing each
stage part as its task stages it, `offsetflow.sinks.kafka.sink`), on the same data set, each run
into a fresh output topic checked with read_committed; then Spark's built-in at-least-once
Kafka -> Kafka path on the same data in a process of its own (`worker.py`), for the ratio.
`--before FILE` instead of a switch: `off` runs the produce pass (`_produce_stage`) of
another tree's `offsetflow/sinks/kafka/sink.py` (e.g. main's), `on` this tree's (what the
overlap produces during the read goes through this tree's loop in both: add
`--no-overlap` to compare the passes alone). `driver_cpu_s` is the driver process's CPU
over each run, all its threads.
`--profile`: cProfile of the driver's main thread (the produce loop; the stage's fetching
thread is not in it) over the timed runs of each mode, top functions in `profile-<mode>.txt`.

    python include/bench/kafka_ab.py [--records 200000] [--partitions 6] [--runs 3]
                                     [--switch read_parts | --before FILE] [--profile]
                                     [--no-overlap]
                                     [--out bench-results/kafka-ab] [--no-builtin]

Needs the stack (`stack.sh up`, `source .stack/env.sh`). Prints a table of medians.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import logging
import os
import pstats
import statistics
import sys
import time
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

KEYS = ("wall_s", "driver_cpu_s", "cpu_spark_s", "cpu_postgres_s", "cpu_kafka_s",
        "read_stage_s", "commit_s", "kafka_overlap_s",
        "kafka_order_s", "kafka_extent_s", "kafka_read_wait_s",
        "kafka_produce_s", "kafka_flush_s", "kafka_commit_s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench-results/kafka-ab")
    ap.add_argument("--no-builtin", action="store_true")
    ap.add_argument("--switch", default="read_parts")
    ap.add_argument("--before", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--task-files", default=None,
                    help="DIR: `off` stages in PostgreSQL, `on` writes task files in DIR "
                         "(`KafkaTopicSink.task_files_dir`)")
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
    if args.no_overlap:
        KafkaTopicSink.overlap = False
    passes = {"on": KafkaTopicSink._produce_stage}
    if args.before:
        passes["off"] = _before(Path(args.before)).KafkaTopicSink._produce_stage
        args.switch = f"before={args.before}"
    elif args.task_files:
        args.switch = f"task_files={args.task_files}"
    elif not isinstance(getattr(KafkaTopicSink, args.switch, None), bool):
        raise SystemExit(f"KafkaTopicSink has no switch {args.switch!r}")
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    profiles = {m: cProfile.Profile() for m in results}
    order = [("off", "on"), ("on", "off")]
    n = 0
    for i in range(args.runs + 1):  # the first round warms up (untimed)
        for mode in order[i % 2]:
            if args.before:
                KafkaTopicSink._produce_stage = passes[mode]  # type: ignore[method-assign]
            elif args.task_files:
                KafkaTopicSink.task_files_dir = args.task_files if mode == "on" else None
            else:
                setattr(KafkaTopicSink, args.switch, mode == "on")
            n += 1
            prof = profiles[mode] if args.profile and i else None
            if prof is not None:
                prof.enable()
            cpu = time.process_time()  # the driver's Python process, all its threads
            others = _cpu_by_kind()
            r = engines_kafka.offsetflow_kafka_run(spark, ds, f"ab_{mode}_{os.getpid()}_{n}",
                                                  ctx)
            cpu = time.process_time() - cpu
            others = {k: round(v - others.get(k, 0.0), 2) for k, v in _cpu_by_kind().items()}
            if prof is not None:
                prof.disable()
            row = {"wall_s": round(r["wall_s"], 3), "driver_cpu_s": round(cpu, 3),
                   **{f"cpu_{k}_s": v for k, v in others.items()},
                   **{k: r["stages"].get(k, 0.0) for k in KEYS
                      if k not in ("wall_s", "driver_cpu_s") and not k.startswith("cpu_")}}
            logging.info("%s%s: %s (load %s)", mode, " (warm-up)" if i == 0 else "", row,
                         os.getloadavg())
            if i:
                results[mode].append(row)
    spark.stop()
    for mode, prof in profiles.items():
        if args.profile:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            (out / f"profile-{mode}.txt").write_text(text.getvalue())
    summary = {m: {k: statistics.median(r[k] for r in rows) for k in KEYS}
               for m, rows in results.items()}
    builtin = None
    if not args.no_builtin:
        got = run_engine("spark-builtin-kafka",
                         [{"label": "ab", "dataset": dataset_to_dict(ds), "runs": args.runs}],
                         ds, {**ctx, "warmup_runs": 1}, out, [])
        builtin = statistics.median(float(r["wall_s"]) for r in got["results"])
    (out / "ab.json").write_text(json.dumps({"switch": args.switch, "runs": results,
                                             "median": summary, "builtin": builtin},
                                            indent=1, default=str))
    print(f"{args.switch + ', median of ' + str(args.runs):<22}"
          + "".join(f"{m:>12}" for m in summary))
    for k in KEYS:
        print(f"{k:<22}" + "".join(f"{summary[m][k]:>12.3f}" for m in summary))
    print("spark-builtin-kafka wall_s median:", builtin)
    return 0


def _cpu_by_kind() -> dict[str, float]:
    """CPU seconds so far (own + reaped children) of this process's descendants (Spark's
    JVM and its Python workers: `spark`) and of the stack's PostgreSQL and Kafka."""
    hz = os.sysconf("SC_CLK_TCK")
    stack = os.environ.get("OFFSETFLOW_STACK_DIR", "/nonexistent")
    procs: dict[int, tuple[int, float, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        procs[int(d.name)] = (int(stat[1]), sum(int(x) for x in stat[11:15]) / hz, cmd)
    roots = {os.getpid(): "spark"}  # this process's descendants: the JVM, its workers
    for pid, (_pp, _c, cmd) in procs.items():
        if stack in cmd and cmd.split(" ", 1)[0].endswith("/postgres"):
            roots[pid] = "postgres"  # the postmaster; its backends are its children
        elif stack in cmd and "kafka.Kafka" in cmd:
            roots[pid] = "kafka"
    out = {"spark": 0.0, "postgres": 0.0, "kafka": 0.0}
    for pid, (_ppid, cpu, _cmd) in procs.items():
        if pid == os.getpid():
            continue
        up, seen = pid, 0
        while up not in roots and up in procs and seen < 50:
            up, seen = procs[up][0], seen + 1
        if up in roots:
            out[roots[up]] += cpu
    return out


def _before(path: Path) -> Any:
    """Another tree's sink module, loaded under a name of its own, with what it takes from
    `form` (the record query and its rules) from that tree's `form.py` next to it; its other
    imports resolve to this tree's packages. Only its produce pass is used."""
    from offsetflow.sinks.kafka import form

    def load(name: str, file: Path) -> Any:
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    old_form = load("offsetflow_ab_before_form", path.parent / "form.py")
    mod = load("offsetflow_ab_before_sink", path)
    for name, value in list(vars(mod).items()):
        if getattr(value, "__module__", None) == form.__name__ and hasattr(old_form, name):
            setattr(mod, name, getattr(old_form, name))
    return mod


if __name__ == "__main__":
    sys.exit(main())
