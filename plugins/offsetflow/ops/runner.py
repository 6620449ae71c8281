"""Plan + run + commit for one pipeline without Airflow (the CLI's `run`, tests, demo)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offsetflow.config import PipelineConfig
from offsetflow.extras import require
from offsetflow.ledger import Due, Ledger, run_holders
from offsetflow.plan import (
    OpenBatchRetry,
    PlanOutcome,
    open_batch_retry,
    pending_offsets,
    plan_next,
)
from offsetflow.ranges import TopicPartition
from offsetflow.sinks import sink_for
from offsetflow.source import KafkaMetadata

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from offsetflow.job import RunReport

log = logging.getLogger(__name__)


@dataclass
class CycleResult:
    plan: PlanOutcome
    report: RunReport | None
    plan_s: float

    def summary(self) -> dict[str, Any]:
        if self.report is None:
            return {"batch_id": None, "status": "empty", "plan_s": round(self.plan_s, 3)}
        r = self.report.result
        return {"batch_id": r.batch_id, "status": r.status, "rows_written": r.rows_written,
                "bad_records": r.bad_records, "plan_s": round(self.plan_s, 3),
                **self.report.timings}


def kafka_for(cfg: PipelineConfig) -> KafkaMetadata:
    return KafkaMetadata(cfg.admin_settings(), cfg.isolation_level, origin=cfg.kafka_origin)


def pending_for(cfg: PipelineConfig, dsn: str | None = None) -> dict[TopicPartition, int]:
    """Offsets waiting beyond the pipeline's committed positions (what the waiting sensor
    polls); an open batch (planned, failed) counts as waiting too, with its span."""
    with Ledger(dsn or cfg.sink.connection) as ledger, ledger.transaction() as cur:
        committed = ledger.positions(cfg.name, cur)
        open_batch = ledger.open_batch(cur, cfg.name)
    if open_batch is not None:
        return {r.topic_partition: r.span for r in open_batch.ranges if r.span > 0}
    kafka = kafka_for(cfg)
    tps = kafka.partitions(kafka.topics(cfg.topics, cfg.topic_pattern))
    return pending_offsets(committed, kafka.partition_offsets(tps), cfg.starting.kind)


def open_batch_wait(cfg: PipelineConfig, base_s: float, dsn: str | None = None,
                    gone_since: dict[tuple[int, int], float] | None = None
                    ) -> OpenBatchRetry | None:
    """When an event-driven run may start the pipeline's open scheduled batch
    (`arrival.open_batch_retry`): not while a run of it is alive (`run_lock`); after
    `arrival.retry_wait` once it failed (timed by the ledger database's clock), or once the
    run that left it `running` is gone, timed from when the caller first saw it gone:
    `gone_since` remembers that per (batch, attempt) (monotonic clock). Without it, from the
    attempt's start (a lower bound: a long run's death is then retried at once)."""
    with Ledger(dsn or cfg.sink.connection) as ledger, ledger.transaction() as cur:
        # the locks before the status: a run that fails in between is seen alive (and waited
        # for), never `failed` with its failure not yet timed
        batch = ledger.open_batch(cur, cfg.name)
        if batch is None:
            return None
        holders = run_holders(cur, batch.batch_id)
        cur.execute("""SELECT status, attempts,
                              extract(epoch FROM now() - CASE WHEN status = 'failed'
                                                         THEN finished_at
                                                         ELSE started_at END)
                         FROM offsetflow.batches WHERE batch_id = %s""", (batch.batch_id,))
        row = cur.fetchone()
    if row is None:
        return None
    status, attempts, age = row[0], int(row[1]), None if row[2] is None else float(row[2])
    since = age
    if status == "running" and not holders and gone_since is not None:
        first = gone_since.setdefault((batch.batch_id, attempts), time.monotonic())
        since = time.monotonic() - first
    return open_batch_retry(batch.batch_id, status, attempts, since, holders, base_s)


def check_extras(cfg: PipelineConfig) -> None:
    """The optional parts the pipeline uses are installed (its sink's library, fastavro for
    Avro values, Great Expectations for a quality suite), else a MissingExtraError naming the
    extra: before a batch is planned that no run of this install could write, and before any
    service is reached. (The Spark tasks' own import of fastavro names the extra too, for
    executors whose environment lacks it.)"""
    sink_for(cfg)  # loads the sink's package: sink.type iceberg requires offsetflow[iceberg]
    if cfg.format_type == "avro":
        require("avro", f"{cfg.source_file}: format.type: avro (pipeline {cfg.name})")
    if cfg.quality_suite is not None:
        require("quality", f"{cfg.source_file}: quality.suite (pipeline {cfg.name})")


def plan_only(cfg: PipelineConfig, dsn: str, started_by: str = "cli",
              due: Due | None = None) -> PlanOutcome:
    check_extras(cfg)
    with Ledger(dsn) as ledger:
        return plan_next(cfg, ledger, kafka_for(cfg), started_by=started_by, due=due)


def run_cycle(cfg: PipelineConfig, dsn: str, spark: SparkSession | None = None,
              started_by: str = "cli") -> CycleResult:
    """One micro-batch: plan (or re-use the open batch), read, stage, commit."""
    from offsetflow.job import build_spark, run_batch

    t = time.monotonic()
    outcome = plan_only(cfg, dsn, started_by)
    plan_s = time.monotonic() - t
    if outcome.batch is None:
        return CycleResult(outcome, None, plan_s)
    spark = spark or build_spark(cfg, f"offsetflow-{cfg.name}")
    report = run_batch(spark, cfg, outcome.batch.batch_id, dsn)
    return CycleResult(outcome, report, plan_s)


def run_until_caught_up(cfg: PipelineConfig, dsn: str, spark: SparkSession | None = None,
                        max_batches: int = 100, started_by: str = "cli",
                        on_cycle: Callable[[CycleResult], None] | None = None
                        ) -> list[CycleResult]:
    """`on_cycle` sees every cycle as it ends (the CLI's progress line)."""
    results: list[CycleResult] = []
    for i in range(max_batches):
        res = run_cycle(cfg, dsn, spark, started_by)
        results.append(res)
        s = res.summary()
        log.info("pipeline %s: cycle %d: %s", cfg.name, i + 1, s)
        if on_cycle is not None:
            on_cycle(res)
        if res.report is None:
            break
    return results
