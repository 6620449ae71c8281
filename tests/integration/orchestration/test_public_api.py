"""The public API on a real `airflow standalone` (scheduler, LocalExecutor; the inline DAG's
batch with spark-submit in local mode, the YAML backfill's on the warm Spark Connect server)
with credentials only in Airflow connections (issue 20 items 1-3):

- a DAG written only with `offsetflow.orchestration.operators` (inline config, no YAML) is
  scheduled, plans, runs and commits a batch; its publish task emits an Asset event for the
  target table; a second DAG scheduled on that Asset runs after it and sees the extras;
- a backfill of a YAML pipeline emits too, with its kind;
- the connections' password appears in no task log, ledger row or plugin page.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.tooling.airflow_standalone import SharedStandalone, http
from tests.tooling.pipeline_data import produce_plain, query

# a real airflow standalone (the one these modules share: conftest.py; this module's DAGs,
# pipeline and connections are in it: `public_api_project`): the inline DAG's batch with
# spark-submit, the YAML pipeline's backfill on the warm Spark Connect server
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api_stack(shared_airflow: SharedStandalone) -> Iterator[dict[str, Any]]:
    s = shared_airflow.get()
    yield {**s["api"], "url": s["url"], "token": s["token"], "logs": s["logs"],
           "base": s["base"], "log": s["log"]}
    # the Airflow lives on for the other modules: pause this test's DAGs (an unpaused
    # @hourly DAG would be scheduled again when the hour turns)
    for dag_id in s["api"]["dag_ids"]:
        http("PATCH", f"{s['url']}/api/v2/dags/{dag_id}", {"is_paused": True},
             token=s["token"])


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
        time.sleep(1)


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
        time.sleep(1)


def _wait_run(s: dict[str, Any], dag_id: str, run_id: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while (state := _api(s, "GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]) \
            not in ("success", "failed"):
        assert time.monotonic() < deadline, s["log"].read_text()[-4000:]
        time.sleep(1)
    assert state == "success", _task_logs(s)[-6000:]


def _task_logs(s: dict[str, Any], only: tuple[str, ...] = ()) -> str:
    """The task logs of the shared Airflow; `only`: of the files whose path names one of
    these (`dag_id=...`, `run_id=...`: the logs of this module's runs)."""
    return "\n".join(f.read_text(errors="replace") for f in s["logs"].rglob("*")
                     if f.is_file() and (not only or any(o in str(f) for o in only)))


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
    own = _task_logs(s, (f"dag_id={producer}", f"dag_id={consumer}",
                         f"run_id={bf['dag_run_id']}"))
    assert "spark-submit" in own.lower() or "SparkSubmit" in own
    assert s["password"] not in _task_logs(s)  # this module's runs and the others'
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
