"""OffsetFlow's lag and batch view inside Airflow 3 (an Airflow plugin).

A FastAPI app mounted by Airflow's API server under ``/offsetflow``:

- ``GET /offsetflow/``                     the page (server-rendered HTML, inline SVG chart)
- ``GET /offsetflow/api/status``           every pipeline, as JSON
- ``GET /offsetflow/api/status/{pipeline}`` one pipeline: the same dict as
  ``offsetflow status --json``
- ``GET /offsetflow/stats/{pipeline}``     "Streaming statistics" of one pipeline: batch
  timings over time and as histograms, drawn with the vendored Chart.js (``static/``)
- ``GET /offsetflow/api/stats/{pipeline}`` what that page draws, as JSON
- ``GET /offsetflow/audit/{pipeline}/{id}``  an audited window: its diff, sample rows, quality
  result, and (for the DAG's editors) publish and discard buttons, which post to
  ``/offsetflow/audit/{pipeline}/{id}/publish|discard`` (same-origin form posts only)

and an external view ("Browse > OffsetFlow") that shows the page inside Airflow's UI.

Every route (except the menu icon) is behind Airflow's own login: the caller is resolved
with Airflow's ``get_user`` (the ``Authorization: Bearer`` token the REST API uses, or the
``_token`` cookie the UI sets), and a pipeline is only shown to a user allowed to read its
DAG (``offsetflow_<name>``) by the configured auth manager. An anonymous request for the
page is redirected to Airflow's login; one for the API gets 401.

Airflow loads this through ``plugins/offsetflow_airflow_plugin.py``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from airflow.plugins_manager import AirflowPlugin
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, FileSystemLoader
from starlette.concurrency import run_in_threadpool

from offsetflow.config import NAME_RE, PipelineConfig, load_pipeline, pipelines_dir, redact_dsn
from offsetflow.errors import ConfigError
from offsetflow.orchestration.connections import resolve
from offsetflow.orchestration.stream_stats import chart_data, stats_view

URL_PREFIX = "/offsetflow"
MAX_RECENT = 100
MAX_STATS = 1000  # batches the statistics page may cover
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    # shown in an iframe of Airflow's own UI only; no scripts, no external resources
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "img-src 'self' data:; frame-ancestors 'self'",
}

# the statistics page runs two scripts of this plugin (Chart.js and its own), nothing inline
STATS_HEADERS = {**SECURITY_HEADERS,
                 "Content-Security-Policy": "default-src 'none'; script-src 'self'; "
                                            "style-src 'unsafe-inline'; img-src 'self' data:; "
                                            "frame-ancestors 'self'"}
STATIC = Path(__file__).resolve().parent / "static"
SCRIPTS = ("chart.umd.min.js", "stream_stats.js")


# -- data -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineEntry:
    """One YAML file of the pipelines folder: its config, or why it cannot be loaded."""

    name: str
    source: str
    cfg: PipelineConfig | None
    error: str | None


def load_entries(directory: Path | None = None) -> list[PipelineEntry]:
    """Every pipeline config of the folder; a broken one becomes an error entry (named by its
    file) instead of hiding the others."""
    d = directory or pipelines_dir()
    entries: list[PipelineEntry] = []
    if not d.is_dir():
        return entries
    for f in sorted(d.glob("*.y*ml")):
        try:
            # the same Airflow connections the pipeline's tasks use (sink.conn_id, ...)
            cfg = resolve(load_pipeline(f))
        except ConfigError as e:
            entries.append(PipelineEntry(f.stem, f.name, None, str(e)))
        except Exception as e:  # noqa: BLE001 - anything else in a config is shown, not raised
            entries.append(PipelineEntry(f.stem, f.name, None,
                                         f"{f}: cannot load: {type(e).__name__}: {e}"))
        else:
            entries.append(PipelineEntry(cfg.name, f.name, cfg, None))
    return entries


def _clean(text: str | None, cfg: PipelineConfig | None) -> str | None:
    """Error texts may quote a connection string: never show its password."""
    if text is None:
        return None
    if cfg is not None and cfg.sink.connection:
        text = text.replace(cfg.sink.connection, redact_dsn(cfg.sink.connection))
    return redact_dsn(text)


def entry_status(entry: PipelineEntry, recent: int = 10) -> dict[str, Any]:
    """`offsetflow status --json` of one pipeline, or an error row {pipeline, source, error}."""
    from offsetflow.ops import pipeline_status

    if entry.cfg is None:
        return {"pipeline": entry.name, "source": entry.source, "error": entry.error}
    try:
        st = pipeline_status(entry.cfg, entry.cfg.sink.connection, recent=recent)
    except Exception as e:  # noqa: BLE001 - e.g. the ledger database is down: an error row
        return {"pipeline": entry.name, "source": entry.source,
                "error": _clean(f"{type(e).__name__}: {e}", entry.cfg)}
    st["kafka_error"] = _clean(st.get("kafka_error"), entry.cfg)
    for b in st.get("batches", []):
        b["error"] = _clean(b.get("error"), entry.cfg)
    # exactly what the CLI prints (`json.dumps(st, default=str)`)
    result: dict[str, Any] = json.loads(json.dumps(st, default=str))
    return result


# -- authentication and authorization (Airflow's own) ----------------------------------
async def authenticate(request: Request) -> Any:
    """The Airflow user of this request, exactly as Airflow's REST API resolves it (bearer
    token first, else the UI's `_token` cookie); HTTPException 401/403 otherwise."""
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi.security import HTTPAuthorizationCredentials

    creds = None
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        creds = HTTPAuthorizationCredentials(scheme="Bearer", credentials=token.strip())
    return await get_user(request, _oauth_token=None, bearer_credentials=creds)


