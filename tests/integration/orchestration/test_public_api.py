"""The public API on a real `airflow standalone` (scheduler, LocalExecutor, spark-submit in
local mode) with credentials only in Airflow connections (issue 20 items 1-3):

- a DAG written only with `offsetflow.orchestration.operators` (inline config, no YAML) is
  scheduled, plans, runs and commits a batch; its publish task emits an Asset event for the
  target table; a second DAG scheduled on that Asset runs after it and sees the extras;
- a backfill of a YAML pipeline emits too, with its kind;
- the connections' password appears in no task log, ledger row or plugin page.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2.extensions
import pytest
import yaml

from offsetflow.orchestration.assets import table_uri
from tests.tooling.airflow_standalone import airflow_standalone, http
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query

pytestmark = pytest.mark.slow  # a real airflow standalone and two spark-submit jobs

ROOT = Path(__file__).resolve().parents[3]
PORT = 18097  # its own port: other tests may run their own standalone

DAGS = '''
from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Asset, task

from offsetflow.orchestration.operators import offsetflow_pipeline_tasks

CONFIG = {config!r}

with DAG(dag_id="offsetflow_rest_api_{uid}", schedule="@hourly", catchup=False,
         start_date=datetime(2026, 1, 1), max_active_runs=1, is_paused_upon_creation=True):
    offsetflow_pipeline_tasks(config=CONFIG, group_id="ingest")

with DAG(dag_id="offsetflow_rest_consumer_{uid}", is_paused_upon_creation=True,
         schedule=(Asset({inline_uri!r}) | Asset({yaml_uri!r})),
         start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=1):

    @task
    def seen(**context: Any) -> list[dict[str, Any]]:
        events = context["triggering_asset_events"]
        return [dict(e.extra, uri=e.asset.uri) for evs in events.values() for e in evs]

    seen()
'''


def _conn_env(conn_id: str, value: dict[str, Any]) -> tuple[str, str]:
    return f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(value)


@pytest.fixture(scope="module")
def api_stack(tmp_path_factory: pytest.TempPathFactory, secret_dsn: tuple[str, str],
              kafka_bootstrap: str) -> Iterator[dict[str, Any]]:
    from confluent_kafka.admin import AdminClient, NewTopic


    base = tmp_path_factory.mktemp("api")
    uid = uuid.uuid4().hex[:8]
    topic = f"api-{uid}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    dsn, password = secret_dsn
    p = psycopg2.extensions.parse_dsn(dsn)
    kafka_id, pg_id = f"t_kafka_{uid}", f"t_pg_{uid}"
    env_conns = dict([
        _conn_env(kafka_id, {"conn_type": "kafka",
                             "extra": {"bootstrap.servers": kafka_bootstrap}}),
        _conn_env(pg_id, {"conn_type": "postgres", "host": p["host"], "port": int(p["port"]),
                          "schema": p["dbname"], "login": p["user"],
                          "password": password})])
    inline = {"name": f"inl_{uid}", "kafka": {"conn_id": kafka_id},
              "source": {"topics": [topic], "max_records_per_partition": 1000},
              "format": {"type": "json", "schema": dict(SCHEMA)},
              "sink": {"conn_id": pg_id, "table": f"inl_{uid}"}, "retries": 0}
    yaml_name = f"rest_yaml_{uid}"
    pipelines, dag_dir, logs = base / "pipelines", base / "dags", base / "logs"
    pipelines.mkdir()
    (dag_dir / "pipelines").mkdir(parents=True)
    (pipelines / f"{yaml_name}.yaml").write_text(yaml.safe_dump({
        **{k: v for k, v in inline.items() if k != "name"}, "name": yaml_name,
        "schedule": None, "sink": {"conn_id": pg_id, "table": f"yml_{uid}"}}))
    shutil.copy(ROOT / "dags" / "offsetflow_backfill.py", dag_dir)
    inline_uri = table_uri(dsn, f"inl_{uid}")
    yaml_uri = table_uri(dsn, f"side_{uid}")  # the backfill's side table
    (dag_dir / f"api_{uid}.py").write_text(DAGS.format(
        config=inline, uid=uid, inline_uri=inline_uri, yaml_uri=yaml_uri))
    env = {**os.environ, **env_conns, "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(logs)}
    for k in ("OFFSETFLOW_PG_DSN", "OFFSETFLOW_KAFKA_BOOTSTRAP", "OFFSETFLOW_TEST_DSN"):
        env.pop(k, None)  # credentials come only from the connections
    try:
        with airflow_standalone(base, pipelines, dag_dir, PORT, env) as (url, token):
            yield {"url": url, "token": token, "uid": uid, "topic": topic,
                   "inline": inline, "yaml_name": yaml_name, "inline_uri": inline_uri,
                   "yaml_uri": yaml_uri, "password": password, "logs": logs, "base": base,
                   "log": base / "standalone.log"}
            # leave the metadata DB without this test's DAGs (an unpaused @hourly DAG whose
            # file is gone would be scheduled by the next Airflow on this DB)
            for dag_id in (f"offsetflow_rest_api_{uid}", f"offsetflow_rest_consumer_{uid}",
                           f"offsetflow_{yaml_name}"):
                http("DELETE", f"{url}/api/v2/dags/{dag_id}", token=token)
    finally:
        admin.delete_topics([topic])


def _api(s: dict[str, Any], method: str, path: str, body: Any = None) -> Any:
    for _ in range(4):  # a loaded 2-core machine: the API server may be slow to answer
        code, out = http(method, f"{s['url']}/api/v2{path}", body, token=s["token"],
                         timeout=90)
        if code != 0 or method != "GET":
            break
    assert code in (200, 201), (path, code, out)
    return out


def _wait_dag(s: dict[str, Any], dag_id: str) -> None:
    deadline = time.monotonic() + 240
    while http("GET", f"{s['url']}/api/v2/dags/{dag_id}", token=s["token"])[0] != 200:
        assert time.monotonic() < deadline, f"{dag_id} was not parsed: " \
            + s["log"].read_text()[-3000:]
        time.sleep(3)


def _runs(s: dict[str, Any], dag_id: str, n: int, timeout: float = 600) -> list[dict[str, Any]]:
    """Wait until `dag_id` has `n` finished runs; they must all have succeeded."""
    deadline = time.monotonic() + timeout
    while True:
        runs = _api(s, "GET", f"/dags/{dag_id}/dagRuns?order_by=run_after")["dag_runs"]
        done = [r for r in runs if r["state"] in ("success", "failed")]
        if len(done) >= n:
            assert all(r["state"] == "success" for r in done), (done, _task_logs(s))
            return done
        assert time.monotonic() < deadline, (runs, s["log"].read_text()[-4000:])
        time.sleep(4)


def _wait_run(s: dict[str, Any], dag_id: str, run_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while (state := _api(s, "GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]) \
            not in ("success", "failed"):
        assert time.monotonic() < deadline, s["log"].read_text()[-4000:]
        time.sleep(4)
    assert state == "success", _task_logs(s)[-6000:]


def _task_logs(s: dict[str, Any]) -> str:
    return "\n".join(f.read_text(errors="replace") for f in s["logs"].rglob("*") if f.is_file())


def _seen(s: dict[str, Any], run_id: str) -> list[dict[str, Any]]:
    cid = f"offsetflow_rest_consumer_{s['uid']}"
    out = _api(s, "GET", f"/dags/{cid}/dagRuns/{run_id}/taskInstances/seen/xcomEntries/"
                         f"return_value")
    value = out["value"]
    events = json.loads(value) if isinstance(value, str) else value
    # triggering_asset_events may list one event under several keys (asset, alias)
    return list({(e["uri"], e["batch_id"]): e for e in events}.values())


def test_public_api_dag_commits_emits_asset_and_keeps_the_password_secret(
        api_stack: dict[str, Any], pg_dsn: str, kafka_bootstrap: str) -> None:
    s = api_stack
    uid = s["uid"]
    produce_plain(kafka_bootstrap, s["topic"], 400, f"api{uid}", 2)
    producer, consumer = f"offsetflow_rest_api_{uid}", f"offsetflow_rest_consumer_{uid}"
    for dag_id in (producer, consumer, "offsetflow_backfill"):
        _wait_dag(s, dag_id)
    _api(s, "PATCH", f"/dags/{consumer}", {"is_paused": False})
    _api(s, "PATCH", f"/dags/{producer}", {"is_paused": False})  # the scheduler starts it

    run = _runs(s, producer, 1)[0]
    assert run["run_type"] == "scheduled"
    name = s["inline"]["name"]
    batches = query(pg_dsn, "SELECT batch_id, kind, status, rows_written FROM "
                            "offsetflow.batches WHERE pipeline = %s", (name,))
    assert [(k, st, n) for _, k, st, n in batches] == [("scheduled", "committed", 400)]
    assert query(pg_dsn, f"SELECT count(*) FROM inl_{uid}")[0][0] == 400

    seen = _seen(s, _runs(s, consumer, 1)[0]["dag_run_id"])
    assert len(seen) == 1
    ev = seen[0]
    assert ev["uri"] == s["inline_uri"] and ev["batch_id"] == batches[0][0]
    assert (ev["pipeline"], ev["kind"], ev["rows_written"]) == (name, "scheduled", 400)
    assert ev["inputs"] == [f"kafka://{kafka_bootstrap}/{s['topic']}"]
    assert sorted((r["partition"], r["from_offset"], r["until_offset"]) for r in ev["ranges"]) \
        == [(0, 0, 200), (1, 0, 200)]

    # a backfill of the YAML pipeline (connections only) emits too, with its kind
    _api(s, "PATCH", "/dags/offsetflow_backfill", {"is_paused": False})
    bf = _api(s, "POST", "/dags/offsetflow_backfill/dagRuns", {
        "logical_date": None, "conf": {"pipeline": s["yaml_name"], "from_offset": 0,
                                       "until_offset": 50,
                                       "target_table": f"side_{uid}"}})
    _wait_run(s, "offsetflow_backfill", bf["dag_run_id"])  # the DAG is shared: this run
    runs = _runs(s, consumer, 2)
    seen = _seen(s, runs[-1]["dag_run_id"])
    assert {(e["uri"], e["kind"], e["pipeline"]) for e in seen} == {
        (s["yaml_uri"], "backfill", s["yaml_name"])}
    assert sum(e["rows_written"] for e in seen) == 100

    # the password is in no task log, ledger row or plugin page
    logs = _task_logs(s)
    assert "spark-submit" in logs.lower() or "SparkSubmit" in logs
    assert s["password"] not in logs
    ledger = query(pg_dsn, "SELECT b::text FROM offsetflow.batches b WHERE pipeline IN "
                           "(%s, %s)", (name, s["yaml_name"]))
    assert ledger and not any(s["password"] in r[0] for r in ledger)
    for path in ("/offsetflow/", "/offsetflow/api/status",
                 f"/offsetflow/api/status/{s['yaml_name']}"):
        req = urllib.request.Request(s["url"] + path)
        req.add_header("Authorization", f"Bearer {s['token']}")
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
        assert s["yaml_name"] in text and s["password"] not in text, text[:2000]
    code, st = http("GET", f"{s['url']}/offsetflow/api/status/{s['yaml_name']}",
                    token=s["token"])
    assert not st.get("error"), st  # the page reached the ledger through the connection
