"""Upkeep of an Iceberg sink table: data files no snapshot references (written by an
attempt that died before its catalog commit) are removed, and old snapshots expired, but
never one that an open batch may still have to find.

    python -m offsetflow.sinks.iceberg.maint --pipeline-file include/pipelines/x.yaml \\
        [--orphans-older-than-hours 72] [--expire-snapshots-older-than-days N]

Nothing here acts on a table that is not the one the ledger's batches live in
(`sink_iceberg_identity`): a table dropped and created again, registered from other
metadata or found through another catalog is refused (IcebergTableIdentityError, exit 2).

The orphan sweep deletes every unreferenced data file older than its age, whoever wrote it,
except the files another table whose metadata lies at the same location references (a
table dropped without purge, whose metadata can be registered again) and those the tasks
of this ledger's open batches listed in their markers (their commits add them): never give
it an age shorter than the longest write of any other writer of the table (a Spark
compaction, a large backfill, another ledger's open batch), or it deletes files that writer
is about to commit. The sweep a retried batch runs on its own deletes only that batch's
files (its name prefix).

Snapshot expiry keeps every snapshot younger than the oldest open (planned, running or
failed) batch of the pipeline, and main's chain from the oldest snapshot an open batch of
ANY pipeline writing the table may need on (no clock involved): that batch may have
committed to Iceberg and died before its ledger did, and its retry finds its snapshot
among main's ancestors to not append again. This ledger's batches are asked for; another
ledger's are told by the snapshots (`kept_for_open_batches`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from offsetflow.config import PipelineConfig, load_pipeline
from offsetflow.errors import ConfigError, OffsetFlowError, PositionResetError
from offsetflow.ledger import OPEN_STATUSES, Batch, Ledger, ledger_identity
from offsetflow.sinks.iceberg.audit import open_audit_snapshots
from offsetflow.sinks.iceberg.files import (
    batch_file_prefix,
    canonical_path,
    remove_batch_orphans,
    remove_orphan_files,
)
from offsetflow.sinks.iceberg.sink import batch_identifier, sink_of

if TYPE_CHECKING:
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

# the maintenance command's default age of an unreferenced file it deletes (Java Iceberg's
# deleteOrphanFiles keeps 3 days): another writer's files stay unreferenced until its commit
ORPHAN_AGE_HOURS = 72.0
# kept for callers of the earlier automatic sweep (it now matches the batch's own files)
ORPHAN_GRACE_S = 600.0


def sink_table(cfg: PipelineConfig, dsn: str, identifier: str | None = None) -> Table | None:
    """The pipeline's table (or a backfill's), if it exists, checked to be the one the
    ledger's batches live in (`sink_iceberg_identity`: else IcebergTableIdentityError):
    maintenance never acts on a table that is not the ledger's."""
    if cfg.sink.iceberg is None:
        raise ConfigError(cfg.source_file, "sink.type", "is not iceberg")
    sink = sink_of(cfg, dsn)
    try:
        return sink.existing_table(identifier or cfg.sink.iceberg.identifier)
    finally:
        sink.close()


def sweep_after_retry(cfg: PipelineConfig, dsn: str, batch_id: int) -> None:
    """Best effort after a retried batch committed: a failure here never fails it. Only
    data files named with THIS batch's prefix and referenced by no snapshot (of this table,
    nor of another whose metadata lies at its location) go: its dead attempts', or its
    conflict losers'; a zombie attempt of it cannot commit any more (its commit asserts a
    main the committed batch moved), so their age does not matter."""
    try:
        with Ledger(dsn) as ledger:
            batch: Batch = ledger.get_batch(batch_id)
        table = sink_table(cfg, dsn, _identifier(cfg, batch))
        if table is None:
            return
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
        table = sink_table(cfg, dsn, _identifier(cfg, batch))
        if table is not None:
            remove_batch_orphans(table, batch)
    except Exception as e:  # noqa: BLE001
        log.warning("batch %d: could not sweep orphan data files (the maintenance command "
                    "does it later): %s", batch_id, e)


