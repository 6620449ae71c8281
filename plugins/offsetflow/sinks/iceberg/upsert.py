"""`mode: upsert` for `sink.type: iceberg`: the batch applied to the table by key, with the
PostgreSQL upsert's rule (`offsetflow.commit.upsert`: offset wins within a partition, topic
incarnations, one strict order across partitions, tombstones delete and are remembered).

The rule is never written twice: everything is decided in PostgreSQL with upsert.py's SQL.
  1. the batch's winners per key come from the stage (`upsert.stage_winners`, which also
     routes rows without a key, and tombstones under `dead_letter`, to the dead letters);
     tombstone winners under `delete` go to `offsetflow.deleted_keys` in the ledger
     transaction (`upsert.remember_deletions`), under the name `memory_name` gives the
     table. `find` does steps 1 and this too: a retry after a crash between the Iceberg
     and the ledger commits leaves the same memory as one clean run;
  2. the table's current rows for the winners' keys are read (a pyiceberg plan with a key
     filter per chunk of keys, then only the key and coordinate columns of the files it
     names), with their data file and position, into a temporary table; a replay/backfill
     also reads its window's rows (it replaces what the window produced, as in PostgreSQL);
  3. SQL decides with `newer_or_same` which rows go (replaced, deleted by a tombstone, or
     in the window) and which winners are written;
  4. ONE catalog commit, one snapshot (operation overwrite, the batch's summary): every data
     file holding a row that goes is replaced by a copy without those rows (copy-on-write),
     and the winners are added; it asserts the snapshot `find` checked, and a conflict
     re-reads the table and decides again (`sink_iceberg`'s protocol).
Cost: step 2 reads the key columns of every file the key filter cannot rule out, and step 4
rewrites every file holding a replaced key; a table partitioned by `bucket(N, key)` keeps
both to the files of the batch's buckets.
"""

from __future__ import annotations

import io
import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import psycopg2.extensions
import pyarrow as pa
from psycopg2 import sql

from offsetflow.commit import (
    TOPIC_ID_COLUMN,
    WINNERS,
    Moved,
    newer_or_same,
    not_deleted,
    remember_deletions,
    stage_winners,
)
from offsetflow.config import IcebergConfig
from offsetflow.errors import IcebergBatchOpenError, SchemaMismatchError
from offsetflow.ledger import Batch, stage_table
from offsetflow.sinks.iceberg.keys import COORDINATES, key_filter, key_mask, window_mask
from offsetflow.stage import binary_encoder

if TYPE_CHECKING:
    from pyiceberg.table import FileScanTask, Table, Transaction
    from pyiceberg.table.metadata import TableMetadata

    from offsetflow.sinks.iceberg.sink import IcebergSink

log = logging.getLogger(__name__)

CURRENT = sql.Identifier("offsetflow_iceberg_current")  # the table's rows step 2 read
SCRATCH = sql.Identifier("offsetflow_iceberg_scan")  # one file's candidate rows
KEY_CHUNK = 50_000  # keys per table scan (and per read of the files it names)


def memory_name(iceberg: IcebergConfig, identifier: str) -> str:
    """The table's name in `offsetflow.deleted_keys`: never a PostgreSQL `schema.table`."""
    return f"iceberg:{iceberg.catalog_name}:{identifier}"


def row_columns(key: Sequence[str], has_ts: bool) -> list[str]:
    """What the rule reads of a table row: its key, coordinates, timestamp and topic id."""
    return [*key, *(c for c in COORDINATES if c not in key),
            *(["timestamp"] if has_ts and "timestamp" not in key else []), TOPIC_ID_COLUMN]


def _deletes(columns: Sequence[str], tombstones: str) -> bool:
    return "value" in columns and tombstones == "delete"


