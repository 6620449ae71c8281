"""Which Iceberg table a pipeline's batches live in (migration 0010, `offsetflow.table_identities`).

A name in a catalog is not a table: a table dropped by mistake, renamed, dropped and created
again, registered from an older metadata file, or reached through another catalog,
namespace or table name (a config edit) answers to a name the sink knows, or to none, while
the batches the ledger committed live in another table. Writing on would create or fill a
table without them and carry on (and a maintenance sweep of the new table would take the old
one's files for orphans).

So the ledger records the table's identity when the pipeline first creates or uses it: its
Iceberg table-uuid, location, catalog and identifier, and after each batch's commit (in the
commit's own ledger transaction) the metadata file, last-sequence-number and snapshot of
that commit. Every run (before it reads or creates anything), every commit (before `find`
and before the catalog commit), and maintenance compare the table they find with it
(`check`); a table that is not the ledger's is refused with `IcebergTableIdentityError`,
naming both and the ways out. Taken as the same table: the recorded table-uuid and
location, through the recorded catalog, with a history at least as new as the ledger's last
commit (its sequence number) that still has that commit on main. Its identifier may differ
(renamed in the catalog, and `sink.table` following it) unless the recorded name still holds
the same table (two registrations of one table's metadata fork its history).

A table the ledger committed no batch into yet is re-recorded when it changes (nothing of
the ledger's is lost); the first batch of a new pipeline creates and records its table. A
missing table is created only then: with committed batches it is refused, not recreated.
`offsetflow adopt-table` (`adopt_table`) is the operator's way to make another table the
pipeline's; the record keeps the earlier identities in `history`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg2.extensions

from offsetflow.errors import IcebergTableIdentityError

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

    from offsetflow.ledger import Batch

log = logging.getLogger(__name__)

OWN = ""  # the record's target for the pipeline's own table (sink.table)
_COLUMNS = ("pipeline, target, identifier, catalog, table_uuid, location, metadata_location, "
            "last_sequence_number, last_snapshot_id, last_batch_id")


@dataclass(frozen=True)
class Record:
    """The ledger's record of a pipeline's table (one row of `offsetflow.table_identities`)."""

    pipeline: str
    target: str
    identifier: str
    catalog: str
    table_uuid: str | None
    location: str | None
    metadata_location: str | None = None
    last_sequence_number: int | None = None
    last_snapshot_id: int | None = None
    last_batch_id: int | None = None

    def __str__(self) -> str:
        if self.table_uuid is None:
            return f"no table yet (the next run takes {self.identifier} in {self.catalog})"
        out = (f"{self.identifier} with table-uuid {self.table_uuid} at location "
               f"{self.location} in the {self.catalog}")
        if self.last_batch_id is not None:
            out += (f", its batches up to {self.last_batch_id} (last commit's metadata file "
                    f"{self.metadata_location}, last-sequence-number "
                    f"{self.last_sequence_number})")
        else:
            out += ", no batch committed into it yet"
        return out


@dataclass(frozen=True)
class Seen:
    """A table as the sink finds it now."""

    identifier: str
    catalog: str
    table_uuid: str
    location: str
    metadata_location: str
    last_sequence_number: int
    # the record's last snapshot: "main" (on main's chain), "off-main" (in the table, not on
    # main: main was rolled back past it), "forked" (not in the table, and main's chain
    # reaches a snapshot as old or older by sequence number without passing it: the table
    # went on from an older metadata file), "gone" (expired, or none recorded)
    last_snapshot: str = "gone"

    def __str__(self) -> str:
        return (f"{self.identifier} with table-uuid {self.table_uuid} at location "
                f"{self.location} in the {self.catalog} (metadata file "
                f"{self.metadata_location}, last-sequence-number "
                f"{self.last_sequence_number})")


def seen(table: Table, identifier: str, catalog: str, last_snapshot_id: int | None = None,
         rec: Record | None = None, ledger: str | None = None) -> Seen:
    from pyiceberg.table.snapshots import ancestors_of

    where = "gone"
    if last_snapshot_id is not None and table.snapshot_by_id(last_snapshot_id) is not None:
        where = "off-main"
        for snap in ancestors_of(table.current_snapshot(), table.metadata):
            if snap.snapshot_id == last_snapshot_id:
                where = "main"
                break
    elif last_snapshot_id is not None and rec is not None and _forked_past(table, rec, ledger):
        where = "forked"
    return Seen(identifier, catalog, str(table.metadata.table_uuid), table.location(),
                str(table.metadata_location), sequence_number(table), where)


def _forked_past(table: Table, rec: Record, ledger: str | None) -> bool:
    """Whether main's chain, without the recorded snapshot (not in the table), reaches an
    earlier batch of the pipeline committed before the recorded commit (sequence number
    not above the recorded last-sequence-number): were the recorded snapshot an expired
    ancestor, the walk would end at its child (an expired link) before any such snapshot;
    reaching one means main never held it (registered from older metadata and written to
    since, or rolled back past it and that snapshot expired). Only the pipeline's own
    snapshots count: another writer's after the recorded one may be older than the
    recorded last-sequence-number and stay when the recorded snapshot expires."""
    from pyiceberg.table.snapshots import ancestors_of

    from offsetflow.config import SUMMARY_BATCH, SUMMARY_LEDGER, SUMMARY_PIPELINE

    if not rec.last_sequence_number or rec.last_batch_id is None:
        return False  # format v1 (no sequence numbers), or no batch recorded
    for snap in ancestors_of(table.current_snapshot(), table.metadata):
        props = snap.summary.additional_properties if snap.summary else {}
        bid = props.get(SUMMARY_BATCH, "")
        if (snap.sequence_number or 0) and snap.sequence_number <= rec.last_sequence_number \
                and props.get(SUMMARY_PIPELINE) == rec.pipeline and bid.isdigit() \
                and int(bid) < rec.last_batch_id \
                and props.get(SUMMARY_LEDGER, ledger) == ledger:
            return True
    return False


def sequence_number(table: Table) -> int:
    """The table's last-sequence-number (0 in format v1, which has none: not compared)."""
    return int(getattr(table.metadata, "last_sequence_number", 0) or 0)


