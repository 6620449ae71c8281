"""Exactly-once under faults that destroy state instead of stopping cleanly (issue 15): a
PostgreSQL crash (`-m immediate`: unlogged data gone), the broker killed with SIGKILL, a
Spark Python worker killed mid-task, and workloads of 1 MB records and tombstones. The
checker judges target rows and dead letters after every one."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import pytest

from offsetflow.ops import run_until_caught_up
from tests.tooling import chaos
from tests.tooling.fault_case import Case

pytestmark = pytest.mark.slow


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> Case:
    topic = make_topic("destroy", 2)
    return Case(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)


def finish(case: Case, spark: Any, bid: int) -> None:
    """What the scheduler does next: re-run the open batch (or plan the next) until caught
    up; the faulted batch must end committed."""
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.batch(bid).status == "committed"
    case.assert_exactly_once()


def test_kafka_killed_while_a_batch_reads_commits_once(case: Case, spark: Any) -> None:
    bid = case.planned_batch(8000, seed=11)
    # the broker is what dies: the run is a thread in the test's own Spark session
    tracker = spark.sparkContext.statusTracker()
    run = case.in_thread(spark, bid)

    def reading() -> bool:
        stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
        return any(s is not None and s.numActiveTasks > 0 for s in stages)
    try:
        # a task runs: the batch is reading from the broker
        chaos.wait_for(lambda: reading() or run.poll() is not None, 180, "a task to start")
        assert run.poll() is None, repr(run.error)
        assert case.batch(bid).status == "running"
        chaos.kill_kafka(restart=False)
        # the readers now retry against the dead broker: one of them (a Python worker of
        # this session) tries to reach it, unless no task is left reading
        chaos.wait_for_reconnect(case.raw["kafka"]["bootstrap_servers"], os.getpid(),
                                 unless=lambda: run.poll() is not None or not reading())
    finally:
        chaos.start_kafka()
    rc = run.wait(timeout=600)
    status = case.batch(bid).status
    assert (rc == 0) == (status == "committed"), repr(run.error)
    finish(case, spark, bid)


def test_python_worker_killed_mid_task_is_retried_exactly_once(case: Case,
                                                              spark: Any) -> None:
    case.raw["spark"].update({"master": "local[2,4]", "max_offsets_per_task": 1500})
    case.write_config()
    bid = case.planned_batch(12000, seed=12)
    # WARN shows Spark's "Lost task ..." line for the killed attempt
    proc = chaos.run_batch_process(case.file, bid, case.log,
                                   env={"OFFSETFLOW_SPARK_LOG_LEVEL": "WARN"})
    try:
        killed = chaos.kill_python_worker(proc.pid)
        assert proc.wait(timeout=600) == 0, case.job_output()[-4000:]
    finally:
        if proc.poll() is None:
            chaos.kill(proc)
    out = case.job_output()
    # Spark saw the crash: its WARN "Lost task" line, the executor's ERROR "Exception in
    # task" (WARNs go to spark.log when the console is kept quiet), or, when the kill hit the
    # Python daemon between tasks, PythonWorkerFactory's failed socket to it
    assert re.search(r"(Lost task|Exception in task|PythonWorkerFactory)"
                     r".*?(Python worker exited unexpectedly"
                     r"|crashed|EOFException|Connection reset|failed to launch worker)",
                     out, re.S), \
        f"pid {killed}: {out[-4000:]}"
    assert case.batch(bid).status == "committed"
    assert case.batch(bid).attempts == 1  # Spark retried the task; the job did not fail
    finish(case, spark, bid)


def test_postgres_crash_during_append_commit_then_retry_commits_once(case: Case,
                                                                   spark: Any) -> None:
    bid = case.planned_batch(3000, seed=13)
    case.postgres_down_in_commit(spark, bid, "pg-crash")
    finish(case, spark, bid)


@pytest.mark.parametrize("path", ["fused", "transform"])
def test_large_records_and_tombstones_exactly_once(case: Case, spark: Any, path: str) -> None:
    """1 MB records (Kafka's default maximum) and null values among ordinary records, on the
    fused read+stage path and on the DataFrame path a transform takes; tombstones become
    dead letters under `bad_records: dead_letter`."""
    case.raw["format"]["schema"] = dict(chaos.SCHEMA_WITH_PAD)
    case.raw["bad_records"] = "dead_letter"
    if path == "transform":
        case.raw["transform"] = "tests.tooling.chaos.maybe_fail_task"  # identity here
    case.write_config()
    rng = random.Random(14)
    case.workload.mixed(1500, rng)
    case.workload.large(12)
    case.workload.tombstones(40)
    case.workload.mixed(1500, rng)
    case.workload.large(6)
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.workload.kinds["large"] == 18 and case.workload.kinds["tombstone"] == 40
    case.assert_exactly_once()
    dead = chaos.dead_letters(case.dsn, case.cfg.dead_letter_table, case.cfg.name)
    assert len(dead) == 40 and all("tombstone" in d.error or "null" in d.error for d in dead), \
        [d.error for d in dead[:3]]
