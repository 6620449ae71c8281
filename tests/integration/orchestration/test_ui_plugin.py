"""Lag and batch view in Airflow (issue): the OffsetFlow plugin page, reached from Airflow's
menu and behind Airflow's own login, shows per partition the committed position, latest
offset and lag, the recent batches and a lag-over-time chart; its JSON API returns the same
data as `offsetflow status --json`; anonymous requests are refused.

The server is Airflow's own API server (the process that mounts plugin FastAPI apps and
serves the UI) on a port of its own. Only the API server is started, not a full
`airflow standalone`: a second scheduler and DAG processor pointed at this test's pipelines
folder would re-parse the shared DAGs folder against the wrong pipelines and flip DAGs in the
shared metadata database that other Airflow instances show.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.config import load_pipeline
from offsetflow.ops import pipeline_status
from offsetflow.ops.runner import run_cycle
from tests.tooling.airflow_api_server import CHROMIUM, CHROMIUM_ARGS, SHOTS, start_api_server
from tests.tooling.pipeline_data import SCHEMA, produce_plain

pytestmark = pytest.mark.slow  # airflow standalone and headless Chromium

ROOT = Path(__file__).resolve().parents[3]
PORT = 18090  # its own port: 18080 is the stack's standalone, 18095 the REST API test's
URL = f"http://127.0.0.1:{PORT}"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def http(method: str, path: str, body: Any = None, token: str | None = None,
         timeout: float = 60) -> tuple[int, dict[str, str], str]:
    """(status, headers, body text); redirects are not followed."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(URL + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, {}, str(e)


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Airflow's API server with the plugin, reading pipelines from a folder of this test.
    Started here, awaited by `wait()` (the test prepares its data meanwhile), always stopped."""
    with start_api_server(tmp_path_factory.mktemp("ui_plugin"), PORT) as server:
        yield server


def _render_sample() -> str:
    from offsetflow.orchestration.plugin import render_page

    part = {"topic": "orders", "earliest": 0, "latest": 5000, "retention_headroom": 4000,
            "retention_seconds": 3600.0}
    batch: dict[str, Any] = {
        "batch_id": 7, "pipeline": "orders", "kind": "replay", "status": "failed",
        "ranges": [{"topic": "orders", "partition": 0, "from_offset": 10, "until_offset": 60}],
        "records_read": 50, "rows_written": None, "bad_records": 2,
        "planned_at": "2026-01-01T10:00:00+00:00", "started_at": "2026-01-01T10:00:01+00:00",
        "finished_at": "2026-01-01T10:01:31+00:00", "timings": {"prepare_s": 1.5},
        "quality": {"suite": "orders", "success": False, "policy": "fail", "routed_rows": 0,
                    "summary": "expect_column_values_to_be_between on amount: 2 of 50 rows",
                    "expectations": [{"success": True}, {"success": False}]},
        "error": "batch 7 failed quality suite 'orders' <script>alert(1)</script>"}
    st = {"pipeline": "orders", "kafka_error": None, "total_lag": 4200,
          "max_lag_seconds": 3300.0,
          "warnings": ["orders[0]: unread data ages out in 300s (8% of retention left)"],
          "partitions": [
              {**part, "partition": 0, "committed": 1000, "lag": 4000, "lag_seconds": 3300.0,
               "headroom_seconds": 300.0,
               "warning": "unread data ages out in 300s (8% of retention left)"},
              {**part, "partition": 1, "committed": 4800, "lag": 200, "lag_seconds": 20.0,
               "headroom_seconds": 3580.0, "warning": None}],
          "batches": [batch, {**batch, "batch_id": 6, "kind": "scheduled",
                              "status": "committed", "error": None, "rows_written": 48,
                              "quality": {**batch["quality"], "success": True,
                                          "summary": "all expectations met",
                                          "expectations": [{"success": True}] * 2}}],
          "lag_history": [{"batch_id": i, "at": f"2026-01-01T0{i}:00:00+00:00",
                           "lag": 900 * i, "status": "committed"} for i in range(1, 6)]}
    return render_page([st])


def test_page_highlights_warnings_failures_and_quality() -> None:
    """The same template with a retention warning, a failed quality gate and a hostile error
    text (escaped), looked at in the browser too."""
    from playwright.sync_api import sync_playwright

    html = _render_sample()
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)" in html
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_content(html)
            warn = page.locator("tr.partition.warn")
            assert warn.count() == 1 and warn.get_attribute("data-partition") == "0"
            assert "ages out in 300s" in page.locator(".alert.warning").inner_text()
            assert page.locator("tr.batch[data-status=failed] .badge.bad").count() == 1
            assert page.locator("table.quality tr").count() == 3  # header + 2 batches
            assert page.locator("svg.lag-chart circle").count() == 6
            assert page.locator("tr.batch").first.locator("td").nth(9).inner_text() \
                .startswith("1m 30s")
            page.screenshot(path=str(SHOTS / "plugin_render_warnings.png"), full_page=True)
        finally:
            browser.close()


def _stable(st: dict[str, Any]) -> dict[str, Any]:
    """What does not move between two reads (lag in time does)."""
    return {
        "pipeline": st["pipeline"], "total_lag": st["total_lag"],
        "partitions": [{k: p[k] for k in ("topic", "partition", "committed", "earliest",
                                           "latest", "lag", "retention_seconds")}
                       for p in st["partitions"]],
        "batches": [{k: b[k] for k in ("batch_id", "kind", "status", "ranges", "records_read",
                                       "rows_written", "bad_records", "started_at",
                                       "finished_at", "quality")} for b in st["batches"]],
        "lag_history": st["lag_history"],
    }


def test_plugin_page_and_api_show_lag_and_batches_behind_login(
        ui_server: dict[str, Any], pg_dsn: str, kafka_bootstrap: str,
        make_topic: Callable[..., str], spark: Any, unique: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    topic = make_topic("ui", 3)
    produce_plain(kafka_bootstrap, topic, 900, f"ui{unique}", 3)
    name = f"ui_{unique}"
    f = ui_server["pipelines"] / f"{name}.yaml"
    f.write_text(yaml.safe_dump({
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "max_records_per_partition": 100},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": f"ui_{unique}"}}))
    broken = f"broken_{unique}"
    (ui_server["pipelines"] / f"{broken}.yaml").write_text(
        yaml.safe_dump({"name": broken, "source": {"topics": [topic]}}))
    cfg = load_pipeline(f)
    run_cycle(cfg, pg_dsn, spark)
    run_cycle(cfg, pg_dsn, spark)  # 200 of 300 per partition committed: lag 100 each

    expected = pipeline_status(cfg, pg_dsn)
    assert expected["total_lag"] == 300
    cli = json.loads(subprocess.run(
        ["offsetflow", "status", "--pipeline-file", str(f), "--json"], capture_output=True,
        text=True, timeout=120, check=True).stdout)
    assert _stable(cli) == _stable(expected)

    password = ui_server["wait"]()

    # -- anonymous and bogus credentials are refused --------------------------------------
    code, headers, _ = http("GET", "/offsetflow/")
    assert code in (302, 303, 307) and "/auth/login" in headers["location"], (code, headers)
    for path in ("/offsetflow/api/status", f"/offsetflow/api/status/{name}"):
        code, _, body = http("GET", path)
        assert code == 401 and name not in body, (path, code, body)
        assert http("GET", path, token="not-a-jwt")[0] in (401, 403)

    # -- the JSON API (bearer token from Airflow's /auth/token) ---------------------------
    code, _, body = http("POST", "/auth/token", {"username": "admin", "password": password})
    assert code in (200, 201), body
    token = json.loads(body)["access_token"]
    code, _, body = http("GET", "/offsetflow/api/status", token=token)
    assert code == 200, body
    assert pg_dsn not in body
    listed = {p["pipeline"]: p for p in json.loads(body)["pipelines"]}
    assert _stable(listed[name]) == _stable(expected)
    assert broken in listed[broken]["error"] and "kafka" in listed[broken]["error"]
    code, _, body = http("GET", f"/offsetflow/api/status/{name}", token=token)
    assert code == 200 and _stable(json.loads(body)) == _stable(expected)
    assert set(json.loads(body)) == set(cli)  # the same document as `offsetflow status --json`
    code, _, body = http("GET", "/offsetflow/api/status/no_such_pipeline", token=token)
    assert code == 404 and "no pipeline named 'no_such_pipeline'" in body
    code, _, body = http("GET", "/offsetflow/api/status/Not-A-Name", token=token)
    assert code == 404 and "not a pipeline name" in body

    # -- the page, in a browser, through Airflow's login and menu -------------------------
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1600, "height": 1300})
            page = ctx.new_page()
            page.goto(f"{URL}/", timeout=60_000)
            page.wait_for_url("**/auth/login**", timeout=60_000)
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_url(lambda u: "/auth/login" not in u, timeout=60_000)

            page.get_by_role("button", name="Browse").click()
            page.get_by_role("menuitem", name="OffsetFlow").click()
            page.wait_for_url("**/plugin/offsetflow", timeout=60_000)
            frame = page.frame_locator("iframe[title='OffsetFlow']")
            section = frame.locator(f"section[data-pipeline='{name}']")
            expect(section).to_be_visible(timeout=60_000)

            rows = section.locator("tr.partition")
            expect(rows).to_have_count(3)
            got = {(r.get_attribute("data-partition"), r.get_attribute("data-committed"),
                    r.get_attribute("data-lag")) for r in rows.all()}
            assert got == {(str(p), "200", "100") for p in range(3)}, got
            for r in rows.all():
                assert r.locator("td").nth(2).inner_text() == "200"
                assert r.locator("td").nth(5).inner_text() == "100"
            expect(section.locator(".total-lag")).to_have_text("300")
            batches = section.locator("tr.batch")
            expect(batches).to_have_count(2)
            assert {b.get_attribute("data-status") for b in batches.all()} == {"committed"}
            assert {b.get_attribute("data-kind") for b in batches.all()} == {"scheduled"}
            expect(batches.first.locator("td.ranges")).to_contain_text(f"{topic}[0] 100–200")
            chart = section.locator("svg.lag-chart")
            expect(chart).to_be_visible()
            assert chart.get_attribute("data-points") == "3"  # lag at 2 plannings + now
            assert [c.get_attribute("data-lag") for c in chart.locator("circle").all()] == \
                ["900", "600", "300"]
            expect(frame.locator(f"section[data-pipeline='{broken}']")).to_contain_text(
                "kafka")
            assert pg_dsn not in frame.locator("body").inner_html()
            page.screenshot(path=str(SHOTS / "plugin_lag.png"))
            # links inside the (sandboxed) frame keep the session: refresh, recent=1
            frame.locator("a", has_text="refresh").click()
            expect(section.locator("tr.partition")).to_have_count(3, timeout=60_000)
            assert "/auth/login" not in page.url

            # the JSON API with the browser's session (the UI's cookie), and the page itself
            resp = ctx.request.get(f"{URL}/offsetflow/api/status/{name}")
            assert resp.status == 200 and _stable(resp.json()) == _stable(expected)
            direct = ctx.new_page()
            direct.goto(f"{URL}/offsetflow/", timeout=60_000)
            expect(direct.locator(f"section[data-pipeline='{name}']")).to_be_visible()
            direct.screenshot(path=str(SHOTS / "plugin_lag_page.png"), full_page=True)

            anon = browser.new_context()  # a fresh browser: sent to Airflow's login
            anon_page = anon.new_page()
            anon_page.goto(f"{URL}/offsetflow/", timeout=60_000)
            anon_page.wait_for_url("**/auth/login**", timeout=60_000)
            assert name not in anon_page.content()
            anon.close()
        finally:
            browser.close()


# -- Streaming statistics (issue 31 items 1, 2) ------------------------------------------
def _scheduled(at_s_ago: float = 0.2) -> dict[str, Any]:
    """The context an Airflow scheduled run gives its plan task: what `due_time` reads."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    return {"dag_run": SimpleNamespace(
        run_type="scheduled", run_after=None, logical_date=None,
        data_interval_end=datetime.now(UTC) - timedelta(seconds=at_s_ago))}


