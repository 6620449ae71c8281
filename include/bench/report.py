"""Pure summarising of benchmark runs: medians, ranges, ratios, goal checks. No I/O."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

WARM_OFFSETFLOW = ("offsetflow-local", "offsetflow-connect")
FLOORS = ("source-floor", "sink-floor")
# the launch a scheduled DAG run of a shipped pipeline takes (spark.launch: connect); its
# label suffix marks the runs made as the DAG's tasks make them (include/bench/dag_path.py)
DEFAULT_PATH = "offsetflow-connect"
DAG_SUFFIX = "_dag"
# include/bench/cpu.py's process classes, in the order the report prints them
CPU_CLASSES = ("postgres", "kafka", "spark_jvm", "python_workers", "driver", "spark_connect",
               "other")


def _median(xs: Iterable[float]) -> float:
    return round(statistics.median(list(xs)), 3)


def summarise(results: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{engine: {label: summary}}: records/s median/min/max over the runs, median stage
    times and task-seconds, the largest peak RSS."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in results:
        groups[(r["engine"], r["label"])].append(r)
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (engine, label), runs in sorted(groups.items()):
        rps = [float(r["records_per_s"]) for r in runs]
        stage_keys = sorted({k for r in runs for k in r.get("stages", {})})
        task_keys = sorted({k for r in runs for k in r.get("task_seconds", {})})
        cpu_keys = sorted({k for r in runs for k in r.get("cpu_s", {})})
        out[engine][label] = {
            "runs": len(runs),
            "records": runs[0]["records"],
            "records_per_s": {"median": _median(rps), "min": min(rps), "max": max(rps)},
            "wall_s": {"median": _median(r["wall_s"] for r in runs),
                       "min": min(r["wall_s"] for r in runs),
                       "max": max(r["wall_s"] for r in runs)},
            "stages_s": {k: _median(r["stages"].get(k, 0.0) for r in runs) for k in stage_keys},
            "task_seconds": {k: _median(r["task_seconds"].get(k, 0.0) for r in runs)
                             for k in task_keys},
            "cpu_s": {k: _median(r.get("cpu_s", {}).get(k, 0.0) for r in runs)
                      for k in cpu_keys},
            "peak_rss_mb": max(r.get("peak_rss_mb", 0.0) for r in runs),
            "peak_py_worker_rss_mb": max(r.get("peak_py_worker_rss_mb", 0.0) for r in runs),
        }
    return dict(out)


def ratio(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], a: str, b: str,
          label: str) -> float | None:
    """Median records/s of engine `a` over engine `b` on the same data set."""
    try:
        x = summary[a][label]["records_per_s"]["median"]
        y = summary[b][label]["records_per_s"]["median"]
    except KeyError:
        return None
    return round(x / y, 3) if y else None


def best_warm(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], label: str) -> str | None:
    """The faster of the warm OffsetFlow launches (local session or Spark Connect)."""
    have = [e for e in WARM_OFFSETFLOW if label in summary.get(e, {})]
    if not have:
        return None
    return max(have, key=lambda e: summary[e][label]["records_per_s"]["median"])


def goals(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], main_label: str,
          small_label: str, plan: tuple[int, float] | None) -> list[dict[str, Any]]:
    """The issue's goals, each with the measured figure and whether it is met."""
    out: list[dict[str, Any]] = []
    warm = best_warm(summary, main_label)
    if warm:
        for other, target in (("spark-builtin", 2.5), ("baseline", 0.7)):
            r = ratio(summary, warm, other, main_label)
            if r is not None:
                out.append({"goal": f"OffsetFlow warm ({warm}) / {other} at {main_label}",
                            "target": f">= {target}", "measured": r, "met": r >= target})
        # the yardstick: the same parts hand-built without Spark, stage or ledger (bare.py)
        bare = ratio(summary, "bare-parallel", "spark-builtin", main_label)
        if bare is not None:
            out.append({"goal": f"bare-parallel (hand-built: no Spark, stage or ledger) / "
                                f"spark-builtin at {main_label}", "target": "reported",
                        "measured": bare, "met": None})
        # the slower warm launch is shown beside it, so neither figure is hidden
        for slower in (e for e in WARM_OFFSETFLOW if e != warm):
            for other in ("spark-builtin", "baseline"):
                r = ratio(summary, slower, other, main_label)
                if r is not None:
                    out.append({"goal": f"OffsetFlow warm ({slower}) / {other} at {main_label}",
                                "target": "reported", "measured": r, "met": None})
        cold = ratio(summary, "offsetflow-submit", "spark-builtin", main_label)
        if cold is not None:
            out.append({"goal": f"OffsetFlow cold (spark-submit) / spark-builtin at {main_label}",
                        "target": "reported", "measured": cold, "met": None})
    if plan is not None:
        partitions, plan_s = plan
        out.append({"goal": f"planning {partitions:,} partitions (slowest of first plan and "
                            f"re-plan median)", "target": "< 1 s",
                    "measured": plan_s, "met": plan_s < 1.0})
    small = best_warm(summary, small_label)
    if small:
        w = summary[small][small_label]["wall_s"]["median"]
        out.append({"goal": f"{small_label} batch end to end, warm ({small})",
                    "target": "< 3 s", "measured": w, "met": w < 3.0})
    return out


