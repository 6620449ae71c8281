"""The default scheduled path, as a DAG run's tasks do it (issue 19: "a 1,000-record batch on
the default scheduled path"), without Airflow's scheduling latency.

A shipped pipeline runs `spark.launch: connect`: the plan task (`tasks.plan_task`), then the
run task (`tasks.connect_run_task`: the pipeline's Spark Connect session on the warm server,
`run_batch`, the client dropped), then the publish task (`tasks.publish_task`: the batch's figures,
consumer-group offsets, lineage and stats). Each is timed as a stage; the run's wall clock
is their sum. The Connect engine of `bench.py` runs these next to its warm-session runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dataset import DataSet
from engines import offsetflow_config, read_task_metrics, verify_and_drop
from report import DAG_SUFFIX

from offsetflow.config import parse_pipeline
from offsetflow.job.connect_session import session_id, with_session_id
from offsetflow.ledger import Ledger

__all__ = ["DAG_SUFFIX", "dag_path_run"]

SESSION_OF = "bench_dag_pipeline"  # the one pipeline whose scheduled runs these stand for


def dag_path_run(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """One batch of `ds` through the plan, run and publish tasks of a scheduled DAG run."""
    from offsetflow.orchestration.tasks import connect_run_task, plan_task, publish_task

    # every run here is a new pipeline (fresh table and ledger), but a scheduled pipeline's
    # runs share its Spark Connect session (offsetflow.job.connect_session): so do these
    url = with_session_id(ctx["connect_url"], session_id(SESSION_OF, ctx["connect_url"]))
    raw = offsetflow_config(ds, name, "OFFSETFLOW_BENCH_DSN", ctx["bootstrap"], "connect", url,
                            ctx["max_offsets_per_task"])
    cfg = parse_pipeline(raw, f"<bench {name}>", os.environ)
    _no_session()  # the run task opens its own, as in a fresh Airflow task process
    t0 = time.perf_counter()
    batch_id = plan_task(cfg, "bench")
    t1 = time.perf_counter()
    assert batch_id is not None, f"{name}: nothing planned"
    connect_run_task(cfg, batch_id)
    t2 = time.perf_counter()
    publish_task(cfg, batch_id)
    t3 = time.perf_counter()
    with Ledger(ctx["dsn"]) as ledger:
        inner = ledger.get_batch(batch_id).timings or {}
    # the run task's own split; what is left of it: the Connect session's start and stop,
    # and run_batch's checks before it prepares (ownership, topic identity, fence)
    batch_s = float(inner.get("total_s", 0.0)) or sum(
        float(v) for k, v in inner.items() if k in ("prepare_s", "read_stage_s", "commit_s"))
    stages = {"plan_task_s": round(t1 - t0, 3), "run_task_s": round(t2 - t1, 3),
              "run_task_other_s": round(max(t2 - t1 - batch_s, 0.0), 3),
              "publish_task_s": round(t3 - t2, 3),
              **{k: float(v) for k, v in inner.items()
                 if k in ("prepare_s", "read_stage_s", "commit_s")}}
    return {"wall_s": t3 - t0, "stages": stages, "batch_id": batch_id,
            "task_seconds": read_task_metrics(Path(ctx["metrics_dir"]), batch_id),
            **verify_and_drop(ctx["dsn"], name, ds)}


def _no_session() -> None:
    """Drop this process's Spark Connect client, if any, as a fresh Airflow task process has
    none (the server keeps its session; these runs go last all the same)."""
    from pyspark.sql.connect.session import SparkSession

    from offsetflow.job import drop_session

    for _ in range(3):  # the active one, then the default one if it is another
        s = SparkSession.getActiveSession() or SparkSession._get_default_session()
        if s is None:
            return
        drop_session(s)
