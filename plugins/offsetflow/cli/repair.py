"""`offsetflow abandon | complete | reset-position | cleanup`: the operator's tools for a
batch or a position that a run cannot settle by itself."""

from __future__ import annotations

import argparse
import logging

from offsetflow.cli.common import dsn_of, pipeline_of
from offsetflow.config import PipelineConfig, find_pipeline
from offsetflow.errors import ConfigError
from offsetflow.ledger import Batch, Ledger

log = logging.getLogger(__name__)


def _batch_pipeline(args: argparse.Namespace, batch: Batch) -> PipelineConfig | None:
    """The config of `batch`'s pipeline: --pipeline/--pipeline-file, else found by name.
    Not found: an error (its sink cannot be asked), or None under `abandon --unchecked`."""
    unchecked = getattr(args, "unchecked", None)  # None: the command does not offer it
    from offsetflow.errors import BatchStateError
    from offsetflow.orchestration.connections import resolve

    if args.pipeline or args.pipeline_file:
        cfg: PipelineConfig | None = pipeline_of(args)
    else:
        try:
            cfg = resolve(find_pipeline(batch.pipeline))
        except ConfigError as e:
            if unchecked is not True:  # an external sink may hold it: never act on it blind
                raise BatchStateError(
                    f"batch {batch.batch_id}: pipeline {batch.pipeline}'s config was not "
                    f"found ({e}), so its sink cannot be asked whether it already holds the "
                    f"batch (a Kafka topic or Iceberg table would then get its records "
                    f"twice). Pass --pipeline-file FILE"
                    f"{'' if unchecked is None else ', or --unchecked if the sink is PostgreSQL'}"
                ) from e
            log.warning("pipeline %s's config was not found; batch %d is abandoned "
                        "without asking its sink (--unchecked)", batch.pipeline,
                        batch.batch_id)
            cfg = None
    if cfg is not None and cfg.name != batch.pipeline:
        raise BatchStateError(f"batch {batch.batch_id} belongs to pipeline "
                              f"{batch.pipeline}, not {cfg.name}")
    return cfg


def cmd_abandon(args: argparse.Namespace) -> int:
    """An external sink (Kafka topic, Iceberg table) may hold the batch already (its run
    died after the sink's commit): abandoning it would plan its ranges again and write them
    to the sink twice, so that is refused; running it again completes it."""
    from offsetflow.commit import sink_holds
    from offsetflow.errors import BatchStateError
    from offsetflow.sinks import external_sink

    with Ledger(dsn_of(args)) as ledger:
        cfg = _batch_pipeline(args, ledger.get_batch(args.batch_id))
        sink = external_sink(cfg, ledger.dsn) if cfg is not None else None
        with ledger.transaction() as cur:
            # the batch row first: no run's commit can land in the sink between the check
            # and the abandon (one in progress is waited for, then the sink is asked)
            batch = ledger.get_batch(args.batch_id, cur, for_update=True)
            if sink is not None and batch.is_open and sink_holds(ledger.dsn, batch, sink):
                raise BatchStateError(
                    f"batch {args.batch_id} is not abandoned: its sink already holds it (a "
                    f"run died after the sink's commit, before the ledger's), and abandoning "
                    f"it would write its records twice. Run it again to complete it: "
                    f"offsetflow run-batch --pipeline {batch.pipeline} --batch-id "
                    f"{args.batch_id} (if its records are gone from Kafka and its stage, "
                    f"offsetflow complete --batch-id {args.batch_id} --reason '...')")
            ledger.abandon(args.batch_id, args.reason, cur)
    print(f"batch {args.batch_id} abandoned; its staged data was dropped")
    return 0


