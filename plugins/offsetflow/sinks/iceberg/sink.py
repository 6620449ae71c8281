"""Apache Iceberg as the sink: step 4 of the commit protocol (`offsetflow.commit.protocol`,
`ExternalSink`) appends a batch to an Iceberg table in ONE catalog commit whose snapshot
summary names the batch (`sink_iceberg_config.snapshot_summary`).

Order inside the still-open ledger transaction (batch row locked):
  1. `find`: the table's snapshots (ancestors of main) are searched for this batch; found ->
     an earlier attempt committed to Iceberg and died before the ledger COMMIT: the ledger is
     completed, nothing is appended again;
  2. `write`: in an append without a transform or quality suite (`sinks.task_data_files`)
     the Spark tasks wrote the batch's data files and listed them in their markers
     (`sink_iceberg_tasks`, `sink_iceberg_staged`), and no row is read here; otherwise
     the tasks staged into PostgreSQL, and the stage is read as Arrow on the driver and
     written as data files here. Either way ONE catalog commit adds them
     (`sink_iceberg_commit`). The commit asserts that main is still the snapshot `find`
     checked (pyiceberg's AssertRefSnapshotId): a concurrent writer (a zombie whose ledger
     lock is gone) makes it fail with CommitFailedException; then the table is refreshed,
     `find` runs again, and only then is the append retried. Any other failure of the
     catalog commit has an unknown outcome: it is raised, the ledger rolls back, and the
     next attempt's `find` decides;
  3. the ledger transaction commits (positions, batch committed).
Dead letters (bad records, tombstones by policy, quality failures) stay in PostgreSQL and
are written by this same transaction, on both paths.

Files of an attempt that died before its catalog commit are referenced by no snapshot; they
carry the batch's name prefix, and the sweep after the retried batch deletes exactly those
(`sink_iceberg_files`).

Replay/backfill: the window's old rows are deleted by coordinates and the new ones appended
in the same catalog commit. Mode upsert: `sink_iceberg_upsert` (from `write`/`find`). The
stage path (transform, quality suite, upsert) still holds a batch in the driver's memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit import (
    TOMBSTONE_ERROR,
    TOPIC_ID_COLUMN,
    CommitSpec,
    Moved,
    dead_letters_from,
    delete_window_dead_letters,
    move_stage_dead_letters,
    route_quality_failures,
)
from offsetflow.config import (
    IcebergConfig,
    catalog_properties,
    resolve_identifier,
    snapshot_summary,
)
from offsetflow.errors import StagedRowsLostError
from offsetflow.ledger import Batch, stage_table
from offsetflow.sinks.iceberg.commit import (
    commit_snapshot,
    find_batch,
    schema_mismatch,
    window_of,
)
from offsetflow.sinks.iceberg.files import batch_file_prefix
from offsetflow.sinks.iceberg.layout import (
    check_table_layout,
    layout_for_new_table,
    warn_layout_drift,
)
from offsetflow.sinks.iceberg.stage import arrow_schema, read_stage
from offsetflow.sinks.iceberg.staged import (
    check_files_exist,
    check_files_spec,
    check_files_table,
    data_files,
    staged_files,
)
from offsetflow.sinks.iceberg.tasks import TaskFiles
from offsetflow.sinks.iceberg.warehouse import writing_to

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

def load_catalog(cfg: IcebergConfig, sink_dsn: str) -> Catalog:
    from pyiceberg.catalog import load_catalog as _load  # noqa: PLC2701 - no public API

    return _load(cfg.catalog_name, **catalog_properties(cfg, sink_dsn))


@dataclass
class IcebergSink:
    """An `ExternalSink` (see the module docstring)."""

    iceberg: IcebergConfig
    sink_dsn: str
    spec: CommitSpec
    columns: Sequence[tuple[str, str]]  # stage columns and their PostgreSQL types
    table_name: str = ""  # sink.table as configured (a backfill may name another)
    _catalog: Any = None
    _task_dead: int = 0  # bad records the tasks staged, of the last `route_dead_letters`
    _layout_checked: bool = False  # the table's layout was compared with the config
    stage_gone: bool = False  # `offsetflow complete`: the dead-letter count is the snapshot's

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = load_catalog(self.iceberg, self.sink_dsn)
        return self._catalog

    # -- ExternalSink ------------------------------------------------------------------
    def close(self) -> None:
        """The SQL catalog's connection pool goes with the attempt."""
        engine = getattr(self._catalog, "engine", None)
        if engine is not None:
            engine.dispose()
        self._catalog = None

    def find(self, cur: psycopg2.extensions.cursor, batch: Batch) -> Moved | None:
        from pyiceberg.exceptions import NoSuchTableError

        try:  # not `table()`: a check made before anything is read knows no columns
            table = self.catalog.load_table(self.identifier(batch))
        except NoSuchTableError:
            return None  # no table holds no batch; `write` creates it
        found = find_batch(table, batch)
        if found is None:
            return None
        moved = self.route_dead_letters(cur, batch)  # they commit with the ledger, so again
        if self.spec.mode == "upsert":  # and so do the upsert's and its deletions memory
            from offsetflow.sinks.iceberg.upsert import prepare

            moved.dead += prepare(self, cur, batch)
        moved.rows = found[0]
        if self.stage_gone:  # nothing was routed again: the count the snapshot recorded
            moved.dead = found[1]
        return moved

    def completing(self) -> None:
        """`offsetflow complete`: the stage is lost; `find` takes the snapshot's counts."""
        self.stage_gone = True

    def write(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int) -> Moved:
        if self.spec.mode == "upsert":  # merge on the key: its own module
            from offsetflow.sinks.iceberg.upsert import write_upsert

            return write_upsert(self, cur, batch)
        if self.spec.task_files:
            return self._write_task_files(cur, batch, staged)
        moved = self.route_dead_letters(cur, batch)
        t = time.monotonic()
        data = read_stage(cur, batch.batch_id, self.columns, self.spec.routes_tombstones)
        read_s = time.monotonic() - t
        _check_counts(batch, data.num_rows, "the stage", moved.dead - self._task_dead, staged)
        table = self.table(self.identifier(batch))
        summary = _summary(batch, data.num_rows, moved.dead)
        t = time.monotonic()
        rows = commit_snapshot(table, batch, data, summary, window=window_of(cur, batch))
        log.info("batch %d: %d staged rows read in %.2f s, written and committed to Iceberg in "
                 "%.2f s", batch.batch_id, data.num_rows, read_s, time.monotonic() - t)
        if rows is not None:  # another attempt committed it meanwhile: its count stands
            log.info("batch %d: found in Iceberg after a conflict; nothing appended",
                     batch.batch_id)
        moved.rows = data.num_rows if rows is None else rows
        return moved

    def task_files(self, batch: Batch) -> TaskFiles:
        """What the batch's tasks need to write its data files; the table is created
        first if need be, and the rows must fit its schema."""
        from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible  # noqa: PLC2701 - no public API

        self._layout_checked = True  # the commit's sink reports a layout drift, once
        table = self.table(self.identifier(batch))
        try:
            _check_pyarrow_schema_compatible(table.schema(), arrow_schema(self.columns))
        except ValueError as e:
            raise schema_mismatch(batch, table, e) from e
        target = int(table.properties.get("write.target-file-size-bytes",
                                          self.iceberg.target_file_mb << 20))
        return TaskFiles.of(table, batch.batch_id, batch_file_prefix(batch), target,
                            self.spec.routes_tombstones)

    # -- helpers -----------------------------------------------------------------------
    def _write_task_files(self, cur: psycopg2.extensions.cursor, batch: Batch,
                          staged: int) -> Moved:
        """Commit the data files the batch's markers list (the tasks wrote them)."""
        moved = self.route_dead_letters(cur, batch)  # tombstones the tasks staged go here too
        files = staged_files(cur, batch.batch_id)
        _check_counts(batch, files.records, "its data files", moved.dead - self._task_dead,
                      staged)
        table = self.table(self.identifier(batch))
        check_files_table(table, files, batch.batch_id)  # not a table made again since
        check_files_exist(table, files, batch.batch_id)
        summary = _summary(batch, files.records, moved.dead)
        t = time.monotonic()
        check_files_spec(table, files, batch.batch_id)

        def check(t: Table) -> None:  # a conflict reloads the table: vet it again
            check_files_table(t, files, batch.batch_id)
            check_files_spec(t, files, batch.batch_id)
        rows = commit_snapshot(table, batch, data_files(table, files), summary, check=check,
                               window=window_of(cur, batch))
        log.info("batch %d: %d data files of %d rows committed to Iceberg in %.2f s",
                 batch.batch_id, len(files.paths), files.records, time.monotonic() - t)
        if rows is not None:
            log.info("batch %d: found in Iceberg after a conflict; nothing appended",
                     batch.batch_id)
        moved.rows = files.records if rows is None else rows
        return moved

    def route_dead_letters(self, cur: psycopg2.extensions.cursor, batch: Batch) -> Moved:
        """Everything that goes to the PostgreSQL dead-letter table, in this transaction."""
        moved = Moved()
        spec = self.spec
        dl = spec.dead_letter_table
        if batch.kind in ("replay", "backfill") and dl:  # of the window's incarnation
            delete_window_dead_letters(cur, batch, dl)
        stage = stage_table(batch.batch_id)
        if spec.quality_routes:
            assert dl is not None
            moved.dead += route_quality_failures(cur, batch, dl, stage, spec.quality_routes,
                                                 spec.columns)
        if spec.routes_tombstones:
            assert dl is not None
            moved.dead += dead_letters_from(cur, batch, dl, sql.SQL("{} s").format(stage),
                                            spec.columns, sql.SQL("s.value IS NULL"),
                                            sql.Literal(TOMBSTONE_ERROR), "tombstone")
        before = moved.dead
        move_stage_dead_letters(cur, batch, spec, moved)
        self._task_dead = moved.dead - before
        return moved

    def identifier(self, batch: Batch) -> str:
        """The pipeline's table, or the one a backfill named (`target_table`)."""
        return resolve_identifier(self.iceberg, self.table_name, batch.target_table)

    def table(self, ident: str) -> Table:
        """The target table, created on first use with the configured layout."""
        from pyiceberg.exceptions import NoSuchTableError, TableAlreadyExistsError

        cat = self.catalog
        try:
            loaded = cat.load_table(ident)
        except NoSuchTableError:
            pass
        else:
            check_table_layout(loaded)  # a spec this runtime cannot compute: refused
            if ident == self.iceberg.identifier and not self._layout_checked:
                self._layout_checked = True
                warn_layout_drift(loaded, self.iceberg)
            return loaded
        cat.create_namespace_if_not_exists(ident.rpartition(".")[0])
        columns = self.columns
        if self.spec is not None and self.spec.mode == "upsert":  # the rule reads it
            columns = [*columns, (TOPIC_ID_COLUMN, "text")]
        schema, spec, order = layout_for_new_table(self.iceberg, arrow_schema(columns))
        try:  # one commit with its layout: a kill cannot leave it unpartitioned
            with writing_to(self.iceberg.properties.get("warehouse", "?"),
                            f"creating table {ident}", None):
                table = cat.create_table(ident, schema=schema, partition_spec=spec,
                                         sort_order=order, properties={
                                             "write.target-file-size-bytes":
                                                 str(self.iceberg.target_file_mb << 20)})
        except TableAlreadyExistsError:  # a concurrent run made it first
            return cat.load_table(ident)
        log.info("created Iceberg table %s", ident)
        return table


def _check_counts(batch: Batch, rows: int, where: str, routed: int, staged: int) -> None:
    """The rows for Iceberg plus the dead letters the commit routed out of the stage
    (quality failures, tombstones) are what the markers count."""
    if rows + routed != staged:
        raise StagedRowsLostError(batch.batch_id, None,
                                  f"{where} hold {rows} rows for Iceberg and the stage "
                                  f"{routed} dead letters, but its markers count {staged}")


def _summary(batch: Batch, rows: int, dead: int) -> dict[str, str]:
    return snapshot_summary(batch.pipeline, batch.batch_id, batch.kind,
                            [(r.topic, r.partition, r.from_offset, r.until_offset)
                             for r in batch.ranges], rows, dead)


