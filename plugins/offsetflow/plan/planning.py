"""Step 1 of the lifecycle: plan a batch under the pipeline's lock and write it to the ledger.

Order matters and is followed step by step in `plan_next`:
  1. take the per-pipeline lock (transaction-scoped advisory lock);
  2. an open batch (planned, running, failed) is returned unchanged: a re-run reads the
     same ranges, like Structured Streaming's offset log; except under `data_loss:
     continue` when Kafka deleted some of its offsets before it read them and its stage
     does not hold them: it could never be read, so it is abandoned (in this transaction)
     and a new batch is planned (a running batch is never abandoned: planning fails);
  3. read committed positions, then partitions and earliest/latest offsets from Kafka;
  4. plan (pure); under the `fail` policy record data-loss gaps in the ledger and stop
     (the gap record is committed, the batch is not);
  5. give partitions seen for the first time their starting position; an empty plan
     inserts no batch; otherwise insert the batch and its ranges, each with the position
     its commit expects (under `continue` a range skipping a gap starts above it), and
     the gaps it skips (`data_loss` rows naming the batch; a gap no batch covers yet is
     recorded without one, once); commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg2.extensions

from offsetflow.config import PipelineConfig
from offsetflow.errors import BatchStateError, DataLossError, TopicRecreatedError
from offsetflow.ledger import Batch, Due, Ledger
from offsetflow.plan.planner import Plan, check_topic_identity, plan_batch
from offsetflow.plan.rate import RateDecision, decide_rate, observe
from offsetflow.ranges import DataLossGap, split_ranges
from offsetflow.source import KafkaMetadata

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanOutcome:
    batch: Batch | None  # None: nothing new to read
    reused: bool
    plan: Plan | None
    rate: RateDecision | None = None  # how an adaptive rate sized the batch
    abandoned: tuple[int, ...] = ()  # open batches this plan abandoned (unreadable)

    @property
    def batch_id(self) -> int | None:
        return self.batch.batch_id if self.batch else None


def check_batch_topics(cur: psycopg2.extensions.cursor, kafka: KafkaMetadata, batch: Batch,
                       pipeline: str) -> None:
    """Before an open batch is read (or its offsets looked up): a topic deleted since it
    was planned makes it unreadable for good; one deleted and recreated has restarted its
    offsets, so its ranges would name the new topic's records. Either way: name the way
    out."""
    gone, recreated = changed_topics(cur, kafka, batch)
    if gone:
        raise BatchStateError(
            f"batch {batch.batch_id} reads topic {gone[0]}, which no longer exists in Kafka; "
            f"it can never be read. Abandon it (offsetflow abandon --batch-id "
            f"{batch.batch_id} --reason '...'); if the topic comes back, see "
            f"reset-position")
    if recreated:
        topic, (old, new) = min(recreated.items())
        raise TopicRecreatedError(topic, old, new, pipeline=pipeline, batch_id=batch.batch_id)


def changed_topics(cur: psycopg2.extensions.cursor, kafka: KafkaMetadata, batch: Batch
                   ) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """The batch's topics deleted since it was planned, and those recreated since (topic ->
    (planned id, current id)): either way its records there are gone for good."""
    gone = kafka.missing(sorted({r.topic for r in batch.ranges}))
    planned = Ledger.range_topic_ids(cur, batch.batch_id)
    current = kafka.topic_ids(sorted(t for t in planned if t not in gone)) if planned else {}
    return gone, {t: (old, current.get(t, "none")) for t, old in sorted(planned.items())
                  if t not in gone and current.get(t) != old}


def _refuse_if_in_sink(cur: psycopg2.extensions.cursor, ledger: Ledger, cfg: PipelineConfig,
                       batch: Batch, why: str) -> None:
    """Before a batch is abandoned: its external sink must not hold it already."""
    from offsetflow.commit import sink_holds
    from offsetflow.sinks import external_sink

    sink = external_sink(cfg, ledger.dsn)
    if sink is None:
        return
    # the batch row, in planning's transaction until the abandon: no run's commit can land
    # in the sink between this check and the abandon
    ledger.get_batch(batch.batch_id, cur, for_update=True)
    if sink_holds(ledger.dsn, batch, sink):
        raise BatchStateError(
            f"pipeline {cfg.name}: batch {batch.batch_id} should be abandoned ({why}), but "
            f"its sink already holds it (a run died after the sink's commit); abandoning it "
            f"would write its records twice. Run it again to complete it (offsetflow "
            f"run-batch --pipeline {cfg.name} --batch-id {batch.batch_id}); if its records "
            f"are gone from Kafka and from its stage, complete it from the sink's record "
            f"(offsetflow complete --batch-id {batch.batch_id} --reason '...')")


def deleted_before_read(cur: psycopg2.extensions.cursor, batch: Batch,
                         kafka: KafkaMetadata, split: int) -> str:
    """The offsets of an open batch's ranges that Kafka no longer holds and its stage does
    not hold either ("" if none: the batch can still be run, maybe from its stage).

    A part staged by an earlier attempt is never read again, so deleted offsets inside
    staged parts are not lost: the run commits them from the stage. A part's marker names
    the sub-ranges of the batch's split it read (packed parts read several); a marker
    without that list is of part k = sub-range k (the layout before packing, and a
    transform that keeps the partitioning; one that repartitions breaks it, docs/concepts.md)."""
    offsets = kafka.partition_offsets([r.topic_partition for r in batch.ranges])
    deleted = [(r, min(r.until_offset, offsets[r.topic_partition].earliest))
               for r in batch.ranges if r.from_offset < offsets[r.topic_partition].earliest]
    if not deleted:
        return ""
    cur.execute("""SELECT part, subranges FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows'""", (batch.batch_id,))
    staged: set[int] = set()
    for part, read in cur.fetchall():
        staged.update((int(part),) if read is None else (int(i) for i in read))
    if staged and batch.split_offsets == split:
        # (a run under another split than `split` drops the stage and reads again: then
        # nothing is covered)
        subs = split_ranges(batch.ranges, batch.split_offsets)
        deleted = [(r, gone) for r, gone in deleted
                   if any(i not in staged for i, s in enumerate(subs)
                          if s.topic_partition == r.topic_partition
                          and s.from_offset < gone and s.until_offset > r.from_offset)]
    return ", ".join(f"{r.topic}[{r.partition}] offsets [{r.from_offset}, {gone})"
                     for r, gone in deleted)


