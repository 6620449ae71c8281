"""The backfill and replay forms in a real browser: headless Chromium against a real
`airflow standalone`, filling each trigger form, triggering, and seeing the run succeed. The
runs' batches run on the warm Spark Connect server (`shared_standalone`): this test asserts
the forms and what the runs commit; their operator's spark-submit runs in
test_public_api.py (the inline DAG)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from offsetflow.config import load_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import run_until_caught_up
from tests.tooling.airflow_standalone import SharedStandalone, http
from tests.tooling.pipeline_data import produce_plain, query

# the shared airflow standalone (conftest.py) and headless Chromium
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "test-output" / "ui"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def standalone(shared_airflow: SharedStandalone) -> dict[str, Any]:
    """The shared standalone with both window DAGs and a test pipeline of this module."""
    s = shared_airflow.get()
    return {**s["forms"], "url": s["url"], "token": s["token"], "log": s["log"]}


def wait_for_run(s: dict[str, Any], dag_id: str, after: float,
                 states: tuple[str, ...] = ("success", "failed")) -> dict[str, Any]:
    """The run triggered at `after` (the shared metadata DB may hold older runs), once it is
    in one of `states`."""
    url, token = s["url"], s["token"]
    deadline = time.monotonic() + 600  # a ceiling: under heavy load a run took over 7 min
    while time.monotonic() < deadline:
        _, body = http("GET", f"{url}/api/v2/dags/{dag_id}/dagRuns?limit=100", token=token)
        runs = [r for r in (body.get("dag_runs", []) if isinstance(body, dict) else [])
                if r.get("run_after") and datetime.fromisoformat(
                    r["run_after"].replace("Z", "+00:00")).timestamp() >= after - 2]
        if runs and (not states or runs[-1]["state"] in states):
            return runs[-1]
        time.sleep(1)  # one API read a second: cheap beside the run it waits for
    raise AssertionError(f"no finished run of {dag_id}: {s['log'].read_text()[-3000:]}")


def trigger_with_form(page: Any, s: dict[str, Any], dag_id: str, fields: dict[str, str],
                      shot: str) -> dict[str, Any]:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    url, token = s["url"], s["token"]
    deadline = time.monotonic() + 180
    while http("GET", f"{url}/api/v2/dags/{dag_id}", token=token)[0] != 200:
        assert time.monotonic() < deadline, f"{dag_id} was not parsed"
        time.sleep(1)
    assert http("PATCH", f"{url}/api/v2/dags/{dag_id}", {"is_paused": False},
                token=token)[0] == 200
    page.goto(f"{url}/dags/{dag_id}")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    dialog.locator("input[name=element_pipeline]").wait_for(timeout=30_000)
    for name, value in fields.items():
        box = dialog.locator(f"input[name=element_{name}]")
        box.fill("")
        box.fill(value)
    OUT.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(OUT / f"{shot}_form.png"), full_page=True)
    started = time.time()
    dialog.get_by_role("button", name="Trigger").click()
    wait_for_run(s, dag_id, started, states=())  # the form's request made the run
    # while the run runs, the browser shows a blank page: the DAG page re-renders its grid
    # every few seconds while a run is active (Chromium's renderer: ~2.5 CPU-min a test)
    page.goto("about:blank")
    run = wait_for_run(s, dag_id, started)
    page.goto(f"{url}/dags/{dag_id}/runs/{run['dag_run_id']}")
    # the screenshot once the page shows the run's state, not after a fixed 3 s
    with contextlib.suppress(PlaywrightTimeout):
        page.get_by_text(run["state"], exact=False).filter(visible=True).first.wait_for(
            timeout=30_000)
    page.screenshot(path=str(OUT / f"{shot}_run.png"), full_page=True)
    assert run["state"] == "success", (run, s["log"].read_text()[-3000:])
    return run


def test_backfill_and_replay_forms_in_chromium(standalone: dict[str, Any], pg_dsn: str,
                                               kafka_bootstrap: str, spark: Any) -> None:
    from playwright.sync_api import sync_playwright

    s = standalone
    produce_plain(kafka_bootstrap, s["topic"], 200, f"u{s['name']}", 2)
    cfg = load_pipeline(s["pipelines"] / f"{s['name']}.yaml")
    run_until_caught_up(cfg, pg_dsn, spark)  # replay needs committed offsets
    password = json.loads(Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
                          .read_text())["admin"]
    side = f"side_{s['name']}"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                    args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(s["url"] + "/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", password)
        page.keyboard.press("Enter")
        page.wait_for_url(lambda u: "/auth/login" not in u, timeout=60_000)
        trigger_with_form(page, s, "offsetflow_backfill",
                          {"pipeline": s["name"], "from_offset": "0", "until_offset": "40",
                           "records_per_batch": "50", "target_table": side}, "backfill")
        trigger_with_form(page, s, "offsetflow_replay",
                          {"pipeline": s["name"], "partitions": "0", "from_offset": "10",
                           "until_offset": "60"}, "replay")
        browser.close()
    with Ledger(pg_dsn) as ledger:
        kinds = [(b.kind, b.status) for b in ledger.recent_batches(s["name"])]
    assert ("backfill", "committed") in kinds and ("replay", "committed") in kinds
    assert sorted(query(pg_dsn, f"SELECT partition, \"offset\" FROM {side}")) == sorted(
        (pt, o) for pt in (0, 1) for o in range(40))
    rows = query(pg_dsn, f"SELECT \"offset\" FROM {s['table']} WHERE partition = 0")
    assert sorted(r[0] for r in rows) == list(range(100))  # one copy per offset after replay