def _loc(location: str | None) -> str:
    return (location or "").rstrip("/")


def differences(rec: Record, now: Seen) -> list[str]:
    """How the table found differs from the ledger's record, in words (nothing: the same
    table, maybe under another name). Pure: the tests of the rule need no services."""
    if rec.table_uuid is None:
        return []
    if now.table_uuid != rec.table_uuid:
        return [f"another table (table-uuid {now.table_uuid}, not {rec.table_uuid}): "
                f"dropped and created again, or another table under that name"]
    out = []
    if _loc(now.location) != _loc(rec.location):
        out.append(f"its location changed to {now.location}")
    if now.catalog != rec.catalog:
        out.append(f"it is reached through the {now.catalog}, not the ledger's {rec.catalog} "
                   f"(two catalog entries of one table fork its history)")
    if rec.last_sequence_number and now.last_sequence_number < rec.last_sequence_number:
        out.append(f"its history ends before the ledger's last commit (last-sequence-number "
                   f"{now.last_sequence_number} < {rec.last_sequence_number}): registered "
                   f"from an older metadata file than {rec.metadata_location}")
    elif now.last_snapshot == "forked":
        out.append(f"its history does not hold the ledger's last batch {rec.last_batch_id} "
                   f"(its snapshot {rec.last_snapshot_id}, sequence number "
                   f"{rec.last_sequence_number}): main goes back past it on another line "
                   f"(registered from an older metadata file than {rec.metadata_location} "
                   f"and written to since, or rolled back past it and that snapshot "
                   f"expired)")
    elif now.last_snapshot == "off-main":
        out.append(f"main was rolled back past the ledger's last batch {rec.last_batch_id} "
                   f"(its snapshot {rec.last_snapshot_id} is no longer on main)")
    return out


