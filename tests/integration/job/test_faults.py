"""Exactly-once under faults: each step of the lifecycle broken for real, then the checker
judges the sink (issue: fault-injection suite). Jobs run as real processes so they can be
killed; commits are held on a row lock to open a window for a fault at that exact step.
A job killed at its commit (its Spark tasks have all ended) is a thin client of the warm
Spark Connect server; one killed or retried while tasks run has a JVM of its own; a run
that meets a broken service rather than a kill runs in the test's own session."""

from __future__ import annotations

import os
import random
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from offsetflow.errors import BatchStateError, OffsetsResetError, TopicRecreatedError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only, run_until_caught_up
from offsetflow.ops.runner import run_cycle
from tests.tooling import chaos
from tests.tooling.fault_case import Case

pytestmark = pytest.mark.slow  # each test runs jobs as processes and breaks a service

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> Case:
    topic = make_topic("fault", 2)
    return Case(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)


def test_killed_after_planning_rerun_reads_the_same_ranges(case: Case, spark: Any) -> None:
    case.workload.mixed(3000, random.Random(1))
    planned = plan_only(case.cfg, case.dsn)
    assert planned.batch is not None
    proc = case.job(planned.batch.batch_id)
    # its JVM starts first: a minute and more on a loaded 2-core machine
    chaos.wait_for(lambda: case.batch(planned.batch.batch_id).status == "running", 300,
                   "the job to start")
    chaos.kill(proc)  # dies while reading
    again = plan_only(case.cfg, case.dsn)
    assert again.reused and again.batch is not None
    assert again.batch.ranges == planned.batch.ranges
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_task_failing_mid_range_is_retried_without_double_staging(case: Case,
                                                                 spark: Any) -> None:
    case.workload.mixed(3000, random.Random(2))
    case.raw["transform"] = "tests.tooling.chaos.maybe_fail_task"  # with OFFSETFLOW_CHAOS_TASK_FAIL
    case.raw["spark"]["conf"] = {"spark.task.maxFailures": "4"}
    case.write_config()
    planned = plan_only(case.cfg, case.dsn)
    assert planned.batch is not None
    # a session with task retries (local[N, maxFailures]) like a cluster has
    proc = subprocess.run(
        ["spark-submit", "--master", "local[2,4]", "spark_jobs/run_batch.py",
         "--pipeline-file", str(case.file), "--batch-id", str(planned.batch.batch_id)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "OFFSETFLOW_CHAOS_TASK_FAIL": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"chaos: task \d+ attempt 0 fails", out), out[-3000:]
    assert case.batch(planned.batch.batch_id).status == "committed"
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_job_killed_after_staging_then_rerun_commits_once(case: Case, spark: Any,
                                                          spark_connect_url: str) -> None:
    bid = case.planned_batch(3000, seed=3)
    with case.job_waiting_to_commit(bid, spark_connect_url) as proc:
        chaos.kill(proc)  # everything staged, nothing committed
    assert case.batch(bid).status != "committed"
    assert set(case.positions().values()) == {0}  # the start: nothing committed
    staged = chaos.staged_rows(case.dsn, bid)
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert rep.result.rows_written == staged  # the earlier attempt's staging was re-used
    assert case.batch(bid).attempts == 2
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_connection_cut_during_commit_rolls_back_and_retry_commits(
        case: Case, spark: Any, spark_connect_url: str) -> None:
    bid = case.planned_batch(3000, seed=4)
    with case.job_waiting_to_commit(bid, spark_connect_url) as proc:
        assert chaos.cut_commit_connection(case.dsn) >= 1
        assert proc.wait(timeout=120) != 0
    out = case.job_output().lower()
    assert "terminat" in out or "server closed the connection" in out, out[-2000:]
    assert set(case.positions().values()) == {0}  # the start: nothing committed
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_postgres_restart_during_commit(case: Case, spark: Any) -> None:
    bid = case.planned_batch(3000, seed=5)
    case.postgres_down_in_commit(spark, bid, "pg-stop")
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_kafka_restart_while_reading(case: Case, spark: Any) -> None:
    case.workload.mixed(6000, random.Random(6))
    planned = plan_only(case.cfg, case.dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_batch(spark, case.cfg, bid, case.dsn)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    tracker = spark.sparkContext.statusTracker()
    chaos.stop_kafka()
    try:
        t.start()
        # the readers start against a dead broker and keep retrying: a Spark job runs
        chaos.wait_for(lambda: bool(tracker.getActiveJobsIds()) or not t.is_alive(), 120,
                       "the batch's Spark job to start reading")
    finally:
        chaos.start_kafka()
    t.join(timeout=300)
    assert not t.is_alive()
    if errors:  # a failed attempt is allowed; a wrong result is not
        assert case.batch(bid).status == "failed"
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_killed_after_commit_retry_is_a_noop(case: Case, spark: Any) -> None:
    case.workload.plain(1000)
    res = run_cycle(case.cfg, case.dsn, spark)
    assert res.report is not None
    bid = res.report.batch_id
    before = len(chaos.sink_rows(case.dsn, case.table))
    proc = case.job(bid)  # Airflow's retry of a task whose job had committed
    assert proc.wait(timeout=300) == 0
    out = case.job_output()
    assert f"batch {bid} was already committed; nothing to do" in out
    # answered from the ledger: the retry started no Spark session (no JVM, no workers)
    assert f'batch {bid} timings {{"spark_start_s": 0.0}}' in out, out[-3000:]
    assert len(chaos.sink_rows(case.dsn, case.table)) == before
    case.assert_exactly_once()


def test_two_runs_of_the_same_batch_at_once_one_commits(case: Case, spark: Any,
                                                        spark_connect_url: str) -> None:
    """A job process (a client of the Connect server) takes the batch; a run in the test's
    own session starts on it while it works: two drivers, two Spark engines, one ledger."""
    case.workload.mixed(4000, random.Random(8))
    planned = plan_only(case.cfg, case.dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    a = case.job(bid, spark_connect_url)
    chaos.wait_for(lambda: case.batch(bid).status == "running" or a.poll() is not None, 300,
                   "the job process to take the batch")
    b = case.in_thread(spark, bid)
    assert a.wait(timeout=300) == 0 and b.wait(timeout=300) == 0, repr(b.error)
    out = case.job_output()  # what the process printed as its result, one line
    # the run here printed nothing: its result's summary is the line it would print
    out += f"\n{b.result.result.message}\n"
    assert len(re.findall(rf"^batch {bid} committed: ", out, re.M)) == 1, out[-3000:]
    assert len(re.findall(rf"^batch {bid} was already committed; nothing to do$", out,
                          re.M)) == 1, out[-3000:]
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_zombie_with_stale_ranges_is_fenced(case: Case, spark: Any,
                                            spark_connect_url: str) -> None:
    case.workload.plain(2000)
    old = plan_only(case.cfg, case.dsn).batch
    assert old is not None
    run_batch(spark, case.cfg, old.batch_id, case.dsn)
    with Ledger(case.dsn) as ledger, ledger.transaction() as cur:
        zombie = ledger.insert_batch(cur, pipeline=case.cfg.name, kind="scheduled",
                                     ranges=old.ranges, target_table=case.table,
                                     config_fingerprint=case.cfg.fingerprint(),
                                     split_offsets=case.cfg.spark.max_offsets_per_task,
                                     started_by="zombie")
    proc = case.job(zombie, spark_connect_url)
    assert proc.wait(timeout=300) == 2
    assert f"batch {zombie} fenced" in case.job_output()
    case.assert_exactly_once()


# -- bad input ---------------------------------------------------------------------------
def test_topic_deleted_and_recreated_is_refused(tmp_path: Path, pg_dsn: str,
                                                kafka_bootstrap: str, unique: str,
                                                spark: Any) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    topic = f"recreate-{unique}"
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    c = Case(tmp_path, pg_dsn, kafka_bootstrap, topic, 1, unique)
    try:
        c.workload.plain(300)
        run_until_caught_up(c.cfg, pg_dsn, spark)
        admin.delete_topics([topic])[topic].result(30)
        chaos.wait_for(lambda: topic not in admin.list_topics(timeout=10).topics, 60,
                       "topic deletion")

        def recreate() -> bool:
            try:
                admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
                return True
            except Exception:  # noqa: BLE001 - deletion still finishing
                return False
        chaos.wait_for(recreate, 60, "topic re-creation", every_s=1)
        fresh = chaos.Workload(kafka_bootstrap, topic, 1, f"n{unique}")
        fresh.plain(500)  # more records than the old position: offsets alone look fine
        with pytest.raises(TopicRecreatedError, match=f"topic {topic} was deleted and recreated"):
            plan_only(c.cfg, pg_dsn)
        assert c.positions() == {(topic, 0): 300}
    finally:
        admin.delete_topics([topic])


def test_position_beyond_log_end_is_refused(case: Case, spark: Any) -> None:
    case.workload.plain(100)
    run_until_caught_up(case.cfg, case.dsn, spark)
    with Ledger(case.dsn) as ledger, ledger.transaction() as cur:
        cur.execute("UPDATE offsetflow.positions SET next_offset = 900, topic_id = NULL "
                    "WHERE pipeline = %s AND partition = 0", (case.cfg.name,))
    with pytest.raises(OffsetsResetError, match=r"\[0\]: committed position 900 is beyond"):
        plan_only(case.cfg, case.dsn)


def test_partition_added_while_running_is_read_from_its_start(case: Case,
                                                              spark: Any) -> None:
    from confluent_kafka.admin import AdminClient, NewPartitions

    case.raw["source"]["starting"] = "latest"
    case.write_config()
    run_until_caught_up(case.cfg, case.dsn, spark)  # starts at the end: nothing yet
    case.workload.plain(400)
    run_until_caught_up(case.cfg, case.dsn, spark)
    admin = AdminClient({"bootstrap.servers": case.workload.bootstrap})
    admin.create_partitions([NewPartitions(case.workload.topic, 3)])[
        case.workload.topic].result(30)
    case.workload.partitions = 3
    chaos.wait_for(lambda: len(admin.list_topics(case.workload.topic, timeout=10)
                               .topics[case.workload.topic].partitions) == 3, 30, "partition")
    case.workload.plain(600)
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.positions()[(case.workload.topic, 2)] == 200
    case.assert_exactly_once()


def test_config_changed_between_plan_and_run_is_a_clear_error(case: Case,
                                                              spark: Any) -> None:
    case.workload.plain(200)
    planned = plan_only(case.cfg, case.dsn)
    assert planned.batch is not None
    case.raw["sink"]["table"] = case.table + "_other"
    case.write_config()
    with pytest.raises(BatchStateError, match="config changed since batch"):
        run_batch(spark, case.cfg, planned.batch.batch_id, case.dsn)
    assert set(case.positions().values()) == {0}  # the start: nothing committed
    rep = run_batch(spark, case.cfg, planned.batch.batch_id, case.dsn,
                    accept_config_change=True)
    assert rep.result.status == "committed"


def test_changed_split_restages_instead_of_reusing_old_parts(case: Case, spark: Any,
                                                             spark_connect_url: str) -> None:
    bid = case.planned_batch(3000, seed=9)
    with case.job_waiting_to_commit(bid, spark_connect_url) as proc:
        chaos.kill(proc)  # everything staged with the old split into parts
    assert chaos.staged_rows(case.dsn, bid) > 0
    old_split = case.batch(bid).split_offsets
    case.raw["spark"]["max_offsets_per_task"] = 300  # other parts, other rows in each
    case.write_config()
    assert old_split is not None and old_split != 300
    # the split changes how the batch is staged, not what it writes: no acceptance needed
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert case.batch(bid).split_offsets == 300
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()