def test_streaming_statistics_page_charts_every_metric_of_50_batches(
        ui_server: dict[str, Any], pg_dsn: str, kafka_bootstrap: str,
        make_topic: Callable[..., str], spark: Any, unique: str) -> None:
    """50+ real batches (plan task with an Airflow run's due time, Spark run, commit) of one
    pipeline, one of them failing on a bad record and committed on its second attempt, and
    a replay: the page draws a non-empty timeline and histogram per metric, and one batch's
    figures on the page are the ledger's."""
    from confluent_kafka import Producer
    from playwright.sync_api import expect, sync_playwright

    from offsetflow.errors import OffsetFlowError
    from offsetflow.job import run_batch
    from offsetflow.ledger import Ledger
    from offsetflow.orchestration.operators import due_time
    from offsetflow.orchestration.plugin import fmt_seconds
    from offsetflow.orchestration.tasks import plan_task, window_task

    topic = make_topic("stats", 2)
    produce_plain(kafka_bootstrap, topic, 200, f"st{unique}", 2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, b"{not json", partition=0)  # offset 100 of partition 0
    assert p.flush(30) == 0
    produce_plain(kafka_bootstrap, topic, 316, f"st{unique}", 2, start_seq=200)
    name = f"stats_{unique}"
    doc = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "max_records_per_partition": 5},
           "format": {"type": "json", "schema": dict(SCHEMA)},
           "sink": {"connection": pg_dsn, "table": f"stats_{unique}"}, "bad_records": "fail"}
    f = ui_server["pipelines"] / f"{name}.yaml"
    f.write_text(yaml.safe_dump(doc))
    cfg = load_pipeline(f)

    failed = None
    while (bid := plan_task(cfg, "test", due_time(_scheduled()))) is not None:
        try:
            run_batch(spark, cfg, bid, pg_dsn)
        except OffsetFlowError as e:  # the bad record: the batch fails and stays open
            assert failed is None and f"{topic}[0]@100" in str(e), e
            failed = bid
            f.write_text(yaml.safe_dump({**doc, "bad_records": "dead_letter"}))
            cfg = load_pipeline(f)
            run_batch(spark, cfg, bid, pg_dsn, accept_config_change=True)  # 2nd attempt
    assert failed is not None
    manual = {"dag_run": _scheduled()["dag_run"]}
    manual["dag_run"].run_type = "manual"
    manual["dag_run"].run_after = manual["dag_run"].data_interval_end
    window = window_task("replay", {"pipeline": name, "topic": topic, "from_offset": 10,
                                    "until_offset": 20}, "test", load=lambda _: cfg,
                         due=due_time(manual))
    (replay,) = window["batch_ids"]
    run_batch(spark, cfg, replay, pg_dsn)

    with Ledger(pg_dsn) as ledger:
        batches = ledger.recent_batches(name, 200)
        retried = ledger.get_batch(failed)
    assert len(batches) >= 50 and all(b.status == "committed" for b in batches)
    assert retried.attempts == 2 and retried.stats is not None
    assert {b.due_source for b in batches} == {"schedule", "trigger"}
    assert ledger.get_batch(replay).due_source == "trigger"
    s = retried.stats
    assert s["total_delay_s"] == pytest.approx(s["scheduling_delay_s"] + s["processing_s"],
                                               abs=0.002)
    assert s["input_rate"] > 0 and s["processing_rate"] > 0

    password = ui_server["wait"]()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1500, "height": 1200})
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{URL}/offsetflow/stats/{name}", timeout=60_000)
            page.wait_for_url("**/auth/login**", timeout=60_000)
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", password)
            page.click("button[type=submit]")
            page.wait_for_url(f"**/offsetflow/stats/{name}", timeout=60_000)
            expect(page.locator("body[data-charts-ready=true]")).to_have_count(1,
                                                                              timeout=30_000)
            drawn = page.evaluate("""() => [...document.querySelectorAll('canvas')].map(c => {
                const ch = Chart.getChart(c);
                return [c.id, ch.data.datasets[0].data.filter(v => v !== null).length,
                        ch.data.datasets[0].data.reduce((a, v) => a + (v || 0), 0)];
            })""")
            assert not errors, errors
            assert len(drawn) == 10, drawn  # 5 metrics x (timeline, histogram)
            counts = {cid: (n, total) for cid, n, total in drawn}
            for cid, (n, total) in counts.items():
                assert n > 0 and total > 0, (cid, n, total)
            # a histogram counts the batches its timeline shows
            for m in ("input_rate", "scheduling_delay_s", "processing_s", "total_delay_s",
                      "processing_rate"):
                assert counts[f"histogram-{m}"][1] == counts[f"timeline-{m}"][0], m
            assert counts["timeline-processing_s"][0] == len(batches)
            assert counts["timeline-input_rate"][0] == len(batches) - 2  # first, replay

            # one batch: the page's figures are the ledger's
            row = page.locator(f"tr.batch[data-batch-id='{failed}']")
            expect(row).to_have_count(1)
            assert row.get_attribute("data-attempts") == "2"
            for key, cell in (("scheduling_delay_s", "scheduling-delay"),
                              ("processing_s", "processing"),
                              ("total_delay_s", "total-delay")):
                assert float(row.get_attribute(f"data-{key.replace('_', '-')}")) == s[key]
                assert row.locator(f"td.{cell}").inner_text() == fmt_seconds(s[key])
            assert row.locator("td.records").inner_text() == f"{retried.records_read:,}"
            assert float(row.get_attribute("data-input-rate")) == s["input_rate"]
            assert row.locator(".split .read").count() == 1
            expect(page.locator(f"tr.window[data-batch-id='{replay}']")).to_contain_text(
                "replay")
            expect(page.locator(f"tr.window[data-batch-id='{failed}']")).to_contain_text(
                "2 attempts")
            expect(page.locator("table.partitions tr.partition")).to_have_count(2)
            assert pg_dsn not in page.content()
            page.screenshot(path=str(SHOTS / "stream_stats.png"), full_page=True)

            # inside Airflow's UI: Browse > OffsetFlow, then the pipeline's statistics link
            page.goto(f"{URL}/plugin/offsetflow", timeout=60_000)
            frame = page.frame_locator("iframe[title='OffsetFlow']")
            frame.locator(f"section[data-pipeline='{name}'] a.stats-link").click()
            expect(frame.locator("body[data-charts-ready=true]")).to_have_count(
                1, timeout=60_000)
            page.screenshot(path=str(SHOTS / "stream_stats_in_airflow.png"))
        finally:
            browser.close()