def can_read(user: Any, pipeline: str) -> bool:
    """A pipeline is visible to whoever may read its DAG."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    return bool(get_auth_manager().is_authorized_dag(
        method="GET", details=DagDetails(id=f"offsetflow_{pipeline}"), user=user))


def can_edit(user: Any, pipeline: str) -> bool:
    """Publishing or discarding an audited window is for whoever may edit its DAG."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    return bool(get_auth_manager().is_authorized_dag(
        method="PUT", details=DagDetails(id=f"offsetflow_{pipeline}"), user=user))


def _visible(user: Any) -> list[PipelineEntry]:
    return [e for e in load_entries() if can_read(user, e.name)]


def _all_statuses(user: Any, recent: int) -> list[dict[str, Any]]:
    return [entry_status(e, recent) for e in _visible(user)]


def _one_status(user: Any, pipeline: str, recent: int) -> dict[str, Any]:
    if not NAME_RE.match(pipeline):
        raise HTTPException(404, f"{pipeline!r} is not a pipeline name "
                                 f"(names match {NAME_RE.pattern})")
    entry = next((e for e in load_entries() if e.name == pipeline), None)
    if entry is None:
        raise HTTPException(404, f"no pipeline named {pipeline!r}")
    if not can_read(user, pipeline):
        raise HTTPException(403, f"not allowed to read DAG offsetflow_{pipeline}")
    return entry_status(entry, recent)


def _login_redirect(request: Request) -> RedirectResponse:
    from airflow.api_fastapi.app import get_auth_manager

    return RedirectResponse(get_auth_manager().get_url_login(next_url=str(request.url)),
                            status_code=302)


def _base_path() -> str:
    """Path of Airflow's [api] base_url (empty when Airflow is served at the root)."""
    try:
        from airflow.configuration import conf

        base = conf.get("api", "base_url", fallback="") or ""
    except Exception:  # noqa: BLE001
        base = ""
    return urlparse(base).path.rstrip("/")


# -- presentation ------------------------------------------------------------------------
def _parse_time(v: Any) -> datetime | None:
    if not v:
        return None
    try:
        t = datetime.fromisoformat(str(v))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def fmt_time(v: Any) -> str:
    t = _parse_time(v)
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def fmt_seconds(s: Any) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m {sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h:02d}h"


def fmt_int(v: Any) -> str:
    return "-" if v is None else f"{int(v):,}"


def duration(batch: dict[str, Any], now: datetime) -> str:
    start, end = _parse_time(batch.get("started_at")), _parse_time(batch.get("finished_at"))
    if start is None:
        return "-"
    if end is None:
        return f"{fmt_seconds((now - start).total_seconds())} so far"
    return fmt_seconds((end - start).total_seconds())


def timings_text(t: Any) -> str:
    if not isinstance(t, dict):
        return ""
    names = {"prepare_s": "prepare", "read_stage_s": "read+stage", "quality_s": "quality",
             "commit_s": "commit"}
    return " · ".join(f"{label} {fmt_seconds(t[k])}" for k, label in names.items()
                      if isinstance(t.get(k), int | float))


def quality_view(q: Any) -> dict[str, Any] | None:
    if not isinstance(q, dict):
        return None
    exps = q.get("expectations") or []
    passed = sum(1 for e in exps if e.get("success"))
    return {"suite": q.get("suite"), "success": bool(q.get("success")),
            "passed": passed, "total": len(exps), "summary": q.get("summary") or "",
            "policy": q.get("policy"), "routed_rows": q.get("routed_rows")}