def cmd_complete(args: argparse.Namespace) -> int:
    """`offsetflow.ops.complete`: a batch its external sink holds, completed from the sink's
    record when it can be neither run (records gone) nor abandoned (the sink holds it)."""
    from offsetflow.commit import CommitSpec
    from offsetflow.ops import complete_from_sink, unreadable_in
    from offsetflow.sinks import sink_for

    with Ledger(dsn_of(args)) as ledger:
        batch = ledger.get_batch(args.batch_id)
        cfg = _batch_pipeline(args, batch)
        assert cfg is not None  # (not found: refused, `complete` offers no --unchecked)
        # refused where the sink keeps no record to complete from (PostgreSQL), or cannot
        sink = sink_for(cfg).complete_from(ledger.dsn, batch)
        # only where the staged parts' bad records go: the run's whole spec would make an
        # Iceberg replay's find replace the window's dead letters
        dead = CommitSpec(columns=(), dead_letter_table=cfg.dead_letter_table,
                          bad_records_staged=cfg.bad_records == "dead_letter")
        result = complete_from_sink(ledger, args.batch_id, sink, args.reason,
                                    unreadable_in(cfg), cfg.spark.max_offsets_per_task, dead)
    print(result.message if result.status != "committed" else
          f"batch {args.batch_id} completed from its sink's record: {result.rows_written} "
          f"rows there; positions advanced")
    return 0


def cmd_adopt_table(args: argparse.Namespace) -> int:
    """The table now found under the pipeline's sink table (or a backfill's
    `--target-table`) becomes the one its batches live in: after a table was replaced, moved
    to another catalog, or renamed in the config on purpose. The batches committed into the
    table recorded before stay there; the command says which."""
    from offsetflow.sinks import sink_for

    cfg = pipeline_of(args)
    with Ledger(dsn_of(args, cfg)) as ledger:
        print(sink_for(cfg).adopt_target(ledger.dsn, args.target_table, args.reason))
    return 0


def cmd_reset_position(args: argparse.Namespace) -> int:
    """Set positions and record the topic's current Kafka id with them: after a topic was
    recreated, planning accepts only positions that carry the new id."""
    from offsetflow.config import validate_table_name
    from offsetflow.ops import kafka_for, reset_positions
    from offsetflow.sinks import sink_for

    cfg = pipeline_of(args)
    if args.offset < 0:
        raise ConfigError("command line", "--offset", f"must be >= 0, got {args.offset}")
    if args.archive_to is not None:
        validate_table_name("command line", "--archive-to", args.archive_to)
    kafka = kafka_for(cfg)
    kafka.topics([args.topic])  # an unknown topic is an error naming it
    # None where the broker keeps no topic ids (recorded as such; identity is not checked)
    topic_id = kafka.topic_ids([args.topic]).get(args.topic)
    with Ledger(dsn_of(args, cfg)) as ledger:
        if args.all_partitions:
            known = {p for t, p in ledger.positions(cfg.name) if t == args.topic}
            partitions = sorted(known | {p for _, p in kafka.partitions([args.topic])})
        else:
            partitions = [args.partition]
        sink = sink_for(cfg)
        moved = reset_positions(ledger, cfg.name, args.topic, partitions, args.offset,
                                args.reason, topic_id=topic_id,
                                # rows that could collide (a PostgreSQL append's)
                                target_table=sink.reset_rows_table,
                                archive_to=args.archive_to,
                                dead_letter_table=cfg.dead_letter_table,
                                live_topic=None if args.allow_duplicates else sink.live_topic,
                                # e.g. an Iceberg table's rows beyond (no coordinates index)
                                check_sink=None if args.force else sink.reset_check(
                                    dsn_of(args, cfg), args.topic, partitions, args.offset))
    for p in partitions:
        print(f"{cfg.name}: {args.topic}[{p}] position set to {args.offset} "
              f"(topic id {topic_id} recorded)")
    if moved:
        print(f"{cfg.name}: moved {moved} rows of {args.topic} at offsets >= {args.offset} "
              f"from {cfg.sink.table} to {args.archive_to} (its dead letters in "
              f"{cfg.dead_letter_table}, if any, to {args.archive_to}_dead_letter)")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    with Ledger(dsn_of(args)) as ledger:
        dropped = ledger.cleanup_staging(getattr(args, "task_files", None))
    print(f"dropped staged data of {len(dropped)} closed batch(es)"
          + (f": {dropped}" if dropped else ""))
    return 0
