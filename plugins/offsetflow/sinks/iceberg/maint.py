"""Upkeep of an Iceberg sink table: data files no snapshot references (written by an
attempt that died before its catalog commit) are removed, and old snapshots expired, but
never one that an open batch may still have to find.

    python -m offsetflow.sinks.iceberg.maint --pipeline-file include/pipelines/x.yaml \\
        [--orphans-older-than-hours 72] [--expire-snapshots-older-than-days N]

The orphan sweep deletes every unreferenced data file older than its age, whoever wrote it:
never give it an age shorter than the longest write of any writer of the table (a Spark
compaction, a large backfill), or it deletes files that writer is about to commit. The
sweep a retried batch runs on its own deletes only that batch's files (its name prefix).

Snapshot expiry keeps every snapshot younger than the oldest open (planned, running or
failed) batch of the pipeline, and main's chain from the oldest snapshot naming an open
batch on (no clock involved): that batch may have committed to Iceberg and died before
the ledger did, and its retry finds its snapshot among main's ancestors to not append again.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from offsetflow.config import PipelineConfig, load_pipeline, resolve_identifier
from offsetflow.errors import ConfigError, PositionResetError
from offsetflow.ledger import Batch, Ledger
from offsetflow.sinks.iceberg.files import (
    batch_file_prefix,
    remove_batch_orphans,
    remove_orphan_files,
)
from offsetflow.sinks.iceberg.sink import load_catalog

if TYPE_CHECKING:
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

# the maintenance command's default age of an unreferenced file it deletes (Java Iceberg's
# deleteOrphanFiles keeps 3 days): another writer's files stay unreferenced until its commit
ORPHAN_AGE_HOURS = 72.0
# kept for callers of the earlier automatic sweep (it now matches the batch's own files)
ORPHAN_GRACE_S = 600.0


def sink_table(cfg: PipelineConfig, dsn: str, identifier: str | None = None) -> Table:
    if cfg.sink.iceberg is None:
        raise ConfigError(cfg.source_file, "sink.type", "is not iceberg")
    return load_catalog(cfg.sink.iceberg, cfg.sink.connection or dsn).load_table(
        identifier or cfg.sink.iceberg.identifier)


def sweep_after_retry(cfg: PipelineConfig, dsn: str, batch_id: int) -> None:
    """Best effort after a retried batch committed: a failure here never fails it. Only
    data files named with THIS batch's prefix and referenced by no snapshot go (its dead
    attempts', or its conflict losers'); a zombie attempt of it cannot commit any more
    (its commit asserts a main the committed batch moved), so their age does not matter."""
    try:
        with Ledger(dsn) as ledger:
            batch: Batch = ledger.get_batch(batch_id)
        table = sink_table(cfg, dsn, _identifier(cfg, batch))
        removed = remove_orphan_files(table, 0, prefix=batch_file_prefix(batch))
        if removed:
            log.info("batch %d: removed %d data files of dead attempts", batch_id, len(removed))
    except Exception as e:  # noqa: BLE001
        log.warning("batch %d: could not sweep orphan data files (the maintenance command "
                    "does it later): %s", batch_id, e)


def sweep_batch_orphans(cfg: PipelineConfig, dsn: str, batch_id: int) -> None:
    """Best effort after a batch whose tasks wrote its data files committed: its task
    attempts that died or lost their marker (a Spark retry, a speculative or zombie
    attempt) left files no snapshot adds; they go now (`remove_batch_orphans`). A zombie
    that writes on after this leaves orphans to the maintenance command."""
    try:
        with Ledger(dsn) as ledger:
            batch: Batch = ledger.get_batch(batch_id)
        remove_batch_orphans(sink_table(cfg, dsn, _identifier(cfg, batch)), batch)
    except Exception as e:  # noqa: BLE001
        log.warning("batch %d: could not sweep orphan data files (the maintenance command "
                    "does it later): %s", batch_id, e)


def _identifier(cfg: PipelineConfig, batch: Batch) -> str:
    """The Iceberg table the batch wrote (a backfill may name its own)."""
    assert cfg.sink.iceberg is not None
    return resolve_identifier(cfg.sink.iceberg, cfg.sink.table, batch.target_table)


def refuse_rows_beyond(cfg: PipelineConfig, dsn: str, topic: str, partitions: Sequence[int],
                       offset: int) -> None:
    """`reset-position` on an Iceberg sink: the table has no coordinates index, so rows at
    or beyond the new position would be appended again by the next batches; refuse."""
    from pyiceberg import expressions
    from pyiceberg.exceptions import NoSuchTableError

    ex: Any = expressions
    try:
        table = sink_table(cfg, dsn)
    except NoSuchTableError:
        return
    rows = table.scan(row_filter=ex.And(ex.EqualTo("topic", topic),
                                        ex.In("partition", set(partitions)),
                                        ex.GreaterThanOrEqual("offset", offset)),
                      selected_fields=("partition",)).to_arrow()
    if not rows.num_rows:
        return
    found = sorted({int(p) for p in rows["partition"].to_pylist()})
    table_id = ".".join(table.name())
    raise PositionResetError(
        f"Iceberg table {table_id} holds {rows.num_rows} rows of {topic} at offsets >= {offset} "
        f"(partition(s) {found}); an Iceberg table has no coordinates index, so the batches "
        f"read from offset {offset} on would append them again. Nothing was changed. Give "
        f"--force to reset anyway (both copies are kept: e.g. after the topic was recreated), "
        f"delete those rows from the table first, or choose another offset "
        f"(--archive-to moves PostgreSQL sink rows and dead letters only)")


def oldest_open_batch_start(dsn: str, pipeline: str) -> datetime | None:
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        cur.execute("""SELECT min(planned_at) FROM offsetflow.batches
                        WHERE pipeline = %s AND status IN ('planned', 'running', 'failed')""",
                    (pipeline,))
        row = cur.fetchone()
    return row[0] if row else None


def open_batch_ids(dsn: str, pipeline: str) -> set[int]:
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        cur.execute("""SELECT batch_id FROM offsetflow.batches
                        WHERE pipeline = %s AND status IN ('planned', 'running', 'failed')""",
                    (pipeline,))
        return {int(r[0]) for r in cur.fetchall()}


def chain_kept_for(table: Table, pipeline: str, open_ids: set[int]) -> set[int]:
    """Snapshot ids of main's chain from the oldest ancestor naming an open batch of the
    pipeline up to the current one: that batch's retry walks this chain to find its
    snapshot (an expired link would end the walk early), whatever the clocks say."""
    from pyiceberg.table.snapshots import ancestors_of

    from offsetflow.config import SUMMARY_BATCH, SUMMARY_PIPELINE

    chain, keep_upto = [], -1
    for i, snap in enumerate(ancestors_of(table.current_snapshot(), table.metadata)):
        chain.append(snap.snapshot_id)
        props = snap.summary.additional_properties if snap.summary else {}
        if props.get(SUMMARY_PIPELINE) == pipeline and \
                props.get(SUMMARY_BATCH, "").isdigit() and int(props[SUMMARY_BATCH]) in open_ids:
            keep_upto = i
    return set(chain[:keep_upto + 1])


def expire_snapshots(cfg: PipelineConfig, dsn: str, older_than: datetime) -> int:
    """Expire main's snapshots older than `older_than`, but none younger than the oldest
    open batch, nor any of main's chain from the oldest ancestor naming an open batch on
    (the time floor alone compares the database's clock with the writers'); the current
    snapshot always stays. Returns how many were expired."""
    open_since = oldest_open_batch_start(dsn, cfg.name)
    if open_since is not None:
        older_than = min(older_than, open_since)
    table = sink_table(cfg, dsn)
    current = table.current_snapshot()
    keep = chain_kept_for(table, cfg.name, open_batch_ids(dsn, cfg.name))
    cutoff_ms = int(older_than.timestamp() * 1000)
    ids = [s.snapshot_id for s in table.snapshots()
           if s.timestamp_ms < cutoff_ms and s.snapshot_id not in keep
           and (current is None or s.snapshot_id != current.snapshot_id)]
    if ids:
        table.maintenance.expire_snapshots().by_ids(ids).commit()
    return len(ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m offsetflow.sinks.iceberg.maint",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline-file", required=True)
    ap.add_argument("--dsn", default=os.environ.get("OFFSETFLOW_PG_DSN"),
                    help="the ledger (default $OFFSETFLOW_PG_DSN)")
    ap.add_argument("--orphans-older-than-hours", type=float, default=ORPHAN_AGE_HOURS,
                    help="age of an unreferenced data file to delete; never shorter than "
                         "the longest write of any writer of the table")
    ap.add_argument("--expire-snapshots-older-than-days", type=float, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_pipeline(args.pipeline_file)
    if not args.dsn:
        ap.error("give --dsn or set OFFSETFLOW_PG_DSN")
    if args.expire_snapshots_older_than_days is not None:
        n = expire_snapshots(cfg, args.dsn, datetime.now(UTC) - timedelta(
            days=args.expire_snapshots_older_than_days))
        print(f"expired {n} snapshots")
    removed = remove_orphan_files(sink_table(cfg, args.dsn),
                                  args.orphans_older_than_hours * 3600)
    print(f"removed {len(removed)} orphan data files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