def floor(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], label: str
          ) -> tuple[str, float] | None:
    """The machine's floor on data set `label`: the slower of reading the rows alone and
    writing them alone (median wall seconds), with the engine that set it."""
    have = [(e, float(summary[e][label]["wall_s"]["median"])) for e in FLOORS
            if label in summary.get(e, {})]
    return max(have, key=lambda x: x[1]) if have else None


def speed_goals(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], main_label: str,
                small_label: str, many_label: str | None) -> list[dict[str, Any]]:
    """Issue 19's goals: OffsetFlow's time as a multiple of the floor, the 1k batch on the
    default scheduled path, many small partitions warm."""
    out: list[dict[str, Any]] = []
    low = floor(summary, main_label)
    if low is not None:
        engine, floor_s = low
        out.append({"goal": f"machine floor at {main_label} (slower of source and sink "
                            f"floor: {engine}), s", "target": "reported",
                    "measured": round(floor_s, 3), "met": None})
        for warm in WARM_OFFSETFLOW:
            s = summary.get(warm, {}).get(main_label)
            if s is None or not floor_s:
                continue
            x = round(float(s["wall_s"]["median"]) / floor_s, 3)
            out.append({"goal": f"OffsetFlow warm ({warm}) time / floor at {main_label}",
                        "target": "<= 1.5", "measured": x, "met": x <= 1.5})
    d = summary.get(DEFAULT_PATH, {}).get(f"{small_label}{DAG_SUFFIX}")
    if d is not None:
        w = float(d["wall_s"]["median"])
        out.append({"goal": f"{small_label} batch end to end on the default scheduled path "
                            f"(the DAG's plan, run and publish tasks on {DEFAULT_PATH})",
                    "target": "< 3 s", "measured": w, "met": w < 3.0})
    m = summary.get("offsetflow-local", {}).get(many_label or "")
    if many_label and m is not None:
        w = float(m["wall_s"]["median"])
        out.append({"goal": f"{many_label} (many small partitions) end to end, warm local",
                    "target": "< 3 s", "measured": w, "met": w < 3.0})
    return out


def iceberg_ratios(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], label: str
                   ) -> list[dict[str, Any]]:
    """Issue 17: the Iceberg sink (exactly-once, one snapshot per batch) against Spark's own
    Kafka source writing the same Iceberg table (at-least-once; pyspark 4.1, see
    engines_iceberg_spark.py) and against OffsetFlow's PostgreSQL sink, warm local both."""
    out: list[dict[str, Any]] = []
    for other, what in (("spark-builtin-iceberg", "Spark's Kafka source -> Iceberg runtime"),
                        ("offsetflow-local", "OffsetFlow, PostgreSQL sink")):
        r = ratio(summary, "offsetflow-iceberg", other, label)
        if r is not None:
            out.append({"goal": f"offsetflow-iceberg / {other} ({what}), records/s at {label}",
                        "target": "reported", "measured": r, "met": None})
    return out


def avro_ratios(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], label: str
                ) -> list[dict[str, Any]]:
    """Issue 30: Confluent wire-format Avro into PostgreSQL, OffsetFlow (fastavro in the
    tasks) against Spark's Kafka source + `from_avro` after `substring` strips the 5-byte
    header, and against OffsetFlow reading the same records as JSON, warm local both."""
    out: list[dict[str, Any]] = []
    for other, what in (("spark-builtin-avro", "Spark's Kafka source + from_avro -> JDBC"),
                        ("offsetflow-local", "OffsetFlow, the same records as JSON")):
        r = ratio(summary, "offsetflow-avro", other, label)
        if r is not None:
            out.append({"goal": f"offsetflow-avro / {other} ({what}), records/s at {label}",
                        "target": "reported", "measured": r, "met": None})
    return out


def memory_goal(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], main_label: str,
                big_label: str | None, engine: str = "offsetflow-local"
                ) -> list[dict[str, Any]]:
    """Issue 19's "peak memory per task unchanged at 10M records": the largest Spark Python
    worker's peak RSS (a worker runs one task at a time) on the big data set over the same
    on the main one, from one run; within 10% is flat."""
    runs = summary.get(engine, {})
    if big_label is None or big_label == main_label or big_label not in runs \
            or main_label not in runs:
        return []
    big = float(runs[big_label]["peak_py_worker_rss_mb"])
    main = float(runs[main_label]["peak_py_worker_rss_mb"])
    if not main:
        return []
    x = round(big / main, 3)
    return [{"goal": f"peak memory per task ({engine}'s Python worker): {big_label} "
                     f"{big:,.0f} MB / {main_label} {main:,.0f} MB",
             "target": "<= 1.1 (flat)", "measured": x, "met": x <= 1.1}]