def _adopt_skipped_gaps(cur: psycopg2.extensions.cursor, ledger: Ledger,
                        cfg: PipelineConfig, batch: Batch, kafka: KafkaMetadata) -> None:
    """Unwedge a batch the release before ledger migration 0005 planned past a data-loss
    gap: its ranges start above the committed position and carry no expected position, so
    the fence (expecting from_offset) refused it on every run. When every offset between
    the position and the range's start is gone from Kafka, nothing readable is skipped:
    the range expects the position (as a range planned now would) and the gap is recorded
    with the batch."""
    cur.execute("""SELECT br.topic, br.partition, p.next_offset, br.from_offset
                     FROM offsetflow.batch_ranges br
                     JOIN offsetflow.positions p
                       ON p.pipeline = %s AND p.topic = br.topic AND p.partition = br.partition
                    WHERE br.batch_id = %s AND br.expected_position IS NULL
                      AND p.next_offset < br.from_offset""", (cfg.name, batch.batch_id))
    found = [(t, int(p), int(pos), int(frm)) for t, p, pos, frm in cur.fetchall()]
    if not found:
        return
    offsets = kafka.partition_offsets([(t, p) for t, p, _, _ in found])
    gaps = [DataLossGap(t, p, pos, frm) for t, p, pos, frm in found
            if offsets[(t, p)].earliest >= frm]
    for g in gaps:
        cur.execute("""UPDATE offsetflow.batch_ranges SET expected_position = %s
                        WHERE batch_id = %s AND topic = %s AND partition = %s""",
                    (g.missing_from, batch.batch_id, g.topic, g.partition))
        log.warning("pipeline %s: open batch %d skips %s[%d] offsets [%d, %d), gone from "
                    "Kafka (planned before ledger migration 0005); it now expects position "
                    "%d", cfg.name, batch.batch_id, g.topic, g.partition, g.missing_from,
                    g.missing_until, g.missing_from)
    ledger.record_data_loss(cur, cfg.name, gaps, cfg.data_loss, batch.batch_id)


