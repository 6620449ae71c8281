"""What the tasks report for monitoring: the run task's OpenLineage (topics in, targets out
with row counts, the batches and their offset ranges as a run facet: `batch_lineage`); after
a publish the batches' stats; on every plan and every
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
    BATCH_FACET,
    DatasetName,
    batch_run_facet,
    openlineage_dataset,
    openlineage_output,
    pipeline_datasets,
)
from offsetflow.orchestration.pipeline_metrics import (
    Metric,
    batch_metrics,
    count,
    emit,
    lag_metrics,
    rate_metric,
    stats_loaded,
)
from offsetflow.plan import PlanOutcome

log = logging.getLogger(__name__)


def datasets_of(cfg: PipelineConfig, batch_ids: list[int]
                ) -> tuple[list[DatasetName], list[DatasetName]]:
    """Topics the batches read and the tables they wrote (a backfill may use a side table)."""
    inputs, outputs, _ = batch_lineage_parts(cfg, batch_ids)
    return inputs, [d for d, _ in outputs]


def batch_lineage_parts(cfg: PipelineConfig, batch_ids: list[int]
                        ) -> tuple[list[DatasetName], list[tuple[DatasetName, int]],
                                   list[dict[str, Any]]]:
    """(input topics, output targets with the rows the committed batches wrote there, the
    batches as the `offsetflow_batch` run facet lists them)."""
    topics: dict[str, None] = {}
    rows: dict[str, int] = {}
    facet: list[dict[str, Any]] = []
    with Ledger(cfg.sink.connection) as ledger:
        for bid in batch_ids:
            b = ledger.get_batch(bid)
            topics.update((r.topic, None) for r in b.ranges)
            target = b.target_table or cfg.sink.table
            rows[target] = rows.get(target, 0) + (
                int(b.rows_written or 0) if b.status == "committed" else 0)
            facet.append({"batch_id": b.batch_id, "kind": b.kind, "status": b.status,
                          "attempts": b.attempts, "records_read": b.records_read,
                          "rows_written": b.rows_written,
                          "ranges": [{"topic": r.topic, "partition": r.partition,
                                      "from_offset": r.from_offset,
                                      "until_offset": r.until_offset} for r in b.ranges]})
    inputs, _ = pipeline_datasets(cfg, list(topics) or None)
    outputs = [(pipeline_datasets(cfg, list(topics) or None, t)[1][0], n)
               for t, n in rows.items()]
    return inputs, outputs, facet


def batch_lineage(cfg: PipelineConfig, batch_ids: list[int], complete: bool) -> Any:
    """The run task's OpenLineage: the topics it read (with the record schema), the targets
    it wrote (with `outputStatistics` once complete) and the `offsetflow_batch` run facet
    (batch ids and offset ranges). On failure the provider adds the error."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    inputs, outputs, batches = batch_lineage_parts(cfg, batch_ids)
    schema = dict(cfg.schema) if cfg.schema else None
    return OperatorLineage(
        inputs=[openlineage_dataset(d.namespace, d.name, schema) for d in inputs],
        outputs=[openlineage_output(d.namespace, d.name, n if complete else None)
                 for d, n in outputs],
        run_facets={BATCH_FACET: batch_run_facet(cfg.name, batches)})


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
    """The lag gauges, measured now from the ledger and Kafka (none when that fails, or
    outside an Airflow process)."""
    if not stats_loaded():
        return []
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
    if not stats_loaded():
        return
    statuses = _statuses(cfg, batch_ids) if batch_ids else []
    send(cfg, count("batches_retried", sum(s == "failed" for s in statuses or [])))


def report_run_failure(cfg: PipelineConfig, batch_ids: list[int]) -> None:
    """After a failed run: the batches it left failed (at least one: the run failed), and
    the lag as it is now."""
    if not stats_loaded():
        return
    statuses = _statuses(cfg, batch_ids) if batch_ids else None
    failed = sum(s == "failed" for s in statuses) if statuses is not None else len(batch_ids)
    send(cfg, count("batches_failed", max(failed, 1)) + unread_metrics(cfg))


def report_published(cfg: PipelineConfig, published: dict[str, Any]) -> None:
    """`published`: what publish_task returns (batches' figures, positions)."""
    ids = [int(b["batch_id"]) for b in published.get("batches", [])]
    if not ids:
        return
    send(cfg, batch_metrics(published["batches"]) + unread_metrics(cfg))