def _kv(d: Mapping[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in d.items())


def markdown(summary: Mapping[str, Mapping[str, Mapping[str, Any]]],
             goal_rows: Iterable[Mapping[str, Any]], extra: Mapping[str, Any],
             cores: int = 2) -> str:
    lines = ["| engine | data set | runs | records/s median (min-max) | wall s median | "
             "peak RSS MB (tree / Python worker) |", "|---|---|---|---|---|---|"]
    for engine, labels in summary.items():
        for label, s in labels.items():
            r = s["records_per_s"]
            lines.append(f"| {engine} | {label} | {s['runs']} | {r['median']:,.0f} "
                         f"({r['min']:,.0f}-{r['max']:,.0f}) | {s['wall_s']['median']:.2f} | "
                         f"{s['peak_rss_mb']:,.0f} / {s['peak_py_worker_rss_mb']:,.0f} |")
    lines += ["", "Time split by stage (median seconds; wall clock of the run, then the tasks' "
              "own seconds summed over Spark tasks, which run in parallel). `commit_overlapped`"
              " is the commit moving staged parts into the target while `read_stage` still "
              "runs (inside its time); `commit_insert` is the part of `commit` that moves the "
              "last parts:", "",
              "| engine | data set | stages, wall s | in tasks, task-seconds |",
              "|---|---|---|---|"]
    for engine, labels in summary.items():
        for label, s in labels.items():
            lines.append(f"| {engine} | {label} | {_kv(s['stages_s'])} | "
                         f"{_kv(s['task_seconds']) or '-'} |")
    lines += cpu_table(summary, cores)
    lines += ["", "| goal | target | measured | met |", "|---|---|---|---|"]
    for g in goal_rows:
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        lines.append(f"| {g['goal']} | {g['target']} | {g['measured']} | {met} |")
    lines += ["", "| fixed cost (s) and memory (MB) | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def cpu_table(summary: Mapping[str, Mapping[str, Mapping[str, Any]]], cores: int
              ) -> list[str]:
    """Core-seconds by process class (median run; include/bench/cpu.py), their sum, and the
    sum over wall time x cores: how busy the machine was. A run whose sum is near
    wall x cores is CPU-bound: it gets faster only by needing less CPU somewhere."""
    rows = [(engine, label, s) for engine, labels in summary.items()
            for label, s in labels.items() if s.get("cpu_s")]
    if not rows:
        return []
    keys = [k for k in CPU_CLASSES if any(k in s["cpu_s"] for _, _, s in rows)]
    lines = ["", f"CPU core-seconds by process during the run (median run; {cores} cores; "
             "`other`: processes outside the run and its stack):", "",
             "| engine | data set | " + " | ".join(keys) + " | sum (engine + stack) | "
             "busy: sum / (wall x cores) |",
             "|---|---|" + "---|" * (len(keys) + 2)]
    for engine, label, s in rows:
        cpu = s["cpu_s"]
        used = sum(v for k, v in cpu.items() if k != "other")
        busy = used / (s["wall_s"]["median"] * cores) if s["wall_s"]["median"] else 0.0
        lines.append(f"| {engine} | {label} | "
                     + " | ".join(f"{cpu.get(k, 0.0):.2f}" for k in keys)
                     + f" | {used:.2f} | {busy:.0%} |")
    return lines


def worker_rss_by_task(task_docs: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """RSS at the end of each task of the Python worker that ran the most tasks, in the order
    it ran them (Spark reuses workers, so a range kept in memory would make this climb)."""
    by_pid: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for d in task_docs:
        if d.get("rss_mb") is not None and d.get("t") is not None:
            by_pid[int(d["pid"])].append((float(d["t"]), float(d["rss_mb"])))
    if not by_pid:
        return None
    pid, tasks = max(by_pid.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    return {"pid": pid, "workers": len(by_pid),
            "rss_mb_after_task": [rss for _, rss in sorted(tasks)]}


def partition_scaling(summary: dict[str, Any], rows: list[tuple[str, int, int]]
                      ) -> list[dict[str, Any]]:
    """End-to-end (plan + read + commit) of warm local OffsetFlow per partition count."""
    out = []
    for label, records, partitions in rows:
        s = summary.get("offsetflow-local", {}).get(label)
        if s is None:
            continue
        st = s.get("stages_s", {})
        out.append({"partitions": partitions, "records": records,
                    "wall_s": s["wall_s"]["median"],
                    "plan_s": st.get("plan_s"), "read_stage_s": st.get("read_stage_s"),
                    "commit_s": st.get("commit_s")})
    return out
