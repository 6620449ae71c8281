"""The Iceberg sink's catalog commit (step 2 of `offsetflow.sinks.iceberg.sink`'s order): ONE
commit per batch whose snapshot summary names it, found again before every attempt.

`commit_snapshot` looks for the batch among main's ancestors (`find_batch`) and, only if
it is not there, appends the rows or data files (a replay or backfill first deletes its
window: its coordinates, and when the topic had several incarnations only the rows of
the batches of its own, `window_of`) in one transaction that asserts main is still the
snapshot it searched. pyiceberg's own rebase-and-retry is off for this view of the table
(`no_rebase`), so a conflict comes back here: the table is refreshed, the batch looked for
again, and only then is the commit retried, at most `COMMIT_RETRIES` times.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg2.extensions
import pyarrow as pa

from offsetflow.commit import (
    LINEAGE_COLUMN,
    RangeIncarnation,
    unknown_rows_error,
    window_incarnations,
)
from offsetflow.config import check_summary_ranges, summary_batch
from offsetflow.errors import IcebergTableIdentityError, OffsetFlowError, SchemaMismatchError
from offsetflow.ledger import Batch
from offsetflow.sinks.iceberg.audit import batch_branch, branch_head, ensure_branch
from offsetflow.sinks.iceberg.files import batch_file_prefix, name_files_for
from offsetflow.sinks.iceberg.warehouse import writing_to

if TYPE_CHECKING:
    from pyiceberg.manifest import DataFile
    from pyiceberg.table import Table, Transaction

log = logging.getLogger(__name__)

COMMIT_RETRIES = 5
NO_REBASE = ("commit.retry.num-retries", "0")
# test-only fault hook: SIGKILL the driver after the data files are written (before the
# catalog commit) or after the catalog commit (before the ledger commits)
FAULT_ENV = "OFFSETFLOW_ICEBERG_FAULT"


class IcebergCommitError(OffsetFlowError):
    """The Iceberg commit kept conflicting with other writers; nothing was committed."""


def find_batch(table: Table, batch: Batch, ledger: str | None = None
               ) -> tuple[int, int] | None:
    """(rows, dead letters) of this batch's snapshot among the ancestors of the branch it
    commits on (main, or its audit's branch: `batch_branch`), or None; a snapshot with its
    pipeline and batch id but other ranges is a BatchIdentityError. `ledger`: the ledger's
    identity (another ledger's pipeline of the same name numbers its own batches: its
    snapshots are not this one's)."""
    snap = _batch_snapshot(table, batch, ledger)
    if snap is None:
        return None
    summary = snap.summary.additional_properties if snap.summary else {}
    found = summary_batch(summary, batch.pipeline, batch.batch_id, ledger)
    assert found is not None
    return found


def batch_snapshot_id(table: Table, batch: Batch, ledger: str | None = None) -> int | None:
    """The id of the batch's (newest) snapshot on its branch (`batch_branch`), or None."""
    snap = _batch_snapshot(table, batch, ledger)
    return None if snap is None else int(snap.snapshot_id)


def _batch_snapshot(table: Table, batch: Batch, ledger: str | None) -> Any:
    from pyiceberg.table.snapshots import ancestors_of

    for snap in ancestors_of(branch_head(table, batch_branch(batch)), table.metadata):
        summary = snap.summary.additional_properties if snap.summary else {}
        if summary_batch(summary, batch.pipeline, batch.batch_id, ledger) is not None:
            # and the very ranges: batch ids repeat when ledgers do
            check_summary_ranges(summary, batch.pipeline, batch.batch_id,
                                 [(r.topic, r.partition, r.from_offset, r.until_offset)
                                  for r in batch.ranges],
                                 f"{snap.snapshot_id} of {'.'.join(table.name())}")
            return snap
    return None


def _fault(point: str) -> None:
    """Test-only: `after-files` / `after-commit` SIGKILL this driver there;
    `pause-before-commit:<path>` creates <path> and waits until it is removed (a test
    breaks a service meanwhile)."""
    want = os.environ.get(FAULT_ENV, "")
    if want == point:
        log.warning("%s=%s: killing this driver (test fault)", FAULT_ENV, point)
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "after-files" and want.startswith("pause-before-commit:"):
        flag = want.split(":", 1)[1]
        open(flag, "w").close()
        deadline = time.monotonic() + 600
        while os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.2)


def commit_snapshot(table: Table, batch: Batch, data: pa.Table | Sequence[DataFile] | None,
                    summary: dict[str, str],
                    check: Callable[[Table], None] | None = None,
                    build: Callable[[Table], Transaction] | None = None,
                    ledger: str | None = None,
                    window: Callable[[Table], Any] | None = None,
                    evolve: Callable[[Transaction], None] | None = None) -> int | None:
    """One catalog commit: (for replay/backfill, delete `window`'s rows, then)
    append `data`: rows, or data files written already (the tasks'; a retry after a
    conflict re-commits the same files, it writes none); or, with `build`, the transaction
    it makes of the table as loaded now (upsert: decided again after a conflict). Returns
    None when this call committed, else the rows of the snapshot an earlier or concurrent
    attempt committed for the batch. `check` vets the table each round (a conflict
    refreshes it: the tasks' files must still fit its partition spec); `window` gives a
    replay/backfill's delete filter for the table as loaded (`window_of`); `evolve` stages
    format.schema_evolution's schema update first, in the same transaction, so the columns
    and the snapshot commit together (sinks/iceberg/evolve.py). The table stays the
    one the caller checked against the ledger (its table-uuid): a refresh that finds
    another table under the name (dropped and created again meanwhile: the commit's own
    AssertTableUUID is what conflicted) is IcebergTableIdentityError, never written."""
    from pyiceberg.exceptions import CommitFailedException

    branch = batch_branch(batch)  # an audited window's: beside main, never on it
    for attempt in range(COMMIT_RETRIES):
        # the snapshot the commit asserts is the one searched here (`find` may have looked
        # at an older load of the table)
        found = find_batch(table, batch, ledger)
        if found is not None:
            return found[0]
        if check is not None:
            check(table)
        ensure_branch(table, branch)
        no_rebase(table)
        name_files_for(table, batch_file_prefix(batch))  # the sweep knows them by it
        try:  # files, manifests and metadata are written before the pointer moves
            with writing_to(table.location(), "writing the batch's files and metadata for "
                                              "its catalog commit", batch.batch_id):
                if build is not None:
                    txn = build(table)
                else:
                    assert data is not None
                    txn = _append_transaction(table, batch, data, summary,
                                              None if window is None else window(table),
                                              branch, evolve)
                _fault("after-files")
                txn.commit_transaction()
        except CommitFailedException as e:
            log.warning("batch %d: Iceberg commit conflicted (%s); refreshing and looking "
                        "for the batch before retrying", batch.batch_id, e)
            time.sleep(0.2 * (attempt + 1))
            _refresh(table, batch)  # the loop's next round looks for the batch first
            continue
        _fault("after-commit")
        return None
    raise IcebergCommitError(f"batch {batch.batch_id}: the Iceberg commit to "
                             f"{'.'.join(table.name())} conflicted {COMMIT_RETRIES} times "
                             f"with other writers; nothing was committed, re-run the batch")


def _refresh(table: Table, batch: Batch) -> None:
    """The table as committed now; never another table under its name (pyiceberg refuses a
    refresh to another table-uuid: said here as what it is)."""
    checked = str(table.metadata.table_uuid)
    try:
        table.refresh()
    except ValueError as e:
        if "UUID does not match" not in str(e):
            raise
        name = ".".join(table.name())
        raise IcebergTableIdentityError(
            name, f"batch {batch.batch_id}'s commit began on table-uuid {checked}",
            f"another table under the name after a commit conflict ({e}: dropped and "
            f"created again meanwhile)", "The next run of the batch checks the table "
            "against the ledger's record and names the way out") from e


def _append_transaction(table: Table, batch: Batch, data: pa.Table | Sequence[DataFile],
                        summary: dict[str, str], window: Any, branch: str = "main",
                        evolve: Callable[[Transaction], None] | None = None) -> Transaction:
    txn = table.transaction()
    if evolve is not None:  # the schema first: the appended rows and files are of it
        evolve(txn)
    if batch.kind in ("replay", "backfill"):
        # never by coordinates alone: they hold a recreated topic's other incarnation too
        assert window is not None, "a replay/backfill deletes its window_of"
        with warnings.catch_warnings():  # a window with nothing before is no news
            warnings.filterwarnings("ignore", "Delete operation did not match")
            txn.delete(window, snapshot_properties=summary, branch=branch)
    if not isinstance(data, pa.Table):  # an empty list still records the batch
        with txn.update_snapshot(snapshot_properties=summary, branch=branch
                                 ).fast_append() as append:
            for f in data:
                append.append_data_file(f)
    elif data.num_rows:
        try:
            txn.append(data, snapshot_properties=summary, branch=branch)
        except ValueError as e:  # pyiceberg's word for rows that do not fit the table
            raise schema_mismatch(batch, table, e) from e
    else:  # an empty snapshot still records the batch, so the retry finds it
        with txn.update_snapshot(snapshot_properties=summary, branch=branch).fast_append():
            pass
    return txn


def schema_mismatch(batch: Batch, table: Table, e: Exception) -> SchemaMismatchError:
    return SchemaMismatchError(
        f"batch {batch.batch_id}: its rows do not fit the Iceberg table "
        f"{'.'.join(table.name())} ({e}); the table's schema is fixed when OffsetFlow "
        f"creates it: evolve it (e.g. Spark ALTER TABLE) or write to a new sink.table")


def no_rebase(table: Table) -> None:
    """pyiceberg retries a conflicting commit itself (`commit.retry.num-retries`, default 4)
    by rebasing the append onto the new main: a zombie's batch would then land a second
    time. This view of the table (never the stored properties) retries nothing, so a
    conflict comes back here and the batch is looked for first."""
    props = table.metadata.properties
    if props.get(NO_REBASE[0]) != NO_REBASE[1]:
        table.metadata = table.metadata.model_copy(
            update={"properties": {**props, NO_REBASE[0]: NO_REBASE[1]}})


def window_filter(batch: Batch, incarnations: Sequence[RangeIncarnation] | None = None
                  ) -> Any:
    """The rows a replay/backfill window produced before: its ranges' coordinates (a
    superset where its topic had several incarnations), or with `incarnations` only the
    rows there that batches of the range's own incarnation wrote (`window_incarnations`)."""
    from pyiceberg import expressions

    ex: Any = expressions  # pydantic models: mypy cannot read their positional signatures
    out: Any = None
    for r in incarnations if incarnations is not None else batch.ranges:
        term = _coordinates(r.topic, r.partition, r.from_offset, r.until_offset)
        mine = getattr(r, "mine", None)
        if mine is not None:
            term = ex.And(term, ex.In(LINEAGE_COLUMN, set(mine)))
        out = term if out is None else ex.Or(out, term)
    return out


def _coordinates(topic: str, partition: int, lo: int, hi: int) -> Any:
    from pyiceberg import expressions

    ex: Any = expressions
    return ex.And(ex.EqualTo("topic", topic), ex.EqualTo("partition", partition),
                  ex.GreaterThanOrEqual("offset", lo), ex.LessThan("offset", hi))


def window_of(cur: psycopg2.extensions.cursor, batch: Batch
              ) -> Callable[[Table], Any] | None:
    """A replay/backfill's delete filter, made for the table as each commit round loads
    it (None for a live batch): the ledger says which batches of the window's topic
    incarnation wrote its coordinates (`window_incarnations`), and a row there of a batch
    of unknown incarnation refuses the window (`unknown_window_rows`)."""
    if batch.kind not in ("replay", "backfill"):
        return None
    incarnations = window_incarnations(cur, batch)

    def window(table: Table) -> Any:
        unknown_window_rows(table, batch, incarnations)
        return window_filter(batch, incarnations)
    return window


def unknown_window_rows(table: Table, batch: Batch,
                        incarnations: Sequence[RangeIncarnation]) -> None:
    """Raise WindowIncarnationError when a range whose topic had several incarnations
    holds rows of a batch the ledger knows no incarnation of (or of no batch)."""
    from pyiceberg import expressions

    ex: Any = expressions
    for r in incarnations:
        if r.mine is None:
            continue
        lineage = ex.Or(ex.IsNull(LINEAGE_COLUMN), ex.NotIn(LINEAGE_COLUMN, set(r.known)))
        rows = table.scan(row_filter=ex.And(_coordinates(r.topic, r.partition, r.from_offset,
                                                         r.until_offset), lineage),
                          selected_fields=(LINEAGE_COLUMN,)).to_arrow()
        if rows.num_rows:
            raise unknown_rows_error(batch, r, f"the Iceberg table {'.'.join(table.name())}",
                                     rows.num_rows, rows[LINEAGE_COLUMN].to_pylist())
