"""Backfills and replays: a window of offsets cut into ordinary ledger batches.

Both never move the pipeline's live positions (`moves_positions = false`) and both
*replace* what the window produced before in the target, in the commit transaction, so a
range is never duplicated; a target that cannot replace it (a Kafka topic) refuses a
window earlier windows already wrote there instead, unless the request allows duplicates
(`Sink.check_window_repeat`). A replay only covers offsets the pipeline already committed.

Steps of `submit_window`: resolve the window against Kafka (timestamps to offsets);
refuse offsets that are gone from Kafka; under the pipeline lock refuse a replay, or a
backfill into the pipeline's own table, that reaches beyond the live position (the live
batches write those offsets), a window that overlaps an open batch, and a window the
target already holds and cannot replace; insert one batch per cut, in order; commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offsetflow.config import PipelineConfig
from offsetflow.errors import RequestError
from offsetflow.ledger import Due, Ledger
from offsetflow.ops.audit import open_audit, refuse_open_audit_overlap, window_ranges_json
from offsetflow.plan import (
    WindowRequest,
    check_backfill_window,
    check_replay_window,
    cut_window,
    gone_from_kafka,
    resolve_window,
    window_ranges,
)
from offsetflow.ranges import OffsetRange, TopicPartition
from offsetflow.sinks import sink_for
from offsetflow.source import KafkaMetadata

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from offsetflow.job import RunReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowPlan:
    request: WindowRequest
    window: dict[TopicPartition, tuple[int, int]]
    batches: list[tuple[OffsetRange, ...]]
    gone: list[tuple[TopicPartition, int, int]]
    # Kafka topic ids at planning: a run checks them before reading (a recreated topic)
    topic_ids: dict[str, str] = field(default_factory=dict)
    refused: str | None = None  # why submitting it would be refused (the live position)

    @property
    def target_table(self) -> str | None:
        return self.request.target_table

    def report(self) -> dict[str, Any]:
        """What a dry run shows: ranges, offsets (an upper bound on records), what is gone."""
        return {
            "pipeline": self.request.pipeline,
            "kind": self.request.kind,
            "ranges": [r.to_dict() | {"offsets": r.span} for r in window_ranges(self.window)],
            "offsets_total": sum(hi - lo for lo, hi in self.window.values()),
            "batches": len(self.batches),
            "gone_from_kafka": [{"topic": tp[0], "partition": tp[1], "from_offset": lo,
                                 "until_offset": hi} for tp, lo, hi in self.gone],
            "note": "offset counts are an upper bound on records: transaction markers, "
                    "aborted and compacted records take offsets too",
        } | ({"refused": self.refused} if self.refused else {}) | (
            {"audit": "the window is written beside the live data (a shadow table, or a "
                      "branch of an Iceberg table), then diffed; publish or discard it "
                      "with `offsetflow audit`"}
            if self.request.audit else {})


def plan_window(cfg: PipelineConfig, ledger: Ledger, kafka: KafkaMetadata,
                req: WindowRequest) -> WindowPlan:
    if req.pipeline != cfg.name:
        raise RequestError(f"request is for pipeline {req.pipeline}, config is {cfg.name}")
    if req.topic is not None:
        if not cfg.matches_topic(req.topic):
            raise RequestError(f"topic {req.topic} is not read by pipeline {cfg.name}")
        topics = kafka.topics([req.topic])
    else:
        topics = kafka.topics(cfg.topics, cfg.topic_pattern)
        if len(topics) > 1 and (req.partitions or any(p != -1 for p in
                                                      [*req.from_offsets, *req.until_offsets])):
            raise RequestError(f"pipeline {cfg.name} reads {len(topics)} topics; name the "
                               f"topic when giving partitions or per-partition offsets")
    tps = kafka.partitions(topics)
    by_time = None
    if req.by_time:
        assert req.from_timestamp_ms is not None and req.until_timestamp_ms is not None
        lo = kafka.offsets_for_time(tps, req.from_timestamp_ms)
        hi = kafka.offsets_for_time(tps, req.until_timestamp_ms)
        ends = kafka.partition_offsets(tps)
        by_time = ({tp: (v if v >= 0 else ends[tp].latest) for tp, v in lo.items()},
                   {tp: (v if v >= 0 else ends[tp].latest) for tp, v in hi.items()})
    window = resolve_window(req, tps, by_time)
    offsets = kafka.partition_offsets(list(window))
    gone = gone_from_kafka(window, offsets)
    committed = ledger.positions(cfg.name)
    if req.kind == "replay":
        check_replay_window(window, committed)
    refused = None
    topic_ids = kafka.topic_ids(topics)
    try:  # a dry run shows the refusal in its report; submit_window raises it
        check_live_positions(cfg, req, window, committed)
        with ledger.transaction() as cur:
            sink_for(cfg).check_window_repeat(cur, req.kind, req.target_table,
                                              window_ranges(window), topic_ids,
                                              req.allow_duplicates)
            target = sink_for(cfg).window_target(req.target_table)
            refuse_open_audit_overlap(cur, cfg.name, target,
                                      window_ranges_json(window_ranges(window)))
            if req.audit:  # a sink or mode that cannot audit
                sink_for(cfg).audit_shadows(cur, target, 0)
    except RequestError as e:
        refused = str(e)
    return WindowPlan(req, window, cut_window(window, req.records_per_batch), gone,
                      topic_ids, refused)


def check_live_positions(cfg: PipelineConfig, req: WindowRequest,
                         window: dict[TopicPartition, tuple[int, int]],
                         committed: dict[TopicPartition, int]) -> None:
    """A replay, or a backfill where the live batches write (the pipeline's own table),
    covers committed offsets only; the sink refuses a target it cannot write (a Kafka
    sink: only ever into its side topic)."""
    sink = sink_for(cfg)
    sink.check_window_target(req.kind, req.target_table)
    if req.kind == "replay":
        check_replay_window(window, committed)
    elif sink.writes_live_output(req.target_table):
        check_backfill_window(window, committed, cfg.sink.table)


def submit_window(cfg: PipelineConfig, ledger: Ledger, wp: WindowPlan,
                  started_by: str, due: Due | None = None) -> list[int]:
    """`due`: when the request was made (an Airflow trigger's time); None: now. Every batch
    of the window is due then: the later ones wait for the earlier (scheduling delay)."""
    if wp.gone:
        desc = "; ".join(f"{tp[0]}[{tp[1]}] [{lo}, {hi})" for tp, lo, hi in wp.gone)
        raise RequestError(f"the window is not (or no longer) in Kafka: {desc}")
    ids: list[int] = []
    with ledger.transaction() as cur:
        ledger.lock_pipeline(cur, cfg.name)
        # again under the lock: the dry run's answer may be stale by now
        check_live_positions(cfg, wp.request, wp.window, ledger.positions(cfg.name, cur))
        overlapping = ledger.open_batches_overlapping(cur, cfg.name, window_ranges(wp.window))
        if overlapping:
            raise RequestError(f"the window overlaps open batch(es) {overlapping} of pipeline "
                               f"{cfg.name}; wait for them to commit or abandon them")
        sink = sink_for(cfg)
        # a target that cannot replace what an earlier window wrote there (a Kafka topic)
        sink.check_window_repeat(cur, wp.request.kind, wp.target_table,
                                 window_ranges(wp.window), wp.topic_ids,
                                 wp.request.allow_duplicates)
        params: dict[str, Any] = {
            "window": {f"{tp[0]}/{tp[1]}": list(w) for tp, w in wp.window.items()},
            "records_per_batch": wp.request.records_per_batch}
        if wp.request.allow_duplicates:
            params["allow_duplicates"] = True
        target = sink.window_target(wp.target_table)  # e.g. a Kafka side topic
        window = window_ranges_json(window_ranges(wp.window))
        # an open audit of these coordinates: its diff would go stale, or two audits
        # would publish one window
        refuse_open_audit_overlap(cur, cfg.name, target, window)
        for ranges in wp.batches:
            ids.append(ledger.insert_batch(
                cur, pipeline=cfg.name, kind=wp.request.kind, ranges=ranges,
                target_table=target,
                config_fingerprint=cfg.fingerprint(), started_by=started_by,
                moves_positions=False, params=params, topic_ids=wp.topic_ids,
                split_offsets=cfg.spark.max_offsets_per_task, due=due))
        if wp.request.audit and ids:  # into a shadow beside `target`, published later
            open_audit(cur, cfg, wp.request.kind, target, ids, window, started_by)
    log.info("pipeline %s: %s of %d offsets planned as batches %s", cfg.name, wp.request.kind,
             sum(hi - lo for lo, hi in wp.window.values()), ids)
    return ids


def run_batches(cfg: PipelineConfig, dsn: str, batch_ids: list[int],
                spark: SparkSession | None = None) -> list[RunReport]:
    """Run window batches in order; stop at the first failure (the rest stay planned)."""
    from offsetflow.job import build_spark, run_batch

    spark = spark or build_spark(cfg, f"offsetflow-{cfg.name}-window")
    reports = []
    for i, bid in enumerate(batch_ids, 1):
        rep = run_batch(spark, cfg, bid, dsn)
        log.info("window batch %d/%d (id %d): %s", i, len(batch_ids), bid, rep.result.message)
        reports.append(rep)
    return reports