def ranges_view(ranges: list[dict[str, Any]], limit: int = 6) -> dict[str, Any]:
    items = [f"{r['topic']}[{r['partition']}] {r['from_offset']:,}–{r['until_offset']:,}"
             for r in ranges]
    return {"items": items[:limit], "more": max(0, len(items) - limit),
            "offsets": sum(r["until_offset"] - r["from_offset"] for r in ranges)}


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def lag_chart(history: list[dict[str, Any]], current: int | None, now: datetime,
              width: int = 640, height: int = 220) -> dict[str, Any]:
    """Geometry of the lag-over-time chart (SVG drawn by the template): the lag seen when
    each scheduled batch was planned, oldest first, one step per planning (a pause of days
    does not squash the history), then the lag right now (dashed)."""
    pts: list[dict[str, Any]] = []
    for h in history:
        if h.get("lag") is None:
            continue
        pts.append({"at": fmt_time(h.get("at")), "lag": int(h["lag"]),
                    "status": h.get("status") or "",
                    "label": f"batch #{h.get('batch_id')} planned {fmt_time(h.get('at'))} UTC: "
                             f"lag {int(h['lag']):,} ({h.get('status')})"})
    if current is not None:
        pts.append({"at": "now", "lag": int(current), "status": "now",
                    "label": f"now ({fmt_time(now.isoformat())} UTC): lag {int(current):,}"})
    left, right, top, bottom = 64, 24, 14, 36
    pw, ph = width - left - right, height - top - bottom
    ymax = _nice_max(max((p["lag"] for p in pts), default=0))
    for i, p in enumerate(pts):
        frac = i / (len(pts) - 1) if len(pts) > 1 else 0.5
        p["x"] = round(left + frac * pw, 1)
        p["y"] = round(top + ph - (p["lag"] / ymax) * ph, 1)
    hist = [p for p in pts if p["status"] != "now"]
    xlabels = []
    if hist:
        xlabels.append({"x": hist[0]["x"], "label": hist[0]["at"],
                        "anchor": "start" if len(pts) > 1 else "middle"})
    if len(hist) > 1:
        xlabels.append({"x": hist[-1]["x"], "label": hist[-1]["at"], "anchor": "end"})
    return {
        "width": width, "height": height, "left": left, "right": width - right,
        "top": top, "bottom": top + ph, "points": pts,
        "ticks": [{"y": round(top + ph - f * ph, 1), "label": fmt_int(ymax * f)}
                  for f in (0, 0.25, 0.5, 0.75, 1)],
        "line": " ".join(f"{p['x']},{p['y']}" for p in hist),
        "now_line": (f"{pts[-2]['x']},{pts[-2]['y']} {pts[-1]['x']},{pts[-1]['y']}"
                     if len(pts) > 1 and pts[-1]["status"] == "now" and hist else ""),
        "xlabels": xlabels,
    }


def page_context(statuses: list[dict[str, Any]], recent: int, now: datetime) -> dict[str, Any]:
    from offsetflow.ops import schema_summary

    views = []
    for st in statuses:
        if st.get("error"):
            views.append({"error": True, **st})
            continue
        batches = [{**b, "duration": duration(b, now), "timings_text": timings_text(
            b.get("timings")), "quality_view": quality_view(b.get("quality")),
            "ranges_view": ranges_view(b.get("ranges") or []),
            "schemas_text": schema_summary(b["schemas"], b.get("schema_versions"))
            if b.get("schemas") else "",
            "planned": fmt_time(b.get("planned_at")), "finished": fmt_time(b.get("finished_at"))}
            for b in st.get("batches", [])]
        current = None if st.get("kafka_error") else st.get("total_lag")
        views.append({**st, "error": False, "batches_view": batches,
                      "chart": lag_chart(st.get("lag_history") or [], current, now)})
    return {"pipelines": views, "recent": recent, "now": fmt_time(now.isoformat()),
            "prefix": _base_path() + URL_PREFIX,
            "f": {"int": fmt_int, "sec": fmt_seconds, "time": fmt_time}}



def render_stats(status: dict[str, Any], recent: int, now: datetime | None = None) -> str:
    """The "Streaming statistics" page of one pipeline (`offsetflow.orchestration.stream_stats`)."""
    view = stats_view(status)
    moment = now or datetime.now(UTC)
    return _env.get_template("offsetflow_stats.html").render(
        v=view, charts=chart_data(view), recent=recent, now=fmt_time(moment.isoformat()),
        prefix=_base_path() + URL_PREFIX,
        f={"int": fmt_int, "sec": fmt_seconds, "time": fmt_time, "rate": fmt_rate})


