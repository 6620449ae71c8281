"""The events of a published audit (issue 33 item 4): its rows become live at publish, not
when its batches were staged into the shadow, so the target table's Airflow Asset event and
the OpenLineage event of the window are sent then.

One Asset event per published audit, on the target's URI (`assets.target_uris`) with
`assets.batch_extra`'s shape for the whole window (`batch_id` is the audit id, `ranges` the
window, the counts summed) plus `audit_id`, `published_rows` and `batches` (each batch's own
`batch_extra`). Only the publish that changed something emits: a rerun of a published audit
returns `changed: False` and sends nothing.

Best effort: the publish has committed before any event is sent; a failure to send one is
returned as a message for the caller to report, never raised (the data is not rolled back).
"""

from __future__ import annotations

import logging
import os
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import Any

from offsetflow.config import PipelineConfig
from offsetflow.orchestration import assets
from offsetflow.orchestration.lineage import (
    BATCH_FACET,
    batch_run_facet,
    openlineage_dataset,
    openlineage_output,
    pipeline_datasets,
)

log = logging.getLogger(__name__)

JOB_SUFFIX = "audit_publish"  # OpenLineage job offsetflow_<pipeline>.audit_publish


def audit_extra(cfg: PipelineConfig, published: Mapping[str, Any]) -> dict[str, Any]:
    """The Asset event's extra of a published audit (`published`: what `publish_audit`
    returns when it changed something)."""
    figs = list(published.get("batches", []))

    def total(key: str) -> int:
        return sum(int(f.get(key) or 0) for f in figs)

    window = {"batch_id": published["audit_id"], "kind": published.get("kind"),
              "rows_written": total("rows_written"), "records_read": total("records_read"),
              "bad_records": total("bad_records"), "target_table": published["target_table"],
              "ranges": list(published.get("window", []))}
    return {**assets.batch_extra(cfg, window), "audit_id": published["audit_id"],
            "published_rows": published.get("rows"),
            "batches": [assets.batch_extra(cfg, f) for f in figs]}


def target_uri(cfg: PipelineConfig, published: Mapping[str, Any]) -> str:
    return assets.target_uris(cfg, published["target_table"])


def emit_in_airflow(cfg: PipelineConfig, published: Mapping[str, Any]) -> str:
    """Inside an Airflow process with its metadata database (the API server: the plugin's
    Publish button): the event through Airflow's asset manager, as `POST
    /api/v2/assets/events` does; the asset is created when Airflow does not know it yet
    (no publish task has emitted for this table). Returns what happened."""
    from airflow.assets.manager import asset_manager
    from airflow.models.asset import AssetActive, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    uri = target_uri(cfg, published)
    extra = audit_extra(cfg, published)
    with create_session() as session:
        model = session.scalar(select(AssetModel).where(AssetModel.uri == uri,
                                                        AssetModel.name == uri).limit(1))
        if model is None:  # as the scheduler would: known and active (listed by the API)
            model = AssetModel(name=uri, uri=uri)
            session.add(model)
            session.add(AssetActive.for_asset(model))
            session.flush()
        event = asset_manager.register_asset_change(
            asset=model, extra=extra,
            source_is_api=True, api_user_teams=set(), session=session)
        if event is None:
            raise RuntimeError(f"Airflow's asset manager recorded no event for {uri}")
        event_id = event.id
    return f"asset event {event_id} on {uri}"


def emit_via_api(api: Any, cfg: PipelineConfig, published: Mapping[str, Any]) -> str:
    """Through Airflow's REST API (`api`: `cli.airflow_api.AirflowApi`): the asset looked up
    by URI, then `POST /api/v2/assets/events`. The REST API cannot create an asset: one
    Airflow does not know yet is an error naming it."""
    uri = target_uri(cfg, published)
    found = api.call("GET", "/api/v2/assets?limit=100&only_active=false&uri_pattern="
                     + urllib.parse.quote(uri, safe=""))
    ids = [a["id"] for a in (found or {}).get("assets", []) if a.get("uri") == uri]
    if not ids:
        raise LookupError(f"Airflow knows no asset {uri} yet (no DAG run has emitted one for "
                          f"this table); publish from the Airflow UI's audit page, which "
                          f"creates it, or let a publish task emit it first")
    event = api.call("POST", "/api/v2/assets/events",
                     {"asset_id": ids[0], "extra": audit_extra(cfg, published)})
    return f"asset event {(event or {}).get('id')} on {uri}"