def _identifier(cfg: PipelineConfig, batch: Batch) -> str:
    """The Iceberg table the batch wrote (a backfill may name its own)."""
    assert cfg.sink.iceberg is not None
    return batch_identifier(cfg.sink.iceberg, cfg.sink.table, batch)


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
    if table is None:  # no table (and the ledger holds no batch that should be in one)
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


def kept_for_open_batches(table: Table, dsn: str,
                          closed: frozenset[str] = frozenset()) -> tuple[set[int], str]:
    """Snapshot ids of main's chain from the oldest ancestor that may be an open batch's,
    of any pipeline, up to the current one (a batch's retry walks this chain to find its
    snapshot, and an expired link ends the walk early, so it would append the batch
    again), and which batch that is, in words ("" none). Call it after loading `table`:
    every batch with a snapshot there was planned before, so the ledger shows it if open.

    A snapshot this ledger committed (its id in the summary; or none recorded, of a
    pipeline this ledger runs) is open when this ledger says its batch is. Another
    ledger's cannot be asked: its newest snapshot on main records the writer's oldest batch
    open when it committed (`offsetflow.open-floor`), and every snapshot of that writer
    from that batch on may be open (without it, written before it was recorded: the
    newest one). `closed`: writers (`<ledger id>:<pipeline>`) the operator says have no
    open batch (e.g. it no longer writes the table, so its newest snapshot would hold
    expiry back for good)."""
    from pyiceberg.table.snapshots import ancestors_of

    from offsetflow.config import SUMMARY_PIPELINE

    chain = [(s.snapshot_id, s.summary.additional_properties if s.summary else {})
             for s in ancestors_of(table.current_snapshot(), table.metadata)]
    named = sorted({p[SUMMARY_PIPELINE] for _, p in chain if SUMMARY_PIPELINE in p})
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        me = ledger_identity(cur).installation_id
        cur.execute("""SELECT pipeline, batch_id FROM offsetflow.batches
                        WHERE pipeline = ANY(%s) AND status IN %s""",
                    (named, OPEN_STATUSES))
        open_here = {(str(p), int(b)) for p, b in cur.fetchall()}
        cur.execute("""SELECT p FROM unnest(%s::text[]) p
                        WHERE EXISTS (SELECT 1 FROM offsetflow.batches WHERE pipeline = p)""",
                    (named,))
        runs_here = {str(r[0]) for r in cur.fetchall()}
    upto, why = oldest_needed([p for _, p in chain], me, open_here, runs_here, closed)
    return {sid for sid, _ in chain[:upto + 1]}, why


def oldest_needed(chain: Sequence[Mapping[str, str]], me: str,
                  open_here: set[tuple[str, int]], runs_here: set[str],
                  closed: frozenset[str] = frozenset()) -> tuple[int, str]:
    """The index in `chain` (main's snapshots' summaries, newest first) of the oldest one an
    open batch may need (-1: none), and why (see `kept_for_open_batches`). Pure."""
    from offsetflow.config import (
        SUMMARY_BATCH,
        SUMMARY_LEDGER,
        SUMMARY_OPEN_FLOOR,
        SUMMARY_PIPELINE,
    )

    floors: dict[tuple[str, str], int] = {}
    keep_upto, why = -1, ""
    for i, props in enumerate(chain):
        pipeline, bid = props.get(SUMMARY_PIPELINE), props.get(SUMMARY_BATCH, "")
        if pipeline is None or not bid.isdigit():
            continue
        batch_id, ledger_id = int(bid), props.get(SUMMARY_LEDGER)
        if ledger_id == me or (ledger_id is None and pipeline in runs_here):
            if (pipeline, batch_id) in open_here:
                keep_upto, why = i, f"batch {batch_id} of pipeline {pipeline} is open"
            continue
        writer = (ledger_id or "", pipeline)
        if f"{writer[0]}:{pipeline}" in closed:
            continue
        if writer not in floors:  # its newest snapshot: the first met
            floor = props.get(SUMMARY_OPEN_FLOOR, "")
            floors[writer] = int(floor) if floor.isdigit() else batch_id
        if batch_id >= floors[writer]:
            keep_upto, why = i, (f"batch {batch_id} of pipeline {pipeline} of another ledger "
                                 f"({ledger_id or 'not recorded'}) may be open (if that "
                                 f"writer has no open batch, e.g. it no longer writes the "
                                 f"table: --closed-writer {writer[0]}:{pipeline})")
    return keep_upto, why


