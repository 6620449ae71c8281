"""Apache Iceberg as the sink: step 4 of the commit protocol (`offsetflow.commit.protocol`,
`ExternalSink`) appends a batch to an Iceberg table in ONE catalog commit whose snapshot
summary names the batch (`sink_iceberg_config.snapshot_summary`).

Order inside the still-open ledger transaction (batch row locked):
  0. the table found is the one the ledger's batches live in (`sink_iceberg_identity`:
     its table-uuid, location and catalog as the ledger recorded them; the record stays
     row-locked to the end, and this transaction moves it on to the batch's commit), else
     IcebergTableIdentityError and nothing is written; no table is created again where
     the ledger holds batches;
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
    PipelineConfig,
    catalog_label,
    catalog_properties,
    resolve_identifier,
    snapshot_summary,
)
from offsetflow.errors import BadRecordError, StagedRowsLostError
from offsetflow.ledger import Batch, Ledger, ledger_identity, stage_table
from offsetflow.sinks.iceberg.commit import (
    batch_snapshot_id,
    commit_snapshot,
    find_batch,
    schema_mismatch,
    window_of,
)
from offsetflow.sinks.iceberg.evolve import check_files_schema, evolve_schema, evolved_metadata
from offsetflow.sinks.iceberg.files import batch_file_prefix
from offsetflow.sinks.iceberg.identity import OWN, Check, adopt_table, check, record_commit
from offsetflow.sinks.iceberg.keys import COORDINATES
from offsetflow.sinks.iceberg.layout import (
    check_table_layout,
    layout_for_new_table,
    warn_layout_drift,
)
from offsetflow.sinks.iceberg.nested import check_nested, fit_table, table_nested_types
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
    from pyiceberg.table import Table, Transaction
    from pyiceberg.table.metadata import TableMetadata

log = logging.getLogger(__name__)

def load_catalog(cfg: IcebergConfig, sink_dsn: str) -> Catalog:
    from pyiceberg.catalog import load_catalog as _load  # noqa: PLC2701 - no public API

    return _load(cfg.catalog_name, **catalog_properties(cfg, sink_dsn))


def batch_identifier(iceberg: IcebergConfig, sink_table: str, batch: Batch) -> str:
    """The table `batch` writes: a backfill's `target_table` (the pipeline's own in any
    spelling, or another), else the pipeline's own table as configured now. A live batch or
    a replay records `sink.table` as it was when planned: run after `sink.table` changed
    (--accept-config-change), it goes where the config says, checked against the ledger's
    record like any batch, never to a table named by an older config."""
    if batch.kind != "backfill":
        return iceberg.identifier
    audit = batch.params.get("audit")  # staged on a branch of its live table
    target = str(audit["live_table"]) if isinstance(audit, dict) else batch.target_table
    return resolve_identifier(iceberg, sink_table, target)


def sink_of(cfg: PipelineConfig, dsn: str, columns: Sequence[tuple[str, str]] | None = None,
            spec: CommitSpec | None = None) -> IcebergSink:
    """The pipeline's sink for one commit attempt or upkeep run (`dsn`: the ledger's)."""
    assert cfg.sink.iceberg is not None
    return IcebergSink(cfg.sink.iceberg, cfg.sink.connection or dsn,
                       spec or CommitSpec(columns=()), tuple(columns or ()), cfg.sink.table,
                       ledger_dsn=dsn, pipeline=cfg.name, conn_id=cfg.sink.conn_id,
                       protobuf_text=cfg.format_type == "protobuf")


@dataclass
class IcebergSink:
    """An `ExternalSink` (see the module docstring)."""

    iceberg: IcebergConfig
    sink_dsn: str
    spec: CommitSpec
    columns: Sequence[tuple[str, str]]  # stage columns and their PostgreSQL types
    table_name: str = ""  # sink.table as configured (a backfill may name another)
    # whose table it is: the ledger (its DSN; "" the catalog's) and the pipeline ("" a bare
    # sink of a tool or a test, whose table identity is not checked), and the sink's
    # Airflow connection (the catalog's label names it, as the config fingerprint does)
    ledger_dsn: str = ""
    pipeline: str = ""
    conn_id: str | None = None
    ledger_id: str | None = None  # the ledger's identity, once a check has read it
    _cur: Any = None  # the commit's transaction, from `find`/`write` on
    _catalog: Any = None
    _task_dead: int = 0  # bad records the tasks staged, of the last `route_dead_letters`
    _layout_checked: bool = False  # the table's layout was compared with the config
    stage_gone: bool = False  # `offsetflow complete`: the dead-letter count is the snapshot's
    # jsonb columns (a transform's: text) a new table gets as struct/list/map (name ->
    # Arrow type), from the run's reader schemas (`sink_iceberg_nested`), on the
    # task-files and the stage path alike; empty: JSON text
    nested: Mapping[str, Any] = field(default_factory=dict)
    # format.schema_evolution: add_columns: fields added inside them join the table too
    nested_evolution: bool = False
    # format.type protobuf: the staged JSON text is Protobuf's JSON mapping, whose 64-bit
    # integers are strings (`nested.json_mapping_number`); other formats' strings stay strings
    protobuf_text: bool = False

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
        self._cur = None

    def find(self, cur: psycopg2.extensions.cursor, batch: Batch) -> Moved | None:
        from pyiceberg.exceptions import NoSuchTableError

        self._cur = cur  # the commit's transaction: `table` checks and records in it
        ident = self.identifier(batch)
        try:  # not `table()`: a check made before anything is read knows no columns
            table = self.catalog.load_table(ident)
        except NoSuchTableError:
            table = None
        # the table is the ledger's before its snapshots are believed (record row-locked
        # to the commit's end: an adopt-table waits)
        if self._check(cur, ident, table) or table is None:
            return None  # no table holds no batch; `write` creates it
        found = find_batch(table, batch, self.ledger_id)
        if found is None:
            return None
        self._record_commit(cur, batch, table)
        moved = self.route_dead_letters(cur, batch)  # they commit with the ledger, so again
        if not self.spec.task_files and not self.stage_gone:
            # and so do the stage path's nested values the table's types refused (before
            # an upsert's winners: they are decided without them, as `write` did)
            moved.dead += self._route_unfit_again(cur, batch, table)
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
        self._cur = cur
        if self.spec.mode == "upsert":  # merge on the key: its own module
            from offsetflow.sinks.iceberg.upsert import write_upsert

            moved = write_upsert(self, cur, batch)
            self._record_commit(cur, batch, self.catalog.load_table(self.identifier(batch)))
            return moved
        if self.spec.task_files:
            return self._write_task_files(cur, batch, staged)
        moved = self.route_dead_letters(cur, batch)
        t = time.monotonic()
        data = read_stage(cur, batch.batch_id, self.columns, self.spec.routes_tombstones)
        read_s = time.monotonic() - t
        table = self.table(self.identifier(batch))
        # a table's struct/list/map column: its JSON text parsed into the types the commit
        # makes current (format.schema_evolution's nested fields too: `check_nested` refused
        # them before the read without it); values that do not fit are their records'
        # dead letters, never a batch that fails on every retry
        schema = self._nested_checked(table, batch).schema()
        data, unfit = fit_table(data, schema, ".".join(table.name()), self.protobuf_text)
        if unfit:
            moved.dead += self._route_unfit(cur, batch, unfit)
        _check_counts(batch, data.num_rows, "the stage", moved.dead - self._task_dead, staged)
        summary = self.summary(cur, batch, data.num_rows, moved.dead)
        t = time.monotonic()
        rows = commit_snapshot(table, batch, data, summary, ledger=self.ledger_id,
                               window=window_of(cur, batch), evolve=self._evolve(batch))
        self._record_commit(cur, batch, table)
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
        # format.schema_evolution: the files are written with the evolved schema's field
        # ids; the commit makes the same update with the snapshot (`sink_iceberg_evolve`)
        # nested fields the reader has and the table's struct lacks: refused by name. The
        # batch's snapshot there already: the schema it was committed with (find completes it)
        meta = self._committed_metadata(table, batch) or self._nested_checked(table, batch)
        try:  # a jsonb column the table holds as struct/list/map: the tasks parse its text
            _check_pyarrow_schema_compatible(meta.schema(), arrow_schema(
                self.columns, table_nested_types(meta.schema())))
        except ValueError as e:
            raise schema_mismatch(batch, table, e) from e
        target = int(table.properties.get("write.target-file-size-bytes",
                                          self.iceberg.target_file_mb << 20))
        return TaskFiles.of(table, batch.batch_id, batch_file_prefix(batch), target,
                            self.spec.routes_tombstones, meta, self.protobuf_text)

    def check_evolution(self, batch: Batch) -> None:
        """The stage path (upsert, a quality suite): format.schema_evolution's changes to
        the table as it is now, and the reader's nested fields against its struct/list/map
        columns (`check_nested`), checked on the driver before the tasks read (the commit
        makes the changes, and checks again): a type Iceberg cannot promote, a change to
        the upsert key, an audited window's change or a nested field the table lacks
        without add_columns stops the batch here. No table yet: the commit creates it
        with the columns (JSON text ones on this path). The batch's snapshot there already
        (a run killed between the catalog and the ledger commits): nothing is checked, the
        commit's `find` completes it whatever the table's schema became since (a column
        retyped by hand or by another pipeline would otherwise refuse a batch that is in
        the table, and its way out would be to drop that column)."""
        if not self.spec.add_columns and not self.nested:
            return
        table = self.existing_table(self.identifier(batch))
        if table is None or find_batch(table, batch, self.ledger_id) is not None:
            return
        self._nested_checked(table, batch)

    def _nested_checked(self, table: Table, batch: Batch) -> TableMetadata:
        """The table's metadata with format.schema_evolution's update staged (the one the
        commit makes), after the reader's nested fields are checked against it (refused
        by name when the table lacks one or must loosen one: `check_nested`)."""
        meta = evolved_metadata(table, self.spec.add_columns, batch.audit_id, self.spec.key,
                                self.nested if self.nested_evolution else None)
        check_nested(".".join(table.name()), meta.schema(), self.nested, batch.batch_id)
        return meta

    # -- helpers -----------------------------------------------------------------------
    def _committed_metadata(self, table: Table, batch: Batch) -> TableMetadata | None:
        """The batch's snapshot there already (a run killed between the catalog and the
        ledger commits): the table's metadata with the schema that snapshot was committed
        with, for this run's tasks, whose files the commit never adds (its `find`
        completes the batch; the sweep removes them). Their rows fit that schema whatever
        the table's became since: a column retyped by hand or by another pipeline never
        refuses a batch that is in the table. None when the batch is not there."""
        sid = batch_snapshot_id(table, batch, self.ledger_id)
        if sid is None:
            return None
        snap = table.metadata.snapshot_by_id(sid)
        schema_id = None if snap is None else snap.schema_id
        if schema_id is None:
            return table.metadata
        return table.metadata.model_copy(update={"current_schema_id": schema_id})

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
        summary = self.summary(cur, batch, files.records, moved.dead)
        t = time.monotonic()
        check_files_spec(table, files, batch.batch_id)

        def check(t: Table) -> None:  # a conflict reloads the table: vet it again
            check_files_table(t, files, batch.batch_id)
            check_files_spec(t, files, batch.batch_id)
        evolve = self._evolve(batch)

        def evolve_and_check(txn: Transaction) -> None:  # the files' ids are the schema's
            if evolve is not None:
                evolve(txn)
            check_files_schema(txn.table_metadata.schema(), files.by_part,
                               ".".join(table.name()), batch.batch_id)
        rows = commit_snapshot(table, batch, data_files(table, files), summary, check=check,
                               ledger=self.ledger_id, window=window_of(cur, batch),
                               evolve=evolve_and_check)
        self._record_commit(cur, batch, table)
        log.info("batch %d: %d data files of %d rows committed to Iceberg in %.2f s",
                 batch.batch_id, len(files.paths), files.records, time.monotonic() - t)
        if rows is not None:
            log.info("batch %d: found in Iceberg after a conflict; nothing appended",
                     batch.batch_id)
        moved.rows = files.records if rows is None else rows
        return moved

    def route_unfit(self, cur: psycopg2.extensions.cursor, batch: Batch, table: Table
                    ) -> int:
        """An upsert's `write`, before its winners are decided: the staged rows whose nested
        values the types of the commit's schema (`_nested_checked`: the table's, with
        format.schema_evolution's update) refuse, as dead letters out of the stage, so that
        a record that does not fit never wins its key. Only the coordinates and the
        table's nested columns are read. Returns the dead letters routed."""
        if not self.nested and not table_nested_types(table.schema()):
            return 0  # nothing nested, nor to be added: nothing to fit
        schema = self._nested_checked(table, batch).schema()
        nested = table_nested_types(schema)
        cols = [(c, t) for c, t in self.columns if c in nested]
        if not cols:
            return 0
        have = dict(self.columns)
        data = read_stage(cur, batch.batch_id, [(c, have[c]) for c in COORDINATES] + cols,
                          False)
        _, unfit = fit_table(data, schema, ".".join(table.name()), self.protobuf_text)
        return self._route_unfit(cur, batch, unfit) if unfit else 0

    def _route_unfit(self, cur: psycopg2.extensions.cursor, batch: Batch,
                     unfit: Mapping[tuple[str, int, int], str], always: bool = False) -> int:
        """Staged rows whose nested values the table's types refuse: dead letters (out of
        the stage, in the commit's transaction), or under `bad_records: fail` (unless
        `always`) the batch fails naming the first."""
        dl = self.spec.dead_letter_table
        if dl is None or not (self.spec.bad_records_staged or always):
            (topic, partition, offset), why = min(unfit.items())
            raise BadRecordError(topic, partition, offset, why, more=len(unfit) - 1)
        return route_quality_failures(cur, batch, dl, stage_table(batch.batch_id),
                                      {c: [why] for c, why in unfit.items()},
                                      self.spec.columns, prefix="", label="iceberg")

    def _route_unfit_again(self, cur: psycopg2.extensions.cursor, batch: Batch,
                           table: Table) -> int:
        """`find` on the stage path: the rows whose nested values `write` refused (their dead
        letters rolled back with the ledger transaction of the attempt that made the
        snapshot) routed again, decided by the types of the snapshot's own schema, the ones
        `write` fitted them to (the same staged rows give the same dead letters). Without
        this they are in neither the table nor the dead letters."""
        snap = table.snapshot_by_id(batch_snapshot_id(table, batch, self.ledger_id) or -1)
        schema = table.schemas().get(snap.schema_id) if snap is not None and \
            snap.schema_id is not None else None
        schema = schema or table.schema()
        if not table_nested_types(schema):
            return 0
        data = read_stage(cur, batch.batch_id, self.columns, self.spec.routes_tombstones)
        _, unfit = fit_table(data, schema, ".".join(table.name()), self.protobuf_text)
        if not unfit:
            return 0
        # the snapshot was made without them: a dead-letter table takes them whatever
        # bad_records says now (the attempt that made it routed them there)
        return self._route_unfit(cur, batch, unfit, always=True)

    def _evolve(self, batch: Batch) -> Callable[[Transaction], None] | None:
        """format.schema_evolution's schema update, staged in the batch's catalog commit
        (None: no evolved columns)."""
        add = self.spec.add_columns
        nested = self.nested if self.nested_evolution else {}
        if not add and not nested:
            return None
        name = self.identifier(batch)

        def evolve(txn: Transaction) -> None:
            done = evolve_schema(txn, name, add, batch.audit_id, self.spec.key, nested)
            if done:
                log.info("batch %d: Iceberg table %s: %s, in the batch's commit",
                         batch.batch_id, name, ", ".join(done))
        return evolve

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
        return batch_identifier(self.iceberg, self.table_name, batch)

    def target(self, ident: str) -> str:
        """The identity record's key of table `ident`: the pipeline's own, or a backfill's."""
        return OWN if ident == self.iceberg.identifier else ident

    def table(self, ident: str) -> Table:
        """The target table, created on first use with the configured layout; refused
        (IcebergTableIdentityError) when it is not the table the ledger's batches live in
        (`offsetflow.sinks.iceberg.identity`). In a commit, checked in its transaction."""
        if self._cur is not None:
            return self._table(self._cur, ident)
        if not self.pipeline:  # a bare sink (a tool's or a test's): no ledger record
            return self._table(None, ident)
        with Ledger(self.ledger_dsn or self.sink_dsn) as ledger, ledger.transaction() as cur:
            return self._table(cur, ident)

    def existing_table(self, ident: str) -> Table | None:
        """The target table if it exists and is the ledger's (maintenance, the checks
        made before a run reads): never created here."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            table = self.catalog.load_table(ident)
        except NoSuchTableError:
            table = None
        if self.pipeline:
            with Ledger(self.ledger_dsn or self.sink_dsn) as ledger, \
                    ledger.transaction() as cur:
                self._check(cur, ident, table)
        return table

    def check_in(self, cur: psycopg2.extensions.cursor, ident: str) -> None:
        """The table `ident` is the ledger's, or there is none and one may be created;
        checked (and recorded) in `cur`'s transaction. Nothing is created here."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            table = self.catalog.load_table(ident)
        except NoSuchTableError:
            table = None
        self._check(cur, ident, table)

    def adopt(self, ident: str, reason: str) -> str:
        """`offsetflow adopt-table`: the table now under `ident` (none: the one the next run
        creates) becomes the one the pipeline's batches live in, in the ledger's record; the
        recorded one goes to the record's history. Returns what changed, in words."""
        from pyiceberg.exceptions import NoSuchTableError

        try:
            table = self.catalog.load_table(ident)
        except NoSuchTableError:
            table = None
        with Ledger(self.ledger_dsn or self.sink_dsn) as ledger, ledger.transaction() as cur:
            old, new = adopt_table(cur, self._check_of(cur, ident), table, reason)
        now = (f"{ident} in the {self.catalog_label} (no table yet: the next run creates it)"
               if new is None else str(new))
        if old is None or old.table_uuid is None:
            return f"pipeline {self.pipeline}: Iceberg table is now {now}"
        kept = (f"the ledger's batches up to {old.last_batch_id} stay in the table recorded "
                f"before ({old}); they are not in the adopted table (replay their windows "
                f"into it if it must hold them)" if old.last_batch_id is not None else
                f"no batch was committed into the table recorded before ({old})")
        return f"pipeline {self.pipeline}: Iceberg table is now {now}; {kept}"

    def _check_of(self, cur: psycopg2.extensions.cursor, ident: str) -> Check:
        self.ledger_id = ledger_identity(cur).installation_id
        adopt_hint = (f"offsetflow adopt-table --pipeline {self.pipeline}"
                      + (f" --target-table {ident}" if self.target(ident) != OWN else "")
                      + " --reason '...'")
        return Check(self.pipeline, self.target(ident), ident, self.catalog_label,
                     self.catalog, self.ledger_id, lambda t: resolve_identifier(
                         self.iceberg, self.table_name, t) == ident, adopt_hint)

    def _check(self, cur: psycopg2.extensions.cursor | None, ident: str,
               table: Table | None) -> bool:
        """`identity.check`; True when no table is there and one may be created."""
        if cur is None or not self.pipeline:
            return table is None
        return check(cur, self._check_of(cur, ident), table)

    @property
    def catalog_label(self) -> str:
        return catalog_label(self.iceberg, self.sink_dsn, self.conn_id)

    def _table(self, cur: psycopg2.extensions.cursor | None, ident: str) -> Table:
        from pyiceberg.exceptions import NoSuchTableError, TableAlreadyExistsError

        cat = self.catalog
        try:
            loaded = cat.load_table(ident)
        except NoSuchTableError:
            loaded = None
        self._check(cur, ident, loaded)  # the ledger's table, or none and one may be made
        if loaded is not None:
            check_table_layout(loaded)  # a spec this runtime cannot compute: refused
            if ident == self.iceberg.identifier and not self._layout_checked:
                self._layout_checked = True
                warn_layout_drift(loaded, self.iceberg)
            return loaded
        cat.create_namespace_if_not_exists(ident.rpartition(".")[0])
        columns = self.columns
        if self.spec is not None and self.spec.mode == "upsert":  # the rule reads it
            columns = [*columns, (TOPIC_ID_COLUMN, "text")]
        schema, spec, order = layout_for_new_table(self.iceberg, arrow_schema(
            columns, self.nested))
        try:  # one commit with its layout: a kill cannot leave it unpartitioned
            with writing_to(self.iceberg.properties.get("warehouse", "?"),
                            f"creating table {ident}", None):
                table = cat.create_table(ident, schema=schema, partition_spec=spec,
                                         sort_order=order, properties={
                                             "write.target-file-size-bytes":
                                                 str(self.iceberg.target_file_mb << 20)})
        except TableAlreadyExistsError:  # a concurrent run made it first: its, if recorded
            table = cat.load_table(ident)
            self._check(cur, ident, table)
            return table
        log.info("created Iceberg table %s", ident)
        self._check(cur, ident, table)  # recorded as the pipeline's
        return table

    def summary(self, cur: psycopg2.extensions.cursor, batch: Batch, rows: int, dead: int
                ) -> dict[str, str]:
        """The batch's snapshot summary, naming the ledger and the pipeline's oldest batch
        still open in it (maintenance run from another ledger reads them)."""
        cur.execute("SELECT min(batch_id) FROM offsetflow.batches WHERE pipeline = %s AND "
                    "status IN ('planned', 'running', 'failed')", (batch.pipeline,))
        row = cur.fetchone()
        floor = min(int(row[0]), batch.batch_id) if row and row[0] is not None else \
            batch.batch_id
        return snapshot_summary(batch.pipeline, batch.batch_id, batch.kind,
                                [(r.topic, r.partition, r.from_offset, r.until_offset)
                                 for r in batch.ranges], rows, dead,
                                ledger=ledger_identity(cur).installation_id, open_floor=floor)

    def _record_commit(self, cur: psycopg2.extensions.cursor, batch: Batch,
                       table: Table) -> None:
        """The table's metadata after the batch's catalog commit, in the ledger's
        transaction that commits the batch. Not for a batch staged on an audit branch: the
        record names a snapshot of main (`identity.seen`); its publish moves main on, and
        the next batch's commit records it."""
        if self.pipeline and batch.audit_id is None:
            record_commit(cur, self.pipeline, self.target(self.identifier(batch)), table,
                          batch, batch_snapshot_id(table, batch, self.ledger_id))


def _check_counts(batch: Batch, rows: int, where: str, routed: int, staged: int) -> None:
    """The rows for Iceberg plus the dead letters the commit routed out of the stage
    (quality failures, tombstones) are what the markers count."""
    if rows + routed != staged:
        raise StagedRowsLostError(batch.batch_id, None,
                                  f"{where} hold {rows} rows for Iceberg and the stage "
                                  f"{routed} dead letters, but its markers count {staged}")
