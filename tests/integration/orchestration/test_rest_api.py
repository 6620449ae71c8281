"""Replay through Airflow's REST API with a run conf, against a real `airflow standalone`
(scheduler, LocalExecutor; the batch on the warm Spark Connect server: the operator's
spark-submit path is the public API test's), triggered by `offsetflow replay`
(which logs in and posts the run): the run succeeds and lands in the same replay DAG and the
same ledger record as the UI form."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from offsetflow.config import load_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import run_until_caught_up
from tests.tooling.airflow_standalone import SharedStandalone, http
from tests.tooling.pipeline_data import produce_plain, query

# a real airflow standalone: the one these modules share (conftest.py)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def standalone(shared_airflow: SharedStandalone) -> dict[str, Any]:
    """The shared standalone with the replay DAG and a test pipeline of this module."""
    s = shared_airflow.get()
    return {**s["rest"], "url": s["url"], "token": s["token"], "log": s["log"]}


def test_replay_through_rest_api_with_run_conf(standalone: dict[str, Any], pg_dsn: str,
                                                kafka_bootstrap: str, spark: Any) -> None:
    s = standalone
    produce_plain(kafka_bootstrap, s["topic"], 200, f"r{s['name']}", 2)
    cfg = load_pipeline(s["pipelines"] / f"{s['name']}.yaml")
    run_until_caught_up(cfg, pg_dsn, spark)  # commit first: only committed ranges replay
    url, token = s["url"], s["token"]
    assert http("GET", f"{url}/api/v2/dags/offsetflow_replay")[0] == 401  # login needed
    deadline = time.monotonic() + 180
    while http("GET", f"{url}/api/v2/dags/offsetflow_replay", token=token)[0] != 200:
        assert time.monotonic() < deadline, "the replay DAG was not parsed"
        time.sleep(1)
    code, body = http("PATCH", f"{url}/api/v2/dags/offsetflow_replay", {"is_paused": False},
                      token=token)
    assert code == 200, body
    # `offsetflow replay` triggers the run through the REST API (issue 29 item 6): it works
    # against a remote Airflow, logging in with the user's credentials from the environment
    password = json.loads(Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
                          .read_text())["admin"]
    cli = [str(Path(sys.executable).parent / "offsetflow"), "replay", "-p", s["name"],
           "--partitions", "1", "--from-offset", "10", "--until-offset", "60",
           "--airflow-url", url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    wrong = subprocess.run(cli, capture_output=True, text=True, timeout=120, env={
        **env, "OFFSETFLOW_AIRFLOW_USERNAME": "admin", "OFFSETFLOW_AIRFLOW_PASSWORD": "nope"})
    assert wrong.returncode == 2 and "auth/token: HTTP 401" in wrong.stderr, wrong.stderr
    assert "nope" not in wrong.stderr + wrong.stdout
    p = subprocess.run(cli, capture_output=True, text=True, timeout=120, env={
        **env, "OFFSETFLOW_AIRFLOW_USERNAME": "admin", "OFFSETFLOW_AIRFLOW_PASSWORD": password})
    assert p.returncode == 0, p.stdout + p.stderr
    assert password not in p.stdout + p.stderr
    m = re.search(r"triggered offsetflow_replay run (\S+) on " + re.escape(url), p.stdout)
    assert m, p.stdout
    run_id = m.group(1)
    code, run = http("GET", f"{url}/api/v2/dags/offsetflow_replay/dagRuns/{run_id}",
                     token=token)
    assert code == 200 and run["conf"] == {"pipeline": s["name"], "partitions": "1",
                                           "from_offset": 10, "until_offset": 60}, run
    deadline = time.monotonic() + 420
    state = None
    while time.monotonic() < deadline:
        code, cur = http("GET", f"{url}/api/v2/dags/offsetflow_replay/dagRuns/{run_id}",
                         token=token)
        state = cur.get("state") if isinstance(cur, dict) else None
        if state in ("success", "failed"):
            break
        time.sleep(1)
    assert state == "success", (state, s["log"].read_text()[-4000:])
    with Ledger(pg_dsn) as ledger:
        replays = [b for b in ledger.recent_batches(s["name"]) if b.kind == "replay"]
        positions = ledger.positions(s["name"])
    assert len(replays) == 1 and replays[0].status == "committed"
    assert replays[0].started_by.startswith("airflow:offsetflow_replay:")
    assert positions == {(s["topic"], 0): 100, (s["topic"], 1): 100}
    rows = query(pg_dsn, f"SELECT \"offset\", _offsetflow_batch_id FROM {s['table']} "
                         f"WHERE partition = 1")
    assert sorted(o for o, _ in rows) == list(range(100))  # one copy of every offset
    assert {o for o, b in rows if b == replays[0].batch_id} == set(range(10, 60))