def expire_snapshots(cfg: PipelineConfig, dsn: str, older_than: datetime,
                     closed: frozenset[str] = frozenset()) -> int:
    """Expire snapshots older than `older_than`, but none younger than the pipeline's
    oldest open batch, nor any of main's chain from the oldest ancestor an open batch of
    any pipeline (of this ledger, or of another as the snapshots tell) may need
    (`kept_for_open_batches`; the time floor alone compares the database's clock with the
    writers'); the current snapshot, every branch's or tag's head and an audit branch's own
    snapshots always stay. Returns how many were expired."""
    open_since = oldest_open_batch_start(dsn, cfg.name)
    if open_since is not None:
        older_than = min(older_than, open_since)
    table = sink_table(cfg, dsn)
    if table is None:
        return 0
    keep, why = kept_for_open_batches(table, dsn, closed)  # after the load (see there)
    if why:
        log.info("expiry keeps main's %d newest snapshots: %s", len(keep), why)
    keep |= {ref.snapshot_id for ref in table.metadata.refs.values()}
    keep |= open_audit_snapshots(table)  # an audited window's, until publish or discard
    cutoff_ms = int(older_than.timestamp() * 1000)
    ids = [s.snapshot_id for s in table.snapshots()
           if s.timestamp_ms < cutoff_ms and s.snapshot_id not in keep]
    if ids:
        table.maintenance.expire_snapshots().by_ids(ids).commit()
    return len(ids)


def open_batch_files(dsn: str) -> set[str]:
    """Canonical paths of the data files the tasks of open batches (any pipeline of this
    ledger) listed in their markers: committed by those batches' commits, not orphans."""
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        cur.execute("""SELECT p.data_files FROM offsetflow.staged_parts p
                         JOIN offsetflow.batches b USING (batch_id)
                        WHERE b.status IN %s AND p.data_files IS NOT NULL""",
                    (OPEN_STATUSES,))
        return {canonical_path(f["path"]) for (files,) in cur.fetchall() for f in files}


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
    ap.add_argument("--closed-writer", action="append", default=[], metavar="LEDGER:PIPELINE",
                    help="a writer of another ledger that has no open batch (it no longer "
                         "writes the table): expiry stops keeping its newest snapshots; "
                         "the log names the one that holds expiry back")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_pipeline(args.pipeline_file)
    if not args.dsn:
        ap.error("give --dsn or set OFFSETFLOW_PG_DSN")
    try:
        if args.expire_snapshots_older_than_days is not None:
            n = expire_snapshots(cfg, args.dsn, datetime.now(UTC) - timedelta(
                days=args.expire_snapshots_older_than_days), frozenset(args.closed_writer))
            print(f"expired {n} snapshots")
        table = sink_table(cfg, args.dsn)
        if table is None:
            print("no table: nothing to sweep")
            return 0
        removed = remove_orphan_files(table, args.orphans_older_than_hours * 3600,
                                      keep=open_batch_files(args.dsn))
    except OffsetFlowError as e:
        print(f"offsetflow maintenance: error: {e}", file=sys.stderr)
        return 2
    print(f"removed {len(removed)} orphan data files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