def fmt_rate(v: Any) -> str:
    if v is None:
        return "-"
    v = float(v)
    return f"{v:,.0f}/s" if v >= 100 else f"{v:.3g}/s"


TEMPLATES = Path(__file__).resolve().parent / "templates"
_env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=True,
                   lstrip_blocks=True)


def render_page(statuses: list[dict[str, Any]], recent: int = 10,
                now: datetime | None = None) -> str:
    template = _env.get_template("offsetflow_status.html")
    return template.render(**page_context(statuses, recent, now or datetime.now(UTC)))


# -- audit before publish (offsetflow.ops.audit) ------------------------------------------
def _audit_entry(user: Any, pipeline: str) -> PipelineEntry:
    if not NAME_RE.match(pipeline):
        raise HTTPException(404, f"{pipeline!r} is not a pipeline name")
    entry = next((e for e in load_entries() if e.name == pipeline), None)
    if entry is None or entry.cfg is None:
        raise HTTPException(404, f"no loadable pipeline named {pipeline!r}")
    if not can_read(user, pipeline):
        raise HTTPException(403, f"not allowed to read DAG offsetflow_{pipeline}")
    return entry


def _user_name(user: Any) -> str:
    get_name = getattr(user, "get_name", None)
    return f"airflow:{get_name() if callable(get_name) else 'user'}"


def audit_page(user: Any, pipeline: str, audit_id: int, action: str | None = None
               ) -> tuple[int, str]:
    """The audit page (the diff is made on the first view, as `offsetflow audit show`),
    after `action` (publish, discard) when given: (HTTP status, HTML)."""
    from offsetflow.errors import OffsetFlowError
    from offsetflow.ops import discard_audit, publish_audit, show_audit

    entry = _audit_entry(user, pipeline)
    cfg = entry.cfg
    assert cfg is not None
    by = _user_name(user)
    message, error, status = None, False, 200
    try:
        if action is not None:
            if not can_edit(user, pipeline):
                raise HTTPException(403, f"not allowed to edit DAG offsetflow_{pipeline}")
            act = publish_audit if action == "publish" else discard_audit
            res = act(cfg, cfg.sink.connection, audit_id, by=by, reason="Airflow UI")
            message = (f"audit {audit_id} {res['status']}" if res["changed"]
                       else f"audit {audit_id} was {res['status']} already")
            if action == "publish":  # its rows are live now: the Asset and lineage events
                from offsetflow.orchestration.audit_events import report_publish

                failed = [n for n in report_publish(cfg, res) if "not sent" in n]
                if failed:
                    message += " (" + "; ".join(_clean(n, cfg) or "" for n in failed) + ")"
        out = show_audit(cfg, cfg.sink.connection, audit_id, by=by)
    except OffsetFlowError as e:
        message, error, status = _clean(str(e), cfg), True, 409
        try:
            out = show_audit(cfg, cfg.sink.connection, audit_id, by=by)
        except OffsetFlowError as again:
            raise HTTPException(404, _clean(str(again), cfg)) from again
    if out["pipeline"] != pipeline:
        raise HTTPException(404, f"audit {audit_id} is not of pipeline {pipeline}")
    html = _env.get_template("offsetflow_audit.html").render(
        a=out, diff=out.get("diff"), message=message, error=error,
        can_edit=can_edit(user, pipeline), prefix=_base_path() + URL_PREFIX)
    return status, html


def same_origin(request: Request) -> bool:
    """A form post from this server's own pages (the session cookie would let any other
    site's form post here too)."""
    origin = request.headers.get("origin") or request.headers.get("referer") or ""
    return bool(origin) and urlparse(origin).netloc == request.url.netloc


# -- the FastAPI app ---------------------------------------------------------------------
ICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" fill="none" '
        'stroke="#017cee" stroke-width="2" stroke-linecap="round" stroke-linejoin="round">'
        '<path d="M3 3v18h18"/><path d="M7 15l4-4 3 3 5-6"/></svg>')


