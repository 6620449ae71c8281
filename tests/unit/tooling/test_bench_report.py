"""The benchmark's pure summarising (include/bench/report.py): medians, ratios, goal checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "bench_report", Path(__file__).resolve().parents[3] / "include" / "bench" / "report.py")
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def run(engine: str, label: str, rps: float, wall: float, **stages: float) -> dict[str, Any]:
    return {"engine": engine, "label": label, "records": 1000, "records_per_s": rps,
            "wall_s": wall, "stages": stages, "task_seconds": {}, "peak_rss_mb": 100.0}


def test_summary_takes_median_min_max_per_engine_and_label() -> None:
    s = report.summarise([run("baseline", "1M", r, 1.0, copy_s=c)
                          for r, c in ((10.0, 1.0), (30.0, 3.0), (20.0, 2.0))])
    b = s["baseline"]["1M"]
    assert b["runs"] == 3
    assert b["records_per_s"] == {"median": 20.0, "min": 10.0, "max": 30.0}
    assert b["stages_s"] == {"copy_s": 2.0}


def test_goals_use_the_faster_warm_launch_and_flag_misses() -> None:
    s = report.summarise([
        run("spark-builtin", "1M", 100.0, 10.0), run("baseline", "1M", 200.0, 5.0),
        run("offsetflow-local", "1M", 130.0, 7.0), run("offsetflow-connect", "1M", 160.0, 6.0),
        run("offsetflow-submit", "1M", 50.0, 20.0),
        run("offsetflow-local", "1k", 1.0, 0.8), run("offsetflow-connect", "1k", 0.5, 3.5),
    ])
    rows = {g["goal"]: g for g in report.goals(s, "1M", "1k", (1000, 0.4))}
    vs_builtin = rows["OffsetFlow warm (offsetflow-connect) / spark-builtin at 1M"]
    assert vs_builtin["measured"] == 1.6 and vs_builtin["met"] is False  # issue 19: >= 2.5
    vs_base = rows["OffsetFlow warm (offsetflow-connect) / baseline at 1M"]
    assert vs_base["measured"] == 0.8 and vs_base["met"] is True
    slower = rows["OffsetFlow warm (offsetflow-local) / spark-builtin at 1M"]
    assert slower["measured"] == 1.3 and slower["met"] is None
    assert rows["OffsetFlow cold (spark-submit) / spark-builtin at 1M"]["met"] is None
    plan = next(g for k, g in rows.items() if k.startswith("planning 1,000 partitions"))
    assert plan["met"] is True
    small = rows["1k batch end to end, warm (offsetflow-local)"]
    assert small["measured"] == 0.8 and small["met"] is True


def test_the_hand_built_yardstick_is_reported_beside_the_goal_not_as_one() -> None:
    s = report.summarise([run("spark-builtin", "1M", 100.0, 10.0),
                          run("bare-parallel", "1M", 180.0, 5.5),
                          run("offsetflow-local", "1M", 170.0, 6.0)])
    rows = {g["goal"]: g for g in report.goals(s, "1M", "1k", None)}
    bare = rows["bare-parallel (hand-built: no Spark, stage or ledger) / spark-builtin at 1M"]
    assert bare["measured"] == 1.8 and bare["met"] is None
    assert rows["OffsetFlow warm (offsetflow-local) / spark-builtin at 1M"]["met"] is False
    assert report.best_warm(s, "1M") == "offsetflow-local"  # never picked as OffsetFlow


def test_missed_goal_is_reported_not_hidden() -> None:
    s = report.summarise([run("spark-builtin", "1M", 100.0, 10.0),
                          run("offsetflow-local", "1M", 120.0, 8.0)])
    (row,) = report.goals(s, "1M", "1k", None)
    assert row["measured"] == 1.2 and row["met"] is False
    assert "| NO |" in report.markdown(s, [row], {})


def test_worker_rss_follows_the_busiest_worker_in_task_order() -> None:
    docs = [  # written out of order, as a glob returns them
        {"pid": 7, "t": 3.0, "rss_mb": 330.0}, {"pid": 7, "t": 1.0, "rss_mb": 300.0},
        {"pid": 9, "t": 2.0, "rss_mb": 900.0}, {"pid": 7, "t": 2.0, "rss_mb": 320.0},
        {"pid": 8, "t": 1.5, "rss_mb": None},  # no /proc: not counted
    ]
    w = report.worker_rss_by_task(docs)
    assert w == {"pid": 7, "workers": 2, "rss_mb_after_task": [300.0, 320.0, 330.0]}
    assert report.worker_rss_by_task([{"pid": 1, "t": 1.0, "rss_mb": None}]) is None


def test_partition_scaling_rows_from_the_warm_local_runs() -> None:
    s = report.summarise([run("offsetflow-local", "5k_100p", 5000.0, 1.0, plan_s=0.1,
                              read_stage_s=0.7, commit_s=0.2),
                          run("offsetflow-local", "5k_1000p", 2500.0, 2.0, plan_s=0.5,
                              read_stage_s=1.2, commit_s=0.3)])
    rows = report.partition_scaling(s, [("5k_100p", 5000, 100), ("5k_1000p", 5000, 1000),
                                        ("5k_10000p", 5000, 10000)])  # not run: left out
    assert [(r["partitions"], r["wall_s"], r["plan_s"]) for r in rows] == \
        [(100, 1.0, 0.1), (1000, 2.0, 0.5)]


def test_speed_goals_measure_against_the_slower_floor() -> None:
    s = report.summarise([
        run("source-floor", "1M", 500.0, 2.0), run("sink-floor", "1M", 250.0, 4.0),
        run("offsetflow-local", "1M", 200.0, 5.0), run("offsetflow-connect", "1M", 100.0, 7.0),
        run("offsetflow-connect", "1k", 1.0, 0.9), run("offsetflow-local", "10k_1000p", 1.0, 3.2),
        run("offsetflow-connect", "1k_dag", 1.0, 2.4),  # as a scheduled DAG run's tasks
    ])
    rows = {g["goal"]: g for g in report.speed_goals(s, "1M", "1k", "10k_1000p")}
    assert rows["machine floor at 1M (slower of source and sink floor: sink-floor), s"][
        "measured"] == 4.0
    local = rows["OffsetFlow warm (offsetflow-local) time / floor at 1M"]
    assert local["measured"] == 1.25 and local["met"] is True
    connect = rows["OffsetFlow warm (offsetflow-connect) time / floor at 1M"]
    assert connect["measured"] == 1.75 and connect["met"] is False
    # the DAG's tasks around run_batch count, not the warm session's batch alone (0.9 s)
    default = rows["1k batch end to end on the default scheduled path (the DAG's plan, run "
                   "and publish tasks on offsetflow-connect)"]
    assert default["measured"] == 2.4 and default["met"] is True
    many = rows["10k_1000p (many small partitions) end to end, warm local"]
    assert many["measured"] == 3.2 and many["met"] is False


def test_speed_goals_without_floors_or_runs_are_left_out() -> None:
    s = report.summarise([run("offsetflow-local", "1M", 200.0, 5.0)])
    assert report.speed_goals(s, "1M", "1k", None) == []
    assert report.floor(s, "1M") is None


def test_iceberg_ratios_set_the_sink_beside_spark_into_iceberg_and_the_postgres_sink() -> None:
    s = report.summarise([run("offsetflow-iceberg", "1M", 30.0, 1.0),
                          run("spark-builtin-iceberg", "1M", 20.0, 1.0),
                          run("offsetflow-local", "1M", 60.0, 1.0)])
    rows = report.iceberg_ratios(s, "1M")
    assert [(r["goal"].split(" (")[0], r["measured"], r["met"]) for r in rows] == [
        ("offsetflow-iceberg / spark-builtin-iceberg", 1.5, None),
        ("offsetflow-iceberg / offsetflow-local", 0.5, None)]
    # an engine that was skipped (no Iceberg Spark runtime fetched) leaves its row out
    del s["spark-builtin-iceberg"]
    assert [r["measured"] for r in report.iceberg_ratios(s, "1M")] == [0.5]


def test_avro_ratios_set_offsetflow_avro_beside_from_avro_and_json() -> None:
    s = report.summarise([run("offsetflow-avro", "1M", 30.0, 1.0),
                          run("spark-builtin-avro", "1M", 20.0, 1.0),
                          run("offsetflow-local", "1M", 60.0, 1.0)])
    rows = report.avro_ratios(s, "1M")
    assert [(r["goal"].split(" (")[0], r["measured"], r["met"]) for r in rows] == [
        ("offsetflow-avro / spark-builtin-avro", 1.5, None),
        ("offsetflow-avro / offsetflow-local", 0.5, None)]
    del s["spark-builtin-avro"]  # an engine not run leaves its row out
    assert [r["measured"] for r in report.avro_ratios(s, "1M")] == [0.5]


def test_memory_goal_compares_the_python_worker_peak_at_10m_with_the_main_set() -> None:
    def mem(label: str, worker_mb: float) -> dict[str, Any]:
        return {**run("offsetflow-local", label, 1.0, 1.0), "peak_py_worker_rss_mb": worker_mb}
    s = report.summarise([mem("1M", 300.0), mem("10M", 320.0), mem("10M", 345.0)])
    [row] = report.memory_goal(s, "1M", "10M")
    assert row["measured"] == 1.15 and row["met"] is False  # the largest peak of its runs
    s = report.summarise([mem("1M", 300.0), mem("10M", 310.0)])
    assert report.memory_goal(s, "1M", "10M")[0]["met"] is True
    assert report.memory_goal(s, "1M", None) == [] == report.memory_goal(s, "1M", "5M")


def test_cpu_table_sums_the_engine_and_stack_and_leaves_other_out_of_busy() -> None:
    runs = []
    for pg, other in ((3.0, 0.5), (5.0, 9.0), (4.0, 1.0)):
        r = run("offsetflow-local", "1M", 1000.0, 4.0)
        r["cpu_s"] = {"postgres": pg, "python_workers": 2.0, "other": other}
        runs.append(r)
    s = report.summarise(runs)
    assert s["offsetflow-local"]["1M"]["cpu_s"] == {"other": 1.0, "postgres": 4.0,
                                                   "python_workers": 2.0}
    lines = report.cpu_table(s, cores=2)
    header = next(line for line in lines if line.startswith("| engine"))
    assert header.split(" | ")[2:5] == ["postgres", "python_workers", "other"]
    row = next(line for line in lines if line.startswith("| offsetflow-local"))
    # engine + stack = 4 + 2 (other left out); busy = 6 / (4 s x 2 cores)
    assert "| 6.00 | 75% |" in row
    assert report.cpu_table(report.summarise([run("x", "1M", 1.0, 1.0)]), cores=2) == []
