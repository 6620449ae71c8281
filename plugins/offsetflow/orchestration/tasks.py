"""What the Airflow tasks do, as plain functions (no Airflow import): easy to test and reuse.

Every function logs what it decided and returns JSON-able values for XCom. DSNs come from
the environment/pipeline config or Airflow connections and are never logged or returned.
`pipeline` is a name (loaded from the pipelines folder) or an already resolved
PipelineConfig (the operators pass one: inline configs, connections resolved in the task).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from offsetflow.config import PipelineConfig, find_pipeline, redact_dsn
from offsetflow.errors import BatchStateError, ConfigError, RequestError
from offsetflow.ledger import Due, Ledger
from offsetflow.ops import kafka_for, plan_only, plan_window, submit_window
from offsetflow.plan import parse_request

log = logging.getLogger(__name__)

Loader = Callable[[str], PipelineConfig]
T = TypeVar("T")


def _config(pipeline: str | PipelineConfig, load: Loader | None = None) -> PipelineConfig:
    if isinstance(pipeline, PipelineConfig):
        return pipeline
    return (load or find_pipeline)(pipeline)


def plan_task(pipeline: str | PipelineConfig, started_by: str,
              due: Due | None = None) -> int | None:
    """`due`: when the DAG run was due (`offsetflow.orchestration.operators.due_time`)."""
    from offsetflow.orchestration.observe import report_plan

    cfg = _config(pipeline)
    pipeline = cfg.name
    try:
        out = plan_only(cfg, cfg.sink.connection, started_by=started_by, due=due)
    except Exception:
        report_plan(cfg, None)  # the lag, also while planning fails
        raise
    report_plan(cfg, out)
    if out.batch is None:
        log.info("pipeline %s: nothing new to read; the Spark job is skipped", pipeline)
        return None
    b = out.batch
    log.info("pipeline %s: batch %d (%s) with %d ranges, %d offsets:", pipeline, b.batch_id,
             "re-used: deterministic re-run" if out.reused else "new", len(b.ranges),
             b.offset_span)
    for r in b.ranges:
        log.info("  %s", r)
    return b.batch_id


def connect_run_task(pipeline: str | PipelineConfig, batch_ids: list[int] | int) -> list[str]:
    """`spark.launch: connect`: run the batches from this task on the warm Spark Connect
    server (no spark-submit, no JVM start). Same code and commit as the spark-submit job."""
    from offsetflow.job import build_spark, drop_session, run_batch

    cfg = _config(pipeline)
    ids = [batch_ids] if isinstance(batch_ids, int) else [int(b) for b in batch_ids]
    spark = build_spark(cfg, f"offsetflow-{cfg.name}-{ids[0]}")
    messages = []
    try:
        for bid in ids:  # in order: window batches are consecutive
            rep = run_batch(spark, cfg, bid, cfg.sink.connection)
            log.info("%s; timings %s", rep.result.message, json.dumps(rep.timings))
            messages.append(rep.result.message)
    finally:
        drop_session(spark)  # the server keeps the pipeline's session for its next run
    return messages


def observed_run(cfg: PipelineConfig, batch_ids: list[int], run: Callable[[], T]) -> T:
    """A run of batches, for monitoring: retries counted before it, failed batches and the
    lag after a failure (the error itself is raised unchanged)."""
    from offsetflow.orchestration.observe import report_run_failure, report_run_start

    report_run_start(cfg, batch_ids)
    try:
        return run()
    except Exception:
        report_run_failure(cfg, batch_ids)
        raise


def publish_task(pipeline: str | PipelineConfig,
                 batch_ids: list[int] | int | None) -> dict[str, Any]:
    """Check the batches committed and log their figures (the DAG run fails otherwise).
    The one place a batch is published: the operator turns the figures (with ranges and
    target table) into Asset events."""
    cfg = _config(pipeline)
    pipeline = cfg.name
    ids = [batch_ids] if isinstance(batch_ids, int) else list(batch_ids or [])
    out: dict[str, Any] = {"pipeline": pipeline, "batches": []}
    with Ledger(cfg.sink.connection) as ledger:
        for bid in ids:
            b = ledger.get_batch(int(bid))
            if b.pipeline != pipeline:  # ids from another pipeline's XCom: never publish them
                raise BatchStateError(f"batch {b.batch_id} belongs to pipeline {b.pipeline}, "
                                      f"not {pipeline}")
            fig = {"batch_id": b.batch_id, "kind": b.kind, "status": b.status,
                   "records_read": b.records_read, "rows_written": b.rows_written,
                   "bad_records": b.bad_records, "offsets": b.offset_span,
                   "timings": b.timings, "error": b.error, "target_table": b.target_table,
                   "audit_id": b.audit_id,
                   "duration_s": (b.finished_at - b.started_at).total_seconds()
                   if b.finished_at and b.started_at else None,
                   "ranges": [{"topic": r.topic, "partition": r.partition,
                               "from_offset": r.from_offset, "until_offset": r.until_offset}
                              for r in b.ranges]}
            log.info("batch %d %s: %s", b.batch_id, b.status, json.dumps(fig, default=str))
            out["batches"].append(fig)
            if b.status != "committed":
                raise BatchStateError(f"batch {b.batch_id} is {b.status}, not committed: "
                                      f"{b.error or 'see the Spark task log'}")
        out["positions"] = {f"{t}/{p}": o for (t, p), o in
                            sorted(ledger.positions(pipeline).items())}
    _publish_consumer_group(cfg, out["positions"])
    from offsetflow.orchestration.observe import report_published  # lineage and stats

    report_published(cfg, out)
    return out


def _publish_consumer_group(cfg: PipelineConfig, positions: Mapping[str, int]) -> None:
    """For monitoring tools; see offsetflow.source.lag (never read back for correctness)."""
    from offsetflow.source import publish_positions

    try:
        publish_positions(cfg, positions)
    except Exception as e:  # noqa: BLE001 - monitoring must never fail a committed batch
        log.warning("could not publish consumer-group offsets for %s: %s", cfg.name, e)


def window_task(kind: str, conf: Mapping[str, Any], started_by: str,
                load: Loader | None = None, due: Due | None = None) -> dict[str, Any]:
    """Validate a backfill/replay form or conf, plan its batches (unless dry run)."""
    clean = {k: v for k, v in conf.items() if v not in (None, "")}
    req = parse_request(kind, clean)
    try:
        cfg = _config(req.pipeline, load)
    except ConfigError as e:
        raise RequestError(f"pipeline {req.pipeline!r}: {e}") from e
    with Ledger(cfg.sink.connection) as ledger:
        wp = plan_window(cfg, ledger, kafka_for(cfg), req)
        report = wp.report()
        log.info("%s request for %s: %s", kind, cfg.name, json.dumps(report, indent=2))
        if req.dry_run:
            log.info("dry run: nothing was planned or read")
            return {"dry_run": True, "report": report, "batch_ids": []}
        ids = submit_window(cfg, ledger, wp, started_by, due)
    return {"dry_run": False, "report": report, "batch_ids": ids}


def describe_connection(dsn: str) -> str:
    return redact_dsn(dsn)
