"""What the tasks report for monitoring: after a publish, lineage (Kafka topics in, the
target out) to Airflow's hook-level lineage collector, which the OpenLineage provider turns
into the task's OpenLineage inputs/outputs, and the batches' stats; on every plan and every
failed run, the lag, oldest-unread age and failure counters (`pipeline_metrics`), so a
failing pipeline's lag keeps moving. Monitoring never fails a task: errors are logged as
warnings.
"""

from __future__ import annotations

import logging
from typing import Any

from offsetflow.config import PipelineConfig
from offsetflow.ledger import Ledger
from offsetflow.ops import unread_now
from offsetflow.orchestration.lineage import (
    DatasetName,
    pipeline_datasets,
    record_schema_extra,
)
from offsetflow.orchestration.pipeline_metrics import (
    Metric,
    batch_metrics,
    count,
    emit,
    lag_metrics,
    rate_metric,
)
from offsetflow.plan import PlanOutcome

log = logging.getLogger(__name__)


class PipelineLineageContext:
    """What the collector files the assets under (it hashes the object's identity)."""

    def __init__(self, pipeline: str) -> None:
        self.pipeline = pipeline


def datasets_of(cfg: PipelineConfig, batch_ids: list[int]
                ) -> tuple[list[DatasetName], list[DatasetName]]:
    """Topics the batches read and the tables they wrote (a backfill may use a side table)."""
    topics: dict[str, None] = {}
    tables: dict[str, None] = {}
    with Ledger(cfg.sink.connection) as ledger:
        for bid in batch_ids:
            b = ledger.get_batch(bid)
            topics.update((r.topic, None) for r in b.ranges)
            tables[b.target_table or cfg.sink.table] = None
    inputs, outputs = pipeline_datasets(cfg, list(topics) or None)
    if tables:
        outputs = [pipeline_datasets(cfg, list(topics) or None, t)[1][0] for t in tables]
    return inputs, outputs


def report_lineage(cfg: PipelineConfig, batch_ids: list[int]) -> None:
    from airflow.providers.common.compat.lineage.hook import get_hook_lineage_collector

    inputs, outputs = datasets_of(cfg, batch_ids)
    collector = get_hook_lineage_collector()
    ctx = PipelineLineageContext(cfg.name)
    for d in inputs:
        collector.add_input_asset(context=ctx, uri=d.uri,  # type: ignore[arg-type]
                                  asset_extra=record_schema_extra(cfg) or None)
    for d in outputs:
        collector.add_output_asset(context=ctx, uri=d.uri)  # type: ignore[arg-type]
    log.info("lineage of %s: %s -> %s", cfg.name, [d.uri for d in inputs],
             [d.uri for d in outputs])


def send(cfg: PipelineConfig, metrics: list[Metric]) -> None:
    """Best effort: monitoring must never fail a task (or hide its own error)."""
    if not metrics:
        return
    try:
        emit(cfg.name, metrics)
        log.info("stats of %s: %s", cfg.name, {m.name: m.value for m in metrics})
    except Exception as e:  # noqa: BLE001
        log.warning("could not send the stats of %s: %s", cfg.name, e)


def unread_metrics(cfg: PipelineConfig) -> list[Metric]:
    """The lag gauges, measured now from the ledger and Kafka (none when that fails)."""
    try:
        u = unread_now(cfg, cfg.sink.connection)
    except Exception as e:  # noqa: BLE001
        log.warning("could not measure the lag of %s: %s", cfg.name, e)
        return []
    return lag_metrics(u.lag, u.oldest_age_s)


def report_plan(cfg: PipelineConfig, outcome: PlanOutcome | None) -> None:
    """After every plan, and every failed one (`outcome` None): the lag keeps being sent
    while batches fail, so an alert on it can fire."""
    metrics = unread_metrics(cfg)
    if outcome is not None:
        metrics += count("batches_abandoned", len(outcome.abandoned))
        metrics += rate_metric(outcome.rate.rate if outcome.rate is not None else None)
    send(cfg, metrics)


def _statuses(cfg: PipelineConfig, batch_ids: list[int]) -> list[str] | None:
    try:
        with Ledger(cfg.sink.connection) as ledger:
            return [ledger.get_batch(b).status for b in batch_ids]
    except Exception as e:  # noqa: BLE001
        log.warning("could not read the batches of %s: %s", cfg.name, e)
        return None


def report_run_start(cfg: PipelineConfig, batch_ids: list[int]) -> None:
    """Before a run: each batch an earlier run failed is being retried."""
    statuses = _statuses(cfg, batch_ids) if batch_ids else []
    send(cfg, count("batches_retried", sum(s == "failed" for s in statuses or [])))


def report_run_failure(cfg: PipelineConfig, batch_ids: list[int]) -> None:
    """After a failed run: the batches it left failed (at least one: the run failed), and
    the lag as it is now."""
    statuses = _statuses(cfg, batch_ids) if batch_ids else None
    failed = sum(s == "failed" for s in statuses) if statuses is not None else len(batch_ids)
    send(cfg, count("batches_failed", max(failed, 1)) + unread_metrics(cfg))


def report_published(cfg: PipelineConfig, published: dict[str, Any]) -> None:
    """`published`: what publish_task returns (batches' figures, positions)."""
    ids = [int(b["batch_id"]) for b in published.get("batches", [])]
    if not ids:
        return
    try:
        report_lineage(cfg, ids)
    except Exception as e:  # noqa: BLE001 - monitoring must never fail a committed batch
        log.warning("could not report lineage of %s: %s", cfg.name, e)
    send(cfg, batch_metrics(published["batches"]) + unread_metrics(cfg))