def load(cur: psycopg2.extensions.cursor, pipeline: str, target: str, lock: bool
         ) -> Record | None:
    """The record, row-locked with `lock` (a commit, or an adopt, holds it to its end)."""
    cur.execute(f"SELECT {_COLUMNS} FROM offsetflow.table_identities "  # noqa: S608 - constants
                f"WHERE pipeline = %s AND target = %s{' FOR UPDATE' if lock else ''}",
                (pipeline, target))
    row = cur.fetchone()
    return None if row is None else Record(*row)


def record(cur: psycopg2.extensions.cursor, rec: Record, why: str | None = None) -> None:
    """Insert or replace the record (`why`: the replaced identity goes to its history)."""
    entry = None
    if why is not None:
        old = load(cur, rec.pipeline, rec.target, lock=True)
        entry = json.dumps([{"why": why, "was": None if old is None else {
            "identifier": old.identifier, "catalog": old.catalog,
            "table_uuid": old.table_uuid, "location": old.location,
            "metadata_location": old.metadata_location, "last_batch_id": old.last_batch_id}}])
    cur.execute("""INSERT INTO offsetflow.table_identities AS t
                       (pipeline, target, identifier, catalog, table_uuid, location,
                        metadata_location, last_sequence_number, last_snapshot_id,
                        last_batch_id)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
                   ON CONFLICT (pipeline, target) DO UPDATE SET
                       identifier = EXCLUDED.identifier, catalog = EXCLUDED.catalog,
                       table_uuid = EXCLUDED.table_uuid, location = EXCLUDED.location,
                       metadata_location = EXCLUDED.metadata_location,
                       last_sequence_number = EXCLUDED.last_sequence_number,
                       last_snapshot_id = EXCLUDED.last_snapshot_id,
                       last_batch_id = EXCLUDED.last_batch_id, updated_at = now(),
                       history = t.history || COALESCE(%s::jsonb, '[]'::jsonb)""",
                (rec.pipeline, rec.target, rec.identifier, rec.catalog, rec.table_uuid,
                 rec.location, rec.metadata_location, rec.last_sequence_number,
                 rec.last_snapshot_id, rec.last_batch_id, entry))


def record_seen(cur: psycopg2.extensions.cursor, pipeline: str, target: str, now: Seen,
                why: str | None = None) -> None:
    """`now` becomes the pipeline's table, with no batch committed into it yet."""
    record(cur, Record(pipeline, target, now.identifier, now.catalog, now.table_uuid,
                       now.location, now.metadata_location, now.last_sequence_number),
           why)


def record_commit(cur: psycopg2.extensions.cursor, pipeline: str, target: str, table: Table,
                  batch: Batch, snapshot_id: int | None) -> None:
    """In the batch's commit transaction (the record is row-locked since `check`): the
    table's metadata after the batch's catalog commit, so a restore knows which file holds
    every batch the ledger committed, and a re-registration of an older one is refused."""
    cur.execute("""UPDATE offsetflow.table_identities
                      SET metadata_location = %s, last_sequence_number = %s,
                          last_snapshot_id = %s, last_batch_id = %s, updated_at = now()
                    WHERE pipeline = %s AND target = %s AND table_uuid = %s""",
                (str(table.metadata_location), sequence_number(table),
                 snapshot_id, batch.batch_id, pipeline, target, str(table.metadata.table_uuid)))


def committed_into(cur: psycopg2.extensions.cursor, pipeline: str, own: bool,
                   resolves_here: Callable[[str], bool]) -> tuple[int, int | None]:
    """(count, last id) of the pipeline's committed batches that wrote this table by their
    target (`own`: the pipeline's own table, where its live batches and replays go)."""
    cur.execute("""SELECT kind, target_table, count(*), max(batch_id)
                     FROM offsetflow.batches
                    WHERE pipeline = %s AND status = 'committed'
                    GROUP BY 1, 2""", (pipeline,))
    n, last = 0, None
    for kind, target, count, top in cur.fetchall():
        if (own and kind != "backfill") or resolves_here(target):
            n += int(count)
            last = max(int(top), last or 0)
    return n, last