def create_app() -> FastAPI:
    app = FastAPI(title="OffsetFlow lag and batches", docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.get("/", response_class=HTMLResponse)
    async def page(request: Request,
                   recent: int = Query(10, ge=1, le=MAX_RECENT)) -> Response:
        try:
            user = await authenticate(request)
        except HTTPException as e:
            if e.status_code in (401, 403):  # not logged in, or an expired/invalid token
                return _login_redirect(request)
            raise
        statuses = await run_in_threadpool(_all_statuses, user, recent)
        html = await run_in_threadpool(render_page, statuses, recent)
        return HTMLResponse(html, headers=SECURITY_HEADERS)

    @app.get("/api/status")
    async def api_status(request: Request,
                         recent: int = Query(10, ge=1, le=MAX_RECENT)) -> JSONResponse:
        user = await authenticate(request)
        statuses = await run_in_threadpool(_all_statuses, user, recent)
        return JSONResponse({"generated_at": datetime.now(UTC).isoformat(),
                             "pipelines": statuses}, headers=SECURITY_HEADERS)

    @app.get("/api/status/{pipeline}")
    async def api_pipeline_status(request: Request, pipeline: str,
                                  recent: int = Query(10, ge=1, le=MAX_RECENT)
                                  ) -> JSONResponse:
        user = await authenticate(request)
        st = await run_in_threadpool(_one_status, user, pipeline, recent)
        return JSONResponse(st, headers=SECURITY_HEADERS)

    @app.get("/stats/{pipeline}", response_class=HTMLResponse)
    async def stats_page(request: Request, pipeline: str,
                         recent: int = Query(100, ge=1, le=MAX_STATS)) -> Response:
        try:
            user = await authenticate(request)
        except HTTPException as e:
            if e.status_code in (401, 403):
                return _login_redirect(request)
            raise
        st = await run_in_threadpool(_one_status, user, pipeline, recent)
        if st.get("error"):
            raise HTTPException(503, f"pipeline {pipeline}: {st['error']}")
        html = await run_in_threadpool(render_stats, st, recent)
        return HTMLResponse(html, headers=STATS_HEADERS)

    @app.get("/api/stats/{pipeline}")
    async def api_stats(request: Request, pipeline: str,
                        recent: int = Query(100, ge=1, le=MAX_STATS)) -> JSONResponse:
        user = await authenticate(request)
        st = await run_in_threadpool(_one_status, user, pipeline, recent)
        if st.get("error"):
            raise HTTPException(503, f"pipeline {pipeline}: {st['error']}")
        view = stats_view(st)
        return JSONResponse(json.loads(json.dumps({**view, "charts": chart_data(view)},
                                                  default=str)), headers=SECURITY_HEADERS)

    @app.get("/audit/{pipeline}/{audit_id}", response_class=HTMLResponse)
    async def audit(request: Request, pipeline: str, audit_id: int) -> Response:
        try:
            user = await authenticate(request)
        except HTTPException as e:
            if e.status_code in (401, 403):
                return _login_redirect(request)
            raise
        status, html = await run_in_threadpool(audit_page, user, pipeline, audit_id)
        return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)

    @app.post("/audit/{pipeline}/{audit_id}/{action}", response_class=HTMLResponse)
    async def audit_action(request: Request, pipeline: str, audit_id: int,
                           action: str) -> Response:
        user = await authenticate(request)
        if action not in ("publish", "discard"):
            raise HTTPException(404, f"no action {action!r} (publish or discard)")
        if not same_origin(request):
            raise HTTPException(403, "cross-site form post refused")
        status, html = await run_in_threadpool(audit_page, user, pipeline, audit_id, action)
        return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)

    @app.get("/static/icon.svg", include_in_schema=False)
    async def icon() -> Response:  # the menu icon only: no data, no login needed
        return Response(ICON, media_type="image/svg+xml",
                        headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/static/{name}", include_in_schema=False)
    async def script(name: str) -> Response:  # code only: no data, no login needed
        if name not in SCRIPTS:
            raise HTTPException(404, "no such file")
        return Response((STATIC / name).read_bytes(), media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=3600",
                                 "X-Content-Type-Options": "nosniff"})

    return app


app = create_app()


class OffsetFlowPlugin(AirflowPlugin):
    """Lag and batch view: a page and a JSON API under /offsetflow, in Airflow's Browse menu."""

    name = "offsetflow"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "OffsetFlow lag and batches"}]
    external_views = [{
        "name": "OffsetFlow",
        "href": f"{_base_path()}{URL_PREFIX}/",
        "url_route": "offsetflow",
        "destination": "nav",
        "category": "browse",
        "icon": f"{_base_path()}{URL_PREFIX}/static/icon.svg",
    }]


# Airflow's plugins-folder walk also executes every .py file below the plugins folder under
# its bare file name (this one as module "plugin"). Only the package module registers the
# plugin (via plugins/offsetflow_airflow_plugin.py), so that second copy must not expose a
# second OffsetFlowPlugin ("Plugin 'offsetflow' already registered").
if __name__ != "offsetflow.orchestration.plugin":
    del OffsetFlowPlugin
