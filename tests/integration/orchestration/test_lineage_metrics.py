"""Lineage and metrics (issue 20 item 5) after a real DAG run (`airflow dags test`, Spark
local, real Kafka/PostgreSQL): the OpenLineage file transport holds the publish task's event
with the Kafka topic as input and the PostgreSQL table as output (OpenLineage naming), and a
real StatsD listener (a UDP socket of this test) receives the pipeline's stats from Airflow's
own Stats with the right names and values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from tests.tooling.airflow_dags import dags_test
from tests.tooling.pipeline_data import SCHEMA, produce_plain
from tests.tooling.statsd_listener import StatsdListener

pytestmark = pytest.mark.slow  # Airflow runs the pipeline's DAG with a Spark job


def test_dag_run_emits_openlineage_datasets_and_statsd_metrics(
        airflow_project: dict[str, Any], kafka_bootstrap: str, tmp_path: Path) -> None:
    p = airflow_project
    # 450 per partition, the pipeline reads at most 400 per partition: lag 100 after commit
    produce_plain(kafka_bootstrap, p["topic"], 900, f"m{p['name']}", 2)
    ol_file = tmp_path / "openlineage.jsonl"
    statsd = StatsdListener()
    project = {**p, "env": {
        **p["env"],
        "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
            {"type": "file", "log_file_path": str(ol_file), "append": True}),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "offsetflow-tests",
        "AIRFLOW__METRICS__STATSD_ON": "True",
        "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
        "AIRFLOW__METRICS__STATSD_PORT": str(statsd.port),
        "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
    }}
    try:
        dags_test(project, f"offsetflow_{p['name']}")
    finally:
        statsd.close()

    # -- OpenLineage: the publish task's COMPLETE event -----------------------------------
    assert ol_file.exists(), "no OpenLineage event was written"
    text = ol_file.read_text()
    assert p["password"] not in text
    events = [json.loads(line) for line in text.splitlines() if line.strip()]
    publish = [e for e in events if e.get("eventType") == "COMPLETE"
               and e["job"]["name"].endswith(".publish")]
    assert publish, [(e.get("eventType"), e["job"]["name"]) for e in events]
    ev = publish[-1]
    params = psycopg2.extensions.parse_dsn(p["env"]["OFFSETFLOW_TEST_DSN"])
    pg_ns = f"postgres://{params['host']}:{params['port']}"
    assert [(d["namespace"], d["name"]) for d in ev["inputs"]] == [
        (f"kafka://{kafka_bootstrap}", p["topic"])]
    fields = ev["inputs"][0]["facets"]["schema"]["fields"]
    assert sorted((f["name"], f["type"]) for f in fields) == sorted(SCHEMA.items())
    assert [(d["namespace"], d["name"]) for d in ev["outputs"]] == [
        (pg_ns, f"{params['dbname']}.public.{p['table']}")]

    # -- StatsD: per pipeline, through Airflow's Stats ------------------------------------
    base = f"airflow.offsetflow.{p['name']}"
    assert statsd.values(f"{base}.records_read") == [(800.0, "c")], statsd.lines
    assert statsd.values(f"{base}.rows_written") == [(800.0, "c")]
    assert statsd.values(f"{base}.dead_letters") == [(0.0, "c")]
    assert statsd.values(f"{base}.batches") == [(1.0, "c")]
    assert statsd.values(f"{base}.lag") == [(100.0, "g")]
    (commit_ms, kind), = statsd.values(f"{base}.commit_duration")
    assert kind == "ms" and 0 < commit_ms < 120_000