def openlineage_configured() -> bool:
    """An OpenLineage transport is set (Airflow's [openlineage] section, or the client's
    own OPENLINEAGE_URL / OPENLINEAGE_CONFIG) and OpenLineage is not disabled."""
    try:
        from airflow.providers.openlineage import conf as ol_conf
    except ImportError:
        return False
    if ol_conf.is_disabled():
        return False
    return bool(ol_conf.transport() or ol_conf.config_path() or ol_conf.config_conn_id()
                or os.environ.get("OPENLINEAGE_URL") or os.environ.get("OPENLINEAGE_CONFIG"))


def publish_lineage_event(cfg: PipelineConfig, published: Mapping[str, Any]) -> Any:
    """The OpenLineage COMPLETE event of a publish: the window's topics in, the live target
    out with the rows published, the `offsetflow_batch` run facet."""
    from datetime import UTC, datetime

    from airflow.providers.openlineage import conf as ol_conf
    from openlineage.client.event_v2 import Job, Run, RunEvent, RunState

    topics = sorted({r["topic"] for r in published.get("window", [])})
    inputs, outputs = pipeline_datasets(cfg, topics or None, published["target_table"])
    schema = dict(cfg.schema) if cfg.schema else None
    batches = [{**dict(f), "status": "published", "audit_id": published["audit_id"]}
               for f in published.get("batches", [])]
    return RunEvent(
        eventType=RunState.COMPLETE, eventTime=datetime.now(UTC).isoformat(),
        run=Run(runId=str(uuid.uuid4()),
                facets={BATCH_FACET: batch_run_facet(cfg.name, batches)}),
        job=Job(namespace=ol_conf.namespace(), name=f"offsetflow_{cfg.name}.{JOB_SUFFIX}"),
        inputs=[openlineage_dataset(d.namespace, d.name, schema) for d in inputs],
        outputs=[openlineage_output(d.namespace, d.name, published.get("rows"))
                 for d in outputs])


def emit_openlineage(cfg: PipelineConfig, published: Mapping[str, Any]) -> str | None:
    """The publish's OpenLineage event, when a transport is configured (None otherwise)."""
    if not openlineage_configured():
        return None
    from airflow.providers.openlineage.plugins.adapter import OpenLineageAdapter

    OpenLineageAdapter().get_or_create_openlineage_client().emit(
        publish_lineage_event(cfg, published))
    return "OpenLineage event sent"


def report_publish(cfg: PipelineConfig, published: Mapping[str, Any], api: Any = None,
                   no_asset: str | None = None) -> list[str]:
    """After a publish that changed something: the Asset event (in-process, or through
    `api` when given; not at all with `no_asset`, the reason) and the OpenLineage event.
    Never raises: the data is published already; each failure is a message (logged as a
    warning and returned, with "not sent" in it)."""
    if not published.get("changed"):
        return []

    def asset_event() -> str:
        if no_asset is not None:
            raise RuntimeError(no_asset)
        return (emit_via_api(api, cfg, published) if api is not None
                else emit_in_airflow(cfg, published))

    notes: list[str] = []
    for what, send in (("Airflow asset event", asset_event),
                       ("OpenLineage event", lambda: emit_openlineage(cfg, published))):
        try:
            done = send()
            if done:
                notes.append(done)
        except Exception as e:  # noqa: BLE001 - best effort, after the commit
            msg = (f"audit {published['audit_id']} is published (committed), but its {what} "
                   f"was not sent: {e}")
            log.warning("%s", msg)
            notes.append(msg)
    return notes
