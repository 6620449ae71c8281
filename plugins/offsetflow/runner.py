"""Plan + run + commit for one pipeline without Airflow (the CLI's `run`, tests, demo)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offsetflow.arrival import pending_offsets, retry_wait
from offsetflow.config import PipelineConfig
from offsetflow.kafka_meta import KafkaMetadata
from offsetflow.ledger import Ledger
from offsetflow.planning import PlanOutcome, plan_next
from offsetflow.ranges import TopicPartition

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
    return KafkaMetadata(cfg.admin_settings(), cfg.isolation_level)


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


def failed_batch_wait(cfg: PipelineConfig, base_s: float, dsn: str | None = None
                      ) -> tuple[int, int, float] | None:
    """For an open scheduled batch that failed: (batch id, attempts, seconds until an
    event-driven run should retry it, `arrival.retry_wait`); None for any other state. The
    time since the failure is the ledger database's, not this machine's clock."""
    with Ledger(dsn or cfg.sink.connection) as ledger, ledger.transaction() as cur:
        batch = ledger.open_batch(cur, cfg.name)
        if batch is None or batch.status != "failed":
            return None
        # no failure time recorded: due now (never a wait that cannot end)
        cur.execute("""SELECT extract(epoch FROM now() - finished_at)
                         FROM offsetflow.batches WHERE batch_id = %s""", (batch.batch_id,))
        row = cur.fetchone()
    if not row or row[0] is None:
        return batch.batch_id, batch.attempts, 0.0
    since = float(row[0])
    return batch.batch_id, batch.attempts, retry_wait(batch.attempts, since, base_s)


def plan_only(cfg: PipelineConfig, dsn: str, started_by: str = "cli") -> PlanOutcome:
    with Ledger(dsn) as ledger:
        return plan_next(cfg, ledger, kafka_for(cfg), started_by=started_by)


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
