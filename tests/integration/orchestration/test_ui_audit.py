"""The audit page of the OffsetFlow Airflow plugin (issue 33), in headless Chromium behind
Airflow's login: an audited replay's diff summary, per-partition counts, sample rows and
quality result, and its publish button, clicked: the live table is then what the replay
makes, and the ledger says who published it.

Lineage on publish, not on staging (issue 33 item 4): while the window is staged, the run
task's OpenLineage names the shadow table as its output, never the live one, and Airflow holds
no Asset event for the live table; the Publish button then emits exactly one (read back
through the REST API) with the window's batches, ranges and rows, and an OpenLineage event
naming the live table; publishing again (the CLI, through the REST API) emits no second one.

Only Airflow's API server is started (as in test_ui_plugin.py), on a metadata database of
the tests' own (`airflow_test_env`).
"""

from __future__ import annotations

import json
import os
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.cli.airflow_api import request
from offsetflow.cli.commands import main as offsetflow_cli
from offsetflow.config import load_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import (
    kafka_for,
    plan_window,
    run_batches,
    run_until_caught_up,
    show_audit,
    submit_window,
)
from offsetflow.orchestration.assets import target_uris
from offsetflow.orchestration.observe import batch_lineage
from offsetflow.plan import parse_request
from tests.tooling.airflow_api_server import CHROMIUM, CHROMIUM_ARGS, SHOTS, start_api_server
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query

pytestmark = pytest.mark.slow  # Airflow's API server and headless Chromium

ROOT = Path(__file__).resolve().parents[3]
# beside the stack's own Airflow port (18080 by default: 18091; a helper's block: BASE+91)
PORT = int(os.environ.get("OFFSETFLOW_AIRFLOW_PORT", "18080")) + 11
URL = f"http://127.0.0.1:{PORT}"


@pytest.fixture(scope="module")
def api_server(tmp_path_factory: pytest.TempPathFactory, airflow_test_env: dict[str, str]
               ) -> Iterator[dict[str, Any]]:
    if not airflow_test_env:
        pytest.skip("no Airflow metadata database of the stack (source .stack/env.sh)")
    base = tmp_path_factory.mktemp("ui_audit")
    ol_file = base / "openlineage.jsonl"
    env = {**airflow_test_env, "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
        {"type": "file", "log_file_path": str(ol_file), "append": True}),
        "AIRFLOW__OPENLINEAGE__NAMESPACE": "offsetflow-tests"}
    with start_api_server(base, PORT, env) as server:
        yield {**server, "openlineage": ol_file}


def asset_events(token: str, uri: str) -> list[dict[str, Any]]:
    """Airflow's Asset events of `uri`, through its REST API (none when it knows no such
    asset)."""
    found = request("GET", f"{URL}/api/v2/assets?only_active=false&uri_pattern="
                    f"{urllib.parse.quote(uri, safe='')}", token=token)
    ids = [a["id"] for a in found["assets"] if a["uri"] == uri]
    if not ids:
        return []
    got = request("GET", f"{URL}/api/v2/assets/events?asset_id={ids[0]}", token=token)
    return list(got["asset_events"])