def holds_pipeline(table: Table, pipeline: str, ledger: str) -> bool:
    """Whether any snapshot of the table names a batch of this pipeline and ledger (or of
    no ledger: written before the ledger's id was recorded)."""
    from offsetflow.config import SUMMARY_LEDGER, SUMMARY_PIPELINE

    for snap in table.snapshots():
        props = snap.summary.additional_properties if snap.summary else {}
        if props.get(SUMMARY_PIPELINE) == pipeline and \
                props.get(SUMMARY_LEDGER, ledger) == ledger:
            return True
    return False


@dataclass
class Check:
    """What `check` needs to know about the sink (`IcebergSink` builds it)."""

    pipeline: str
    target: str
    identifier: str  # the table as configured (or as a backfill named it)
    catalog_label: str
    catalog: Catalog
    ledger_id: str
    resolves_here: Callable[[str], bool]
    adopt_hint: str  # the adopt-table command line for this pipeline and target


def check(cur: psycopg2.extensions.cursor, c: Check, table: Table | None) -> bool:
    """Compare `table` (None: no table of that name) with the ledger's record, holding the
    record row-locked until `cur`'s transaction ends. Returns True when the caller may
    create the table (no table, and the ledger holds no batch that should be in one), after
    which it calls `created`; False when `table` is the pipeline's (recorded now if it was
    not); raises IcebergTableIdentityError otherwise."""
    rec = load(cur, c.pipeline, c.target, lock=True)
    if rec is None or rec.table_uuid is None:
        count, last = (0, None) if rec is not None else committed_into(
            cur, c.pipeline, c.target == OWN, c.resolves_here)
        if table is None:
            if count:
                raise _missing_error(c, None, count, last)
            return True
        now = seen(table, c.identifier, c.catalog_label)
        if count and not holds_pipeline(table, c.pipeline, c.ledger_id):
            raise IcebergTableIdentityError(
                c.identifier, f"no table (recorded from this version on) but {count} "
                f"committed batches of pipeline {c.pipeline} into it, the last {last}",
                f"{now}, which holds no snapshot of pipeline {c.pipeline}",
                f"If that is the pipeline's table (its snapshots expired), take it: "
                f"{c.adopt_hint}; else restore the table that holds the batches (register "
                f"its newest metadata file with the catalog under {c.identifier})")
        record_seen(cur, c.pipeline, c.target, now)
        log.info("pipeline %s: recorded Iceberg table %s as the one its batches live in",
                 c.pipeline, now)
        return False
    if table is None:
        if rec.last_batch_id is None:
            _forget(cur, rec, c, "the table the ledger recorded is gone; no batch was "
                                 "committed into it")
            return True
        raise _missing_error(c, rec, 0, None)
    now = seen(table, c.identifier, c.catalog_label, rec.last_snapshot_id, rec, c.ledger_id)
    diffs = differences(rec, now)
    if not diffs and now.identifier != rec.identifier:
        diffs = _forked(c, rec, now)
    if not diffs:
        if now.identifier != rec.identifier:
            log.warning("pipeline %s: the ledger's Iceberg table %s is found as %s now "
                        "(renamed); recorded under that name", c.pipeline, rec.identifier,
                        now.identifier)
            cur.execute("UPDATE offsetflow.table_identities SET identifier = %s, updated_at "
                        "= now() WHERE pipeline = %s AND target = %s",
                        (now.identifier, c.pipeline, c.target))
        return False
    if rec.last_batch_id is None:  # nothing of the ledger's is in the recorded one
        log.warning("pipeline %s: Iceberg table %s is not the one recorded (%s), but no "
                    "batch was committed into that one: recording this one",
                    c.pipeline, now, "; ".join(diffs))
        record_seen(cur, c.pipeline, c.target, now,
                    why="the recorded table changed before any batch was committed into it")
        return False
    raise IcebergTableIdentityError(
        c.identifier, str(rec), f"{now}: {'; '.join(diffs)}", _way_out(c, rec))


