"""Batches on a real Spark standalone cluster (issue 16): a master and two 1-core workers
started from pyspark's jars with a clean environment, executors that import offsetflow only
from the packed environment the job ships (spark.archives), a worker killed mid-batch, and
OffsetFlow's default executor JVM options (job/executor_conf.py) on the executors the
workers start, from a run-batch process and from an Airflow spark-submit."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.job.executor_conf import C1_ONLY, EXECUTOR_JAVA_OPTIONS
from offsetflow.ledger import Ledger
from offsetflow.ops import run_until_caught_up
from tests.tooling import chaos, cluster
from tests.tooling.airflow_dags import dags_test
from tests.tooling.fault_case import Case
from tests.tooling.pipeline_data import produce_plain, query

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".venv"


@pytest.fixture(scope="module")
def spark_master() -> Iterator[str]:
    with cluster.spark_cluster() as url:
        yield url


@pytest.fixture
def ccase(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
          spark_master: str) -> Case:
    topic = make_topic("cluster", 4)
    case = Case(tmp_path, pg_dsn, kafka_bootstrap, topic, 4, unique)
    case.raw["spark"] = {"master": spark_master, "max_offsets_per_task": 500,
                         "conf": cluster.spark_conf(tmp_path / "events")}
    case.write_config()
    return case


def assert_shipped(pythons: list[cluster.ExecutorPython]) -> None:
    """Every executor-side interpreter comes from the archive unpacked in a worker's
    application directory, none from the repo's virtualenv."""
    assert pythons, "no executor Python processes found"
    for p in pythons:
        assert not p.python.startswith(str(VENV)), p
        assert p.python.startswith(str(cluster.SPARK_CLUSTER / f"worker{p.worker}" / "work")), p
        assert p.python.endswith(f"/{cluster.ENV_NAME}/bin/python"), p


def assert_c1_only(events: Path) -> None:
    """The app's two executors were started with OffsetFlow's default (C1 only), read from
    the command lines their workers started them with."""
    [log] = cluster.event_logs(events)
    commands = cluster.executor_commands(log.app_id)
    assert len(commands) == 2, (log.app_id, commands)
    for executor, command in commands.items():
        assert C1_ONLY in command.split('"'), (executor, command)
    # Spark puts its own module options before it
    assert C1_ONLY in log.spark_properties[EXECUTOR_JAVA_OPTIONS].split()


def test_executors_of_a_pipeline_without_a_transform_run_c1_only(ccase: Case,
                                                                 tmp_path: Path) -> None:
    """`offsetflow run-batch` (no spark-submit: the session's builder sets the master) of a
    pipeline whose spark.conf names no executor JVM options: its executors run C1 only."""
    del ccase.raw["spark"]["conf"][EXECUTOR_JAVA_OPTIONS]  # the cluster tests' lean flags
    ccase.write_config()
    bid = ccase.planned_batch(400, seed=41)
    proc = ccase.job(bid)
    try:
        assert proc.wait(timeout=600) == 0, ccase.job_output()[-4000:]
    finally:
        if proc.poll() is None:
            chaos.kill(proc)
    assert_c1_only(tmp_path / "events")  # first: the worker sweeps the app's directory
    assert ccase.batch(bid).status == "committed"
    ccase.assert_exactly_once()