def plan_next(cfg: PipelineConfig, ledger: Ledger, kafka: KafkaMetadata,
              started_by: str = "cli", due: Due | None = None) -> PlanOutcome:
    """`due`: when a new batch is due (an Airflow run's schedule or trigger time); None:
    the plan's time. A re-used open batch keeps the due time it was planned with."""
    # one retry budget for all Kafka calls made while the pipeline's lock is held
    with kafka.retry_budget():
        return _plan_next(cfg, ledger, kafka, started_by, due)


def _plan_next(cfg: PipelineConfig, ledger: Ledger, kafka: KafkaMetadata,
               started_by: str, due: Due | None) -> PlanOutcome:
    pending_error: DataLossError | None = None
    abandoned: tuple[int, ...] = ()
    with ledger.transaction() as cur:
        ledger.lock_pipeline(cur, cfg.name)  # 1
        existing = ledger.open_batch(cur, cfg.name)  # 2
        if existing is not None and cfg.data_loss == "continue":
            # its offsets are looked up next: a deleted or recreated topic must be named
            # as such first, not failed on as an unknown partition or taken for deletions
            check_batch_topics(cur, kafka, existing, cfg.name)
        unreadable = deleted_before_read(cur, existing, kafka,
                                          cfg.spark.max_offsets_per_task) \
            if existing is not None and cfg.data_loss == "continue" else ""
        if existing is not None and not unreadable:
            if cfg.data_loss == "continue" and existing.moves_positions:
                _adopt_skipped_gaps(cur, ledger, cfg, existing, kafka)
            log.info("pipeline %s: re-using open batch %d (%s, %d ranges)", cfg.name,
                     existing.batch_id, existing.status, len(existing.ranges))
            return PlanOutcome(existing, reused=True, plan=None)
        if existing is not None and existing.status == "running":
            # a live job (or a zombie) may be staging or committing it right now: never
            # drop its stage under it; only an operator can tell a dead one from a live one
            raise BatchStateError(
                f"pipeline {cfg.name}: batch {existing.batch_id} is running, but {unreadable} "
                f"were deleted from Kafka before it read them, so it can never complete. If "
                f"no job is running it any more, abandon it (offsetflow abandon --batch-id "
                f"{existing.batch_id} --reason '...'); the next plan skips the gap")
        if existing is not None:
            _refuse_if_in_sink(cur, ledger, cfg, existing, f"{unreadable} were deleted")
            # it can never be read; `continue` means plan again from the earliest offsets
            reason = (f"{unreadable} were deleted from Kafka before this batch could read "
                      f"them (not in its stage either); data_loss: continue planned a new "
                      f"batch past the gap")
            ledger.abandon(existing.batch_id, reason, cur)
            abandoned = (existing.batch_id,)
            log.warning("pipeline %s: abandoned open batch %d: %s", cfg.name,
                        existing.batch_id, reason)
        committed = ledger.positions(cfg.name, cur)  # 3
        topics = kafka.topics(cfg.topics, cfg.topic_pattern)
        topic_ids = kafka.topic_ids(topics)
        check_topic_identity(ledger.position_topic_ids(cur, cfg.name), topic_ids,
                             cfg.name)
        tps = kafka.partitions(topics)
        offsets = kafka.partition_offsets(tps)
        by_ts = None
        if cfg.starting.kind == "timestamp" and cfg.starting.timestamp_ms is not None:
            fresh = [tp for tp in tps if tp not in committed]
            by_ts = kafka.offsets_for_time(fresh, cfg.starting.timestamp_ms)
        total_cap, rate = cfg.max_records_per_batch, None
        if cfg.rate.adaptive == "pid" and cfg.rate.interval_s:
            # sized from the last committed batch; the configured caps still win
            previous, recent = ledger.rate_inputs(cur, cfg.name)
            rate = decide_rate(cfg.rate, previous, observe(recent, cfg.rate.interval_s),
                               cfg.max_records_per_batch)
            total_cap = rate.max_records
            log.info("pipeline %s: rate %s: %s", cfg.name,
                     f"{rate.rate:.1f}/s" if rate.rate is not None else "none", rate.why)
        plan = plan_batch(committed, offsets, cfg.starting, cfg.max_records_per_partition,
                          total_cap, cfg.data_loss, by_ts)  # 4
        for tp in plan.new_partitions:
            log.info("pipeline %s: new partition %s[%d]", cfg.name, *tp)
        for tp in plan.vanished:
            log.warning("pipeline %s: %s[%d] has a committed position but no longer exists "
                        "in Kafka", cfg.name, *tp)
        if plan.data_loss:
            if cfg.data_loss == "fail":  # under `continue` the gap is recorded with its batch
                ledger.record_data_loss(cur, cfg.name, plan.data_loss, cfg.data_loss)
            for g in plan.data_loss:
                log.error("pipeline %s: data loss on %s[%d]: offsets [%d, %d) are gone "
                          "(policy %s)", cfg.name, g.topic, g.partition, g.missing_from,
                          g.missing_until, cfg.data_loss)
            if cfg.data_loss == "fail":
                g = plan.data_loss[0]
                more = f"{len(plan.data_loss) - 1} more partition(s) affected; " \
                    if len(plan.data_loss) > 1 else ""
                pending_error = DataLossError(
                    g.topic, g.partition, g.missing_from, g.missing_until,
                    f"{more}nothing was planned; set source.data_loss: continue to skip "
                    f"to the earliest offset, or reset the position")
        if pending_error is None and plan.new_partitions:
            # the starting policy is resolved once: new partitions get a position now, so an
            # empty first plan under `latest` does not move the start on every re-plan
            starts = {r.topic_partition: r.from_offset for r in plan.ranges}
            ledger.init_positions(cur, cfg.name, {tp: starts[tp] for tp in plan.new_partitions},
                                  topic_ids, f"initial position ({cfg.starting.kind})")
        if pending_error is None and not plan.is_empty:  # 5
            ranges = [r for r in plan.ranges if not r.is_empty]
            lag = sum(offsets[r.topic_partition].latest - r.from_offset for r in plan.ranges)
            batch_id = ledger.insert_batch(
                cur, pipeline=cfg.name, kind="scheduled", ranges=ranges,
                target_table=cfg.sink.table, config_fingerprint=cfg.fingerprint(),
                split_offsets=cfg.spark.max_offsets_per_task,
                started_by=started_by, topic_ids=topic_ids, params={"lag_at_plan": lag},
                due=due,
                # a range that skips a data-loss gap starts above its position: the fence
                # expects the position it was planned from, so it can still commit
                expected_positions={tp: committed[tp] for tp in (r.topic_partition
                                                                 for r in ranges)
                                    if tp in committed},
                rate=rate.record() if rate is not None else None)
            skipped = [g for g in plan.data_loss if any(
                r.topic_partition == (g.topic, g.partition) for r in ranges)]
            if skipped:
                ledger.record_data_loss(cur, cfg.name, skipped, cfg.data_loss, batch_id)
            # a gap of a partition left out of this batch (nothing after it to read yet, or
            # the batch cap) is recorded now and linked to the batch that later skips it
            ledger.record_data_loss(cur, cfg.name, [g for g in plan.data_loss
                                                    if g not in skipped], cfg.data_loss)
            batch = ledger.get_batch(batch_id, cur)
            log.info("pipeline %s: planned batch %d: %d ranges, %d offsets", cfg.name,
                     batch_id, len(ranges), plan.offset_span)
            return PlanOutcome(batch, reused=False, plan=plan, rate=rate, abandoned=abandoned)
        if pending_error is None and plan.data_loss:  # `continue`, nothing to read past it
            ledger.record_data_loss(cur, cfg.name, plan.data_loss, cfg.data_loss)
    if pending_error is not None:
        raise pending_error
    log.info("pipeline %s: nothing new to read", cfg.name)
    return PlanOutcome(None, reused=False, plan=plan, rate=rate, abandoned=abandoned)