def _forget(cur: psycopg2.extensions.cursor, rec: Record, c: Check, why: str) -> None:
    log.warning("pipeline %s: %s (%s); the next table created is recorded", c.pipeline, why,
                rec)
    record(cur, Record(rec.pipeline, rec.target, c.identifier, c.catalog_label, None, None),
           why=why)


def _forked(c: Check, rec: Record, now: Seen) -> list[str]:
    """The ledger's table found under another name: refused while the recorded name still
    holds it too (a second registration of its metadata: each would go its own way)."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        there = c.catalog.load_table(rec.identifier)
    except NoSuchTableError:
        return []
    if str(there.metadata.table_uuid) != now.table_uuid:
        return []
    return [f"the ledger's name {rec.identifier} still holds this table (table-uuid "
            f"{now.table_uuid}): two registrations of one table's metadata fork its "
            f"history; drop the one that is not written to, or set sink.table back to "
            f"{rec.identifier}"]


def _way_out(c: Check, rec: Record) -> str:
    return (f"To go on with the ledger's table, put it back: with the config as it was when "
            f"the ledger recorded it (sink.table {rec.identifier}, the {rec.catalog}), or "
            f"register the table's newest metadata file (at least {rec.metadata_location}; "
            f"not an older one) with the catalog under {c.identifier}, e.g. pyiceberg "
            f"catalog.register_table('{c.identifier}', '<metadata file>') or Spark CALL "
            f"<catalog>.system.register_table(...), after dropping (without purge) what is "
            f"there now. To make the table found the pipeline's instead, knowing the "
            f"ledger's batches up to {rec.last_batch_id} stay in the recorded table (replay "
            f"their windows into the new one if it must hold them): {c.adopt_hint}")


def _missing_error(c: Check, rec: Record | None, count: int, last: int | None
                   ) -> IcebergTableIdentityError:
    if rec is not None:
        return IcebergTableIdentityError(
            c.identifier, str(rec), f"no table {c.identifier} in the {c.catalog_label} "
            f"(dropped or renamed; not created again, which would leave the batches behind)",
            _way_out(c, rec))
    return IcebergTableIdentityError(
        c.identifier, f"no table (recorded from this version on) but {count} committed "
                      f"batches of pipeline {c.pipeline} into it, the last {last}",
        f"no table {c.identifier} in the {c.catalog_label} (not created again, which "
        f"would leave those batches behind)",
        f"Register the table that holds them again (its newest metadata file, under "
        f"{c.identifier}), or put sink.table and sink.catalog back as they were; if those "
        f"batches went elsewhere (another sink) and a new table is meant: {c.adopt_hint}")


def adopt_table(cur: psycopg2.extensions.cursor, c: Check, table: Table | None, reason: str
          ) -> tuple[Record | None, Seen | None]:
    """`offsetflow adopt-table`: `table` (None: the one the next run creates) becomes the
    pipeline's, the recorded one goes to the record's history with `reason`. Returns
    (the record before, the table adopted)."""
    old = load(cur, c.pipeline, c.target, lock=True)
    why = f"adopt-table: {reason}"
    if table is None:
        record(cur, Record(c.pipeline, c.target, c.identifier, c.catalog_label, None, None),
               why=why)
        return old, None
    now = seen(table, c.identifier, c.catalog_label)
    record_seen(cur, c.pipeline, c.target, now, why=why)
    return old, now


def to_json(rec: Record | None) -> dict[str, Any] | None:
    return None if rec is None else {k: getattr(rec, k) for k in _COLUMNS.split(", ")}