def test_worker_killed_mid_batch_then_rerun_commits_once(ccase: Case, spark: Any) -> None:
    """The batch runs on both workers with the shipped environment (the executors'
    interpreters, seen while the app runs), then worker 1 is killed mid-batch."""
    bid = ccase.planned_batch(12000, seed=22)
    proc = ccase.job(bid)
    pythons: list[cluster.ExecutorPython] = []

    def both_workers_and_a_task_on_1() -> bool:
        pythons[:] = cluster.executor_pythons()
        return ({p.worker for p in pythons} == {1, 2}
                and any(p.worker == 1 and p.tasks_running for p in pythons))
    try:
        # both executors run Python tasks, and one is running on worker 1 (its Python
        # daemon has forked a task process)
        chaos.wait_for(both_workers_and_a_task_on_1, 300,
                       "tasks on both workers, one running on worker 1", every_s=0.1)
        assert_shipped(pythons)
        assert ccase.batch(bid).status == "running"
        cluster.stack("spark-worker-kill", "1")
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            chaos.kill(proc)
        cluster.stack("spark-cluster-start")  # worker 1 back for the next tests
    status = ccase.batch(bid).status
    out = ccase.job_output()
    assert (rc == 0) == (status == "committed"), out[-4000:]
    assert "Lost executor" in out or "lost" in out.lower() or rc != 0, out[-4000:]
    if status != "committed":  # the scheduler's retry: the same batch again, on the cluster
        again = ccase.job(bid)
        assert again.wait(timeout=600) == 0, ccase.job_output()[-4000:]
    assert ccase.batch(bid).status == "committed"
    run_until_caught_up(ccase.cfg, ccase.dsn, spark)
    ccase.assert_exactly_once()


def test_workers_run_without_the_repo_venv(spark_master: str) -> None:
    """The cluster daemons' environment has no venv on PATH and no PYTHONPATH: only a
    shipped environment can give executors offsetflow."""
    pids = cluster.worker_pids()
    assert pids, "no workers running"
    for pid in pids.values():
        env = dict(kv.split("=", 1) for kv in
                   Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
        assert str(VENV) not in env.get("PATH", ""), env.get("PATH")
        assert "PYTHONPATH" not in env and "PYSPARK_PYTHON" not in env, sorted(env)
    base = subprocess.run(["/usr/bin/env", "-i", "python3", "-c", "import offsetflow"],
                          capture_output=True)
    assert base.returncode != 0  # the machine's Python has no offsetflow either


def test_scheduled_dag_run_with_spark_default_at_the_standalone_master(
        airflow_project: dict[str, Any], pg_dsn: str,
        kafka_bootstrap: str, spark_master: str, tmp_path: Path) -> None:
    """`airflow dags test` of a pipeline's scheduled DAG with spark_default pointed at the
    master (client deploy mode: Spark has no cluster mode for Python apps on standalone);
    spark-submit's arguments come from the connection and the pipeline's spark.conf. The
    driver's session sets OffsetFlow's default executor JVM options under spark-submit, and
    the executors, started after it, run with them."""
    p = airflow_project
    path = p["pipelines"] / f"{p['name']}.yaml"
    cfg = yaml.safe_load(path.read_text())
    events = tmp_path / "events"
    conf = cluster.spark_conf(events)
    del conf[EXECUTOR_JAVA_OPTIONS]  # the cluster tests' lean flags: OffsetFlow's default
    cfg["spark"] = {"max_offsets_per_task": 60, "conf": conf}
    path.write_text(yaml.safe_dump(cfg))
    produce_plain(kafka_bootstrap, p["topic"], 600, f"k{p['name']}", 2)
    host, port = spark_master.rsplit(":", 1)
    p["env"]["AIRFLOW_CONN_SPARK_DEFAULT"] = json.dumps(
        {"conn_type": "spark", "host": host, "port": int(port),
         "extra": {"deploy-mode": "client"}})
    out = dags_test(p, f"offsetflow_{p['name']}")
    assert f"--master {spark_master}" in out, out[-6000:]
    assert_c1_only(events)  # first: the worker sweeps the app's directory
    assert p["password"] not in out
    with Ledger(pg_dsn) as ledger:
        batches = ledger.recent_batches(p["name"])
    assert [(b.kind, b.status) for b in batches] == [("scheduled", "committed")]
    assert query(pg_dsn, f"SELECT count(*) FROM {p['table']}")[0][0] == 600
    [log] = cluster.event_logs(events)
    assert len(log.workers_with_tasks) == 2, (log.executor_worker, log.tasks_by_executor)
    assert sum(log.tasks_by_executor.values()) >= 10
    assert log.spark_properties["spark.master"] == spark_master
    assert log.spark_properties["spark.archives"].endswith("offsetflow-env.tar.gz#environment")
    assert log.spark_properties["spark.pyspark.python"] == "./environment/bin/python"
