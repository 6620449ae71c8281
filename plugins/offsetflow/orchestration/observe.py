"""After a publish: report lineage (Kafka topics in, PostgreSQL table out) to Airflow's
hook-level lineage collector, which the OpenLineage provider turns into the task's
OpenLineage inputs/outputs, and send the pipeline's stats. Called from publish_task, so every
operator or DAG that publishes a pipeline's batches gets both. Monitoring never fails a
committed batch: errors are logged as warnings.
"""

from __future__ import annotations

import logging
from typing import Any

from offsetflow.config import PipelineConfig
from offsetflow.ledger import Ledger
from offsetflow.orchestration.lineage import (
    DatasetName,
    pipeline_datasets,
    record_schema_extra,
)
from offsetflow.orchestration.pipeline_metrics import batch_metrics, emit
from offsetflow.plan import pending_offsets

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


def current_lag(cfg: PipelineConfig, positions: dict[str, int]) -> int:
    from offsetflow.ops import kafka_for

    committed = {(t, int(p)): o for k, o in positions.items() for t, _, p in [k.rpartition("/")]}
    kafka = kafka_for(cfg)
    offsets = kafka.partition_offsets(kafka.partitions(kafka.topics(cfg.topics,
                                                                    cfg.topic_pattern)))
    return sum(pending_offsets(committed, offsets, cfg.starting.kind).values())


def report_published(cfg: PipelineConfig, published: dict[str, Any]) -> None:
    """`published`: what publish_task returns (batches' figures, positions)."""
    ids = [int(b["batch_id"]) for b in published.get("batches", [])]
    if not ids:
        return
    try:
        report_lineage(cfg, ids)
    except Exception as e:  # noqa: BLE001 - monitoring must never fail a committed batch
        log.warning("could not report lineage of %s: %s", cfg.name, e)
    lag: int | None
    try:
        lag = current_lag(cfg, published.get("positions", {}))
    except Exception as e:  # noqa: BLE001
        log.warning("could not measure the lag of %s: %s", cfg.name, e)
        lag = None
    try:
        metrics = batch_metrics(cfg.name, published["batches"], lag)
        emit(cfg.name, metrics)
        log.info("stats of %s: %s", cfg.name, {m.name: m.value for m in metrics})
    except Exception as e:  # noqa: BLE001
        log.warning("could not send the stats of %s: %s", cfg.name, e)