def prepare(sink: IcebergSink, cur: psycopg2.extensions.cursor, batch: Batch) -> int:
    """Step 1 (the write and the find path alike): the winners and the deletions memory.
    Returns the dead letters it routed."""
    spec = sink.spec
    assert spec.dead_letter_table is not None  # config: upsert always has one
    lock_table(cur, memory_name(sink.iceberg, sink.identifier(batch)))
    dead = stage_winners(cur, batch, stage_table(batch.batch_id), spec.columns, spec.key,
                         spec.tombstones, spec.dead_letter_table)
    if _deletes(spec.columns, spec.tombstones):
        remember_deletions(cur, batch, memory_name(sink.iceberg, sink.identifier(batch)),
                           spec.key, "timestamp" in spec.columns)
    return dead


def lock_table(cur: psycopg2.extensions.cursor, memory: str) -> None:
    """Serialise the upserts into one table until the ledger transaction ends: an upsert
    decides with the table and the deletions memory as committed, and a batch's deletions
    are remembered only when its ledger transaction commits, after its Iceberg commit (in
    PostgreSQL, row locks and READ COMMITTED do this)."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (memory,))


def write_upsert(sink: IcebergSink, cur: psycopg2.extensions.cursor, batch: Batch) -> Moved:
    """`IcebergSink.write` in upsert mode; see the module docstring."""
    from offsetflow.sinks.iceberg.commit import commit_snapshot

    moved = sink.route_dead_letters(cur, batch)
    ident = sink.identifier(batch)
    table = sink.table(ident)
    # a record whose nested value the table's types refuse is a dead letter before the
    # winners are decided (it never wins its key); `find` routes the same ones again
    moved.dead += sink.route_unfit(cur, batch, table)
    moved.dead += prepare(sink, cur, batch)
    missing = _missing(table, sink)
    if missing:
        raise SchemaMismatchError(
            f"batch {batch.batch_id}: the Iceberg table {ident} has no column(s) {missing}, "
            f"which mode: upsert reads (the key, the coordinates, {TOPIC_ID_COLUMN}); "
            f"upsert into a table OffsetFlow creates in that mode (a new sink.table)")
    plan = _Plan(sink, cur, batch, memory_name(sink.iceberg, ident), moved.dead)
    t = time.monotonic()
    rows = commit_snapshot(table, batch, None, {}, build=plan.stage_into, ledger=sink.ledger_id)
    log.info("batch %d: upsert into Iceberg decided, written and committed in %.2f s (%d "
             "rows written, %d data files rewritten)", batch.batch_id, time.monotonic() - t,
             plan.written, plan.rewritten)
    moved.rows = plan.written if rows is None else rows
    return moved


class _Plan:
    """Steps 2-4 for one attempt of the catalog commit (again after a conflict)."""

    def __init__(self, sink: IcebergSink, cur: psycopg2.extensions.cursor, batch: Batch,
                 memory: str, dead: int) -> None:
        self.sink, self.cur, self.batch, self.memory = sink, cur, batch, memory
        self.dead = dead  # for the snapshot summary
        spec = sink.spec
        self.key = list(spec.key)
        self.has_ts = "timestamp" in spec.columns
        self.deletes = _deletes(spec.columns, spec.tombstones)
        types = dict(sink.columns)
        self.cols = row_columns(self.key, self.has_ts)
        self.types = [types.get(c, "text") for c in self.cols]
        self.written = 0
        self.rewritten = 0

    # -- the commit ----------------------------------------------------------------------
    def stage_into(self, table: Table) -> Transaction:
        """Decide against `table` as loaded now and add one overwrite to a new transaction
        of it (the caller, `sink_iceberg_commit.commit_snapshot`, commits it)."""
        batch = self.batch
        if batch.kind in ("replay", "backfill"):
            self._refuse_unremembered(table)
        tasks = self._load_current(table)
        drop = self._decide()
        self.written = self._count_inserts()
        summary = self.sink.summary(self.cur, batch, self.written, self.dead)
        txn = table.transaction()  # its files named by the batch (`commit_snapshot`)
        self._evolve(txn, table)
        commit_uuid, counter = uuid.uuid4(), itertools.count(0)
        self.rewritten = 0
        with txn.update_snapshot(snapshot_properties=summary).overwrite(commit_uuid) as snap:
            for path, positions in drop.items():
                task = tasks[path]
                # a file's rows kept as it had them: with the table's schema as loaded
                # (an evolved column reads null in them, as in any older file)
                kept = _without(self._read(table, task, None), positions)
                snap.delete_data_file(task.file)
                for f in self._files(table.metadata, table, kept, commit_uuid, counter):
                    snap.append_data_file(f)
                self.rewritten += 1
            # the winners with the schema the commit makes current (its field ids)
            for chunk in self._inserts(table, txn.table_metadata):
                for f in self._files(txn.table_metadata, table, chunk, commit_uuid, counter):
                    snap.append_data_file(f)
        return txn

    def _evolve(self, txn: Transaction, table: Table) -> None:
        """format.schema_evolution: the schema update first in the snapshot's transaction,
        so the columns and the batch's rows are one catalog commit (`sink_iceberg_evolve`);
        never to a key column (`refuse_key_changes`). Decided again on each round's load
        of the table, as the rows are."""
        from offsetflow.sinks.iceberg.evolve import evolve_schema

        add = self.sink.spec.add_columns
        nested = self.sink.nested if self.sink.nested_evolution else {}
        if not add and not nested:
            return
        name = ".".join(table.name())
        done = evolve_schema(txn, name, add, self.batch.audit_id, self.key, nested)
        if done:
            log.info("batch %d: Iceberg table %s: %s, in the upsert's commit",
                     self.batch.batch_id, name, ", ".join(done))

    def _refuse_unremembered(self, table: Table) -> None:
        """A replay/backfill decides only when no other batch the table holds is open in the
        ledger: such a batch committed to Iceberg and died before the ledger commit, so its
        deletions are not remembered, and the window's older rows of a key it deleted would
        be written back (the lock of `lock_table` covers a batch committing now)."""
        from pyiceberg.table.snapshots import ancestors_of

        from offsetflow.config import summary_batch

        self.cur.execute("SELECT pipeline, batch_id FROM offsetflow.batches WHERE status IN "
                         "('planned', 'running', 'failed') AND batch_id <> %s",
                         (self.batch.batch_id,))
        open_batches = self.cur.fetchall()
        if not open_batches:
            return
        for snap in ancestors_of(table.current_snapshot(), table.metadata):
            summary = snap.summary.additional_properties if snap.summary else {}
            for pipeline, bid in open_batches:
                if summary_batch(summary, pipeline, bid) is not None:
                    b = self.batch
                    raise IcebergBatchOpenError(
                        f"batch {b.batch_id} ({b.kind} of pipeline {b.pipeline}): the "
                        f"Iceberg table {'.'.join(table.name())} holds batch {bid} of "
                        f"pipeline {pipeline} (snapshot {snap.snapshot_id}), which the "
                        f"ledger has not committed (killed between its two commits), so "
                        f"its deletions are not remembered yet and this {b.kind} could "
                        f"bring a deleted key back; complete batch {bid} first (`offsetflow "
                        f"run-batch --pipeline {pipeline} --batch-id {bid}`), then run batch "
                        f"{b.batch_id} again")

    # -- step 2: the table's rows for the batch's keys (and the window) ------------------
    def _load_current(self, table: Table) -> dict[str, FileScanTask]:
        cur = self.cur
        col_defs = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                                      for c, t in zip(self.cols, self.types, strict=True))
        for t in (CURRENT, SCRATCH):
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(t))
        cur.execute(sql.SQL("CREATE TEMP TABLE {} (file text NOT NULL, pos bigint NOT NULL, "
                            "{}, in_window boolean NOT NULL DEFAULT false, gone boolean NOT "
                            "NULL DEFAULT false, PRIMARY KEY (file, pos)) ON COMMIT DROP")
                    .format(CURRENT, col_defs))
        cur.execute(sql.SQL("CREATE TEMP TABLE {} (file text, pos bigint, {}) ON COMMIT DROP")
                    .format(SCRATCH, col_defs))
        tasks: dict[str, FileScanTask] = {}
        if table.current_snapshot() is None:
            return tasks
        match = sql.SQL(" AND ").join(sql.SQL("s.{k} = w.{k}").format(k=sql.Identifier(k))
                                      for k in self.key)
        for keys in self._key_chunks():
            for task in table.scan(row_filter=key_filter(self.key, keys)).plan_files():
                tasks[task.file.file_path] = task
                rows = self._read(table, task, self.cols)
                mask = key_mask(rows, self.key, keys)
                self._to_scratch(task.file.file_path, rows, mask)
            # exactly the winners' keys (the filter and the mask allow every combination of
            # the chunk's key values); a row of several key columns can pass two chunks'
            # masks (its values in one chunk's keys, its key in another): kept once
            cur.execute(sql.SQL("INSERT INTO {c} SELECT s.* FROM {s} s WHERE EXISTS (SELECT 1 "
                                "FROM {w} w WHERE {m}) ON CONFLICT (file, pos) DO NOTHING")
                        .format(c=CURRENT, s=SCRATCH, w=WINNERS, m=match))
            cur.execute(sql.SQL("TRUNCATE {}").format(SCRATCH))
        if self.batch.kind in ("replay", "backfill"):
            from offsetflow.sinks.iceberg.commit import window_filter

            for task in table.scan(row_filter=window_filter(self.batch)).plan_files():
                tasks[task.file.file_path] = task
                rows = self._read(table, task, self.cols)
                self._to_scratch(task.file.file_path, rows, window_mask(rows, self.batch))
            names = sql.SQL(", ").join(sql.Identifier(c) for c in ["file", "pos", *self.cols])
            cur.execute(sql.SQL("INSERT INTO {c} ({n}, in_window) SELECT {n}, true FROM {s} "
                                "ON CONFLICT (file, pos) DO UPDATE SET in_window = true")
                        .format(c=CURRENT, n=names, s=SCRATCH))
        return tasks

    def _key_chunks(self) -> Iterator[pa.Table]:
        """The winners' keys, KEY_CHUNK at a time (a server-side cursor), in key order: a
        chunk's least and greatest values (`key_filter`) then rule out files whose key
        range lies elsewhere, where a long `In` list cannot."""
        names = sql.SQL(", ").join(sql.Identifier(k) for k in self.key)
        with self.cur.connection.cursor(name="offsetflow_iceberg_keys") as kc:
            kc.itersize = KEY_CHUNK
            kc.execute(sql.SQL("SELECT {n} FROM {w} ORDER BY {n}").format(n=names, w=WINNERS))
            while rows := kc.fetchmany(KEY_CHUNK):
                yield pa.table({k: [bytes(r[i]) if isinstance(r[i], memoryview) else r[i]
                                    for r in rows] for i, k in enumerate(self.key)})

    def _read(self, table: Table, task: FileScanTask, columns: Sequence[str] | None
              ) -> pa.Table:
        """One data file as the table reads it (its delete files applied), every row."""
        from pyiceberg.expressions import AlwaysTrue
        from pyiceberg.io.pyarrow import ArrowScan

        schema = table.schema() if columns is None else table.schema().select(*columns)
        return ArrowScan(table.metadata, table.io, schema, AlwaysTrue()).to_table([task])

    def _to_scratch(self, path: str, rows: pa.Table, mask: np.ndarray) -> None:
        pos = np.flatnonzero(mask)
        if not len(pos):
            return
        picked = rows.select(self.cols).take(pa.array(pos))
        data = pa.table([pa.array(np.full(len(pos), path, dtype=object), pa.string()),
                         pa.array(pos.astype(np.int64)), *picked.columns],
                        names=["file", "pos", *self.cols])
        fmt, payload = binary_encoder(["text", "bigint", *self.types])(
            data.combine_chunks().to_batches()[0])
        self.cur.copy_expert(sql.SQL("COPY {} FROM STDIN WITH (FORMAT {})").format(
            SCRATCH, sql.SQL(fmt)), io.BytesIO(payload))

    # -- step 3: the rule, in SQL ---------------------------------------------------------
    def _decide(self) -> dict[str, np.ndarray]:
        """Marks the rows that go; returns their positions per data file."""
        cur, batch = self.cur, self.batch
        # a replay/backfill replaces what its window produced (rows of another incarnation
        # of the topic, same offsets again, are not the window's: as `delete_range_rows`)
        cur.execute(sql.SQL(
            "UPDATE {c} c SET gone = true WHERE c.in_window AND NOT COALESCE(c.{tid} <> ("
            "SELECT br.topic_id FROM offsetflow.batch_ranges br WHERE br.batch_id = %s AND "
            "br.topic = c.topic AND br.partition = c.partition), false)").format(
                c=CURRENT, tid=sql.Identifier(TOPIC_ID_COLUMN)), (batch.batch_id,))
        match = self._match("c", "w")
        if self.deletes:  # as upsert.apply_upsert's DELETE
            cur.execute(sql.SQL("UPDATE {c} c SET gone = true FROM {w} w WHERE NOT c.gone "
                                "AND w.value IS NULL AND {m} AND {rule}").format(
                                    c=CURRENT, w=WINNERS, m=match,
                                    rule=newer_or_same("w", "c", self.has_ts)))
        # a written winner replaces its key's row (the ON CONFLICT DO UPDATE)
        cur.execute(sql.SQL("UPDATE {c} c SET gone = true FROM {w} w WHERE NOT c.gone AND "
                            "{m} AND {ins}").format(c=CURRENT, w=WINNERS, m=match,
                                                    ins=self._written("w")))
        cur.execute(sql.SQL("SELECT file, array_agg(pos ORDER BY pos) FROM {} WHERE gone "
                            "GROUP BY file").format(CURRENT))
        return {f: np.asarray(p, dtype=np.int64) for f, p in cur.fetchall()}

    def _match(self, a: str, b: str) -> sql.Composable:
        return sql.SQL(" AND ").join(
            sql.SQL("{a}.{k} = {b}.{k}").format(a=sql.Identifier(a), b=sql.Identifier(b),
                                                k=sql.Identifier(k)) for k in self.key)

    def _written(self, w: str) -> sql.Composable:
        """SQL: winner `w` is written: live, and newer than (or the same as) every row its
        key still has (`apply_upsert`'s INSERT ... ON CONFLICT DO UPDATE WHERE rule)."""
        live = (not_deleted(w, self.memory, self.key, self.has_ts) if self.deletes
                else sql.SQL("true"))
        return sql.SQL("({live} AND NOT EXISTS (SELECT 1 FROM {c} o WHERE NOT o.gone AND "
                       "{m} AND NOT {rule}))").format(
                           live=live, c=CURRENT, m=self._match("o", w),
                           rule=newer_or_same(w, "o", self.has_ts))

    def _count_inserts(self) -> int:
        """The winners written (`_written` holds for the same ones once `_decide` marked
        the rows they replace gone: those are rows they are newer than)."""
        self.cur.execute(sql.SQL("SELECT count(*) FROM {w} w WHERE {ins}").format(
            w=WINNERS, ins=self._written("w")))
        row = self.cur.fetchone()
        return int(row[0]) if row else 0

    # -- step 4: the files ----------------------------------------------------------------
    def _inserts(self, table: Table, meta: TableMetadata) -> Iterator[pa.Table]:
        """The written winners as Arrow in the schema of `meta` (the table's, evolved in
        the commit's transaction), KEY_CHUNK rows at a time."""
        from offsetflow.sinks.iceberg.stage import read_stage

        cols = [*self.sink.columns, (TOPIC_ID_COLUMN, "text")]
        names = sql.SQL(", ").join(sql.Identifier(c) for c, _ in cols)
        order = sql.SQL(", ").join(sql.Identifier(k) for k in self.key)
        self.cur.execute(sql.SQL("DROP TABLE IF EXISTS offsetflow_iceberg_written"))
        self.cur.execute(sql.SQL(
            "CREATE TEMP TABLE offsetflow_iceberg_written ON COMMIT DROP AS SELECT "
            "row_number() OVER (ORDER BY {o}) AS rn, {n} FROM {w} w WHERE {ins}").format(
                o=order, n=names, w=WINNERS, ins=self._written("w")))
        for lo in range(0, self.written, KEY_CHUNK):
            src = sql.SQL("(SELECT {n} FROM offsetflow_iceberg_written WHERE rn > {lo} AND "
                          "rn <= {hi}) w").format(n=names, lo=sql.Literal(lo),
                                                  hi=sql.Literal(lo + KEY_CHUNK))
            data = read_stage(self.cur, self.batch.batch_id, cols, False, source=src)
            yield _in_schema(_nested_in(data, table, meta, self.batch,
                                        self.sink.protobuf_text), table, meta,
                             self.batch)

    def _files(self, meta: TableMetadata, table: Table, data: pa.Table,
               commit_uuid: uuid.UUID, counter: itertools.count[int]) -> list[Any]:
        """`data` as data files of `meta`'s schema (its field ids) and partition spec."""
        from pyiceberg.io.pyarrow import _dataframe_to_data_files  # noqa: PLC2701 - no public API

        if not data.num_rows:
            return []
        return list(_dataframe_to_data_files(table_metadata=meta, df=data,
                                             io=table.io, write_uuid=commit_uuid,
                                             counter=counter))


def _missing(table: Table, sink: IcebergSink) -> list[str]:
    names = set(table.schema().column_names)
    return [c for c in row_columns(sink.spec.key, "timestamp" in sink.spec.columns)
            if c not in names]


def _in_schema(data: pa.Table, table: Table, meta: TableMetadata, batch: Batch) -> pa.Table:
    """The winners as the table (its schema in `meta`) takes them, else the append
    path's SchemaMismatchError."""
    from pyiceberg.io.pyarrow import _check_pyarrow_schema_compatible  # noqa: PLC2701 - no public API

    from offsetflow.sinks.iceberg.commit import schema_mismatch

    try:
        _check_pyarrow_schema_compatible(meta.schema(), provided_schema=data.schema,
                                         format_version=meta.format_version)
    except ValueError as e:
        raise schema_mismatch(batch, table, e) from e
    return data


def _nested_in(data: pa.Table, table: Table, meta: TableMetadata, batch: Batch,
               protobuf: bool) -> pa.Table:
    """The winners' JSON text parsed into the struct, list and map columns of `meta`'s
    schema (the one the commit makes current). The records that do not fit were dead
    letters before the winners were decided (`IcebergSink.route_unfit`, with the same
    schema): one refused here means the table's types changed since (another writer),
    and the round is refused by name, nothing committed."""
    from offsetflow.sinks.iceberg.nested import fit_table

    fitted, unfit = fit_table(data, meta.schema(), ".".join(table.name()), protobuf)
    if unfit:
        (topic, partition, offset), why = min(unfit.items())
        raise SchemaMismatchError(
            f"batch {batch.batch_id}: the nested value of {topic}/{partition}@{offset} no "
            f"longer fits Iceberg table {'.'.join(table.name())} ({why}): its types changed "
            f"while the batch was committed. Nothing was written; run the batch again")
    return fitted


def _without(rows: pa.Table, positions: np.ndarray) -> pa.Table:
    keep = np.ones(rows.num_rows, dtype=bool)
    keep[positions] = False
    return rows.filter(pa.array(keep))