def test_audit_page_shows_the_diff_and_publishes_through_the_ui(
        api_server: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    from playwright.sync_api import expect, sync_playwright

    topic = f"uiaudit-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=30)
    produce_plain(kafka_bootstrap, topic, 40, "ui", 2)
    name = f"uiaudit_{uuid.uuid4().hex[:8]}"
    f = api_server["pipelines"] / f"{name}.yaml"
    f.write_text(yaml.safe_dump({
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": name}}))
    cfg = load_pipeline(f)
    run_until_caught_up(cfg, pg_dsn, spark)
    query(pg_dsn, f"UPDATE {name} SET amount = -1 WHERE partition = 0 AND \"offset\" < 2")
    query(pg_dsn, f"DELETE FROM {name} WHERE partition = 1 AND \"offset\" = 3")
    req = parse_request("replay", {"pipeline": name, "from_offset": 0, "until_offset": 10,
                                   "audit": True})
    with Ledger(pg_dsn) as ledger:
        [audit_id] = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req),
                                   "test")
    run_batches(cfg, pg_dsn, [audit_id], spark)
    # staged: the run task's OpenLineage names the shadow it wrote, not the live table
    lineage = batch_lineage(cfg, [audit_id], complete=True)
    [(shadow,)] = query(pg_dsn, "SELECT shadow_table FROM offsetflow.audits WHERE "
                                "audit_id = %s", (audit_id,))
    assert [o.name.split(".", 1)[1] for o in lineage.outputs] == [shadow]
    assert shadow != f"public.{name}"
    password = api_server["wait"]()
    token = request("POST", f"{URL}/auth/token",
                    {"username": "admin", "password": password})["access_token"]
    uri = target_uris(cfg)
    assert asset_events(token, uri) == []  # nothing is live yet: no event for the table

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1100}).new_page()
            page.goto(f"{URL}/offsetflow/", timeout=60_000)
            page.wait_for_url("**/auth/login**", timeout=60_000)  # behind Airflow's login
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_url("**/offsetflow/", timeout=60_000)
            # the status page's batch row links to its audit
            page.locator(f"section[data-pipeline='{name}'] a.audit-link",
                         has_text=f"audit {audit_id}").first.click()
            page.wait_for_url(f"**/offsetflow/audit/{name}/{audit_id}", timeout=60_000)
            expect(page.locator("#status")).to_have_text("audited", timeout=60_000)
            summary = page.locator("#diff-summary")
            for change, n in (("added", 1), ("removed", 0), ("changed", 2), ("same", 17)):
                expect(summary.locator(f"td[data-change={change}]")).to_have_text(str(n))
            expect(page.locator("#per-range")).to_contain_text(f"{topic}/0")
            changed = page.locator("tr.sample[data-change=changed]")
            expect(changed).to_have_count(2)
            expect(changed.first).to_contain_text("-1")
            expect(changed.first.locator("td.cols")).to_have_text("amount")
            expect(page.locator("#quality")).to_have_text("no quality suite")
            expect(page.get_by_role("button", name="Discard")).to_be_visible()
            page.screenshot(path=str(SHOTS / "audit_page.png"), full_page=True)
            page.get_by_role("button", name="Publish").click()
            expect(page.locator("#status")).to_have_text("published", timeout=60_000)
            expect(page.locator("#message")).to_have_text(f"audit {audit_id} published")
            expect(page.get_by_role("button", name="Publish")).to_have_count(0)
            page.screenshot(path=str(SHOTS / "audit_published.png"), full_page=True)
        finally:
            browser.close()
    assert query(pg_dsn, f"SELECT count(*), count(*) FILTER (WHERE amount < 0) FROM {name} "
                         f"WHERE \"offset\" < 10") == [(20, 0)]
    [(status, closed_by)] = query(pg_dsn, "SELECT status, closed_by FROM offsetflow.audits "
                                          "WHERE audit_id = %s", (audit_id,))
    assert (status, closed_by) == ("published", "airflow:admin")

    # the publish emitted the live table's Asset event, once, with the window
    [event] = asset_events(token, uri)
    extra = event["extra"]
    assert (extra["pipeline"], extra["audit_id"], extra["batch_id"], extra["kind"]) == (
        name, audit_id, audit_id, "replay")
    assert extra["target_table"] == name and extra["rows_written"] == 20
    assert sorted((r["partition"], r["from_offset"], r["until_offset"])
                  for r in extra["ranges"]) == [(0, 0, 10), (1, 0, 10)]
    assert [b["batch_id"] for b in extra["batches"]] == [audit_id]
    assert extra["inputs"] == [f"kafka://{kafka_bootstrap}/{topic}"]
    # and its OpenLineage event, naming the live table as written
    ol = [json.loads(line) for line in api_server["openlineage"].read_text().splitlines()]
    [ev] = [e for e in ol if e["job"]["name"] == f"offsetflow_{name}.audit_publish"]
    assert [d["name"].rsplit(".", 1)[1] for d in ev["outputs"]] == [name]
    assert ev["outputs"][0]["outputFacets"]["outputStatistics"]["rowCount"] == 20
    assert ev["run"]["facets"]["offsetflow_batch"]["batches"][0]["batch_id"] == audit_id

    # publishing again (the CLI, with Airflow's REST API at hand) changes and emits nothing
    def cli_publish(audit: int) -> str:
        os.environ["OFFSETFLOW_AIRFLOW_TOKEN"] = token
        try:
            assert offsetflow_cli(["--dsn", pg_dsn, "audit", "publish", str(audit),
                                   "--pipeline-file", str(f), "--airflow-url", URL]) == 0
        finally:
            del os.environ["OFFSETFLOW_AIRFLOW_TOKEN"]
        out = capsys.readouterr()
        return out.out + out.err

    assert "already published" in cli_publish(audit_id)
    assert len(asset_events(token, uri)) == 1

    # the CLI's own publish sends its event through the REST API
    req = parse_request("replay", {"pipeline": name, "from_offset": 10, "until_offset": 20,
                                   "audit": True})
    with Ledger(pg_dsn) as ledger:
        [second] = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req),
                                 "test")
    run_batches(cfg, pg_dsn, [second], spark)
    show_audit(cfg, pg_dsn, second)
    said = cli_publish(second)
    assert "asset event" in said and "not sent" not in said, said
    events = asset_events(token, uri)
    assert [e["extra"]["audit_id"] for e in events] == [audit_id, second]
    admin.delete_topics([topic])
