"""The Iceberg sink behind the pipeline's `Sink` interface: step 4 is `IcebergSink` (one
snapshot per batch), the tasks may write the data files themselves, and what the table
cannot do (an index on coordinates, a memory of an upsert's deleted keys) is refused by
name."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psycopg2.extensions
import pyarrow as pa

from offsetflow.commit import Audit, CommitSpec
from offsetflow.config import IcebergConfig, PipelineConfig, resolve_identifier
from offsetflow.errors import BatchStateError
from offsetflow.ledger import Batch
from offsetflow.sinks.base import Sink
from offsetflow.sinks.iceberg.maint import (
    refuse_rows_beyond,
    sweep_after_retry,
    sweep_batch_orphans,
)
from offsetflow.sinks.iceberg.nested import nested_column_types
from offsetflow.sinks.iceberg.sink import IcebergSink, sink_of
from offsetflow.sinks.iceberg.tasks import TaskFiles


class IcebergPipelineSink(Sink):
    """`sink.type: iceberg`."""

    def __init__(self, cfg: PipelineConfig) -> None:
        super().__init__(cfg)
        assert cfg.sink.iceberg is not None
        self.iceberg: IcebergConfig = cfg.sink.iceberg
        # the run's nested column types (`task_files`): name -> Arrow struct/list/map
        self.nested: dict[str, pa.DataType] = {}

    # -- the run ---------------------------------------------------------------------------
    @property
    def tasks_write_files(self) -> bool:
        """An append without a transform or a quality suite: the tasks write the table's
        data files (`offsetflow.sinks.iceberg.tasks`). Those two (and `mode: upsert`) read
        the batch's rows from the PostgreSQL stage, so they stage there as before."""
        cfg = self.cfg
        return cfg.sink.mode == "append" and not cfg.transform and not cfg.quality_suite

    def task_files(self, dsn: str, batch: Batch, columns: Sequence[tuple[str, str]],
                   evolved: Sequence[str] = (),
                   readers: Mapping[str, tuple[int, str] | None] | None = None,
                   tasks_here: bool = False) -> TaskFiles | None:
        """The table's metadata as loaded, or created, now (the tasks need its schema and
        partition spec; the rows must fit the schema), with the `evolved` columns' schema
        update staged (their field ids are the files'; the commit makes the update). A
        `json` column whose reader schema (`readers`) gives a record, array or map is a
        struct, list or map column of a table created here or by the stage path's commit
        (`sink_iceberg_nested`; never a column of sink.key). When the tasks stage in
        PostgreSQL instead (a transform, whose run calls this with its output columns,
        upsert, a quality suite), None, after the `evolved` columns and the nested fields
        (`readers`: a table whose column is a struct) are checked against the table as it
        is: a change the commit would refuse stops the batch here, before the tasks read,
        and a nested field the table's struct lacks is refused by name (or evolved under
        add_columns), never each record a dead letter."""
        cfg = self.cfg
        self.nested = self.nested_types(columns, readers)
        if not self.tasks_write_files and not evolved and not self.nested:
            return None
        sink = self.external(dsn, columns, CommitSpec(
            columns=tuple(c for c, _ in columns), mode=cfg.sink.mode, key=tuple(cfg.sink.key),
            tombstones=cfg.tombstone_policy, dead_letter_table=cfg.dead_letter_table,
            add_columns=tuple((c, t) for c, t in columns if c in set(evolved))))
        try:
            if not self.tasks_write_files:
                sink.check_evolution(batch)
                return None
            return sink.task_files(batch)
        finally:
            sink.close()

    def nested_types(self, columns: Sequence[tuple[str, str]],
                     readers: Mapping[str, tuple[int, str] | None] | None
                     ) -> dict[str, pa.DataType]:
        """The run's nested column types (name -> Arrow struct/list/map) from its reader
        schemas (Avro's; Protobuf's and JSON Schema's latest: `nested_column_types`), in
        every mode; never a sink.key column (an upsert matches rows by it)."""
        cfg = self.cfg
        return {c: t for c, t in nested_column_types(
            cfg.format_type, self.json_columns(columns), readers).items()
            if c not in cfg.sink.key}

    def json_columns(self, columns: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
        """`columns` with those holding a `json` field's JSON text as jsonb (what
        `nested_column_types` types): the fused path's jsonb ones; after a transform, a
        string column under a format.schema `json` field's name (the text passed on), never
        a struct, array or map the transform made (its own type, not the reader's: JSON
        text, as before)."""
        if not self.cfg.transform:
            return list(columns)
        schema = self.cfg.schema
        return [(c, "jsonb" if t == "text" and schema.get(c) == "json" else
                 "text" if t == "jsonb" else t) for c, t in columns]

    def external(self, dsn: str, columns: Sequence[tuple[str, str]] | None = None,
                 spec: CommitSpec | None = None) -> IcebergSink:
        sink = sink_of(self.cfg, dsn, columns, spec)
        sink.nested = dict(self.nested)  # the commit evolves nested fields as the tasks saw
        sink.nested_evolution = self.cfg.schema_evolution == "add_columns"
        return sink

    def prepare_target(self, cur: psycopg2.extensions.cursor, batch: Batch,
                       columns: Sequence[tuple[str, str]], evolved: Sequence[str] = ()
                       ) -> bool:
        """Before anything is read: the table is the one the ledger's batches live in
        (`sink_iceberg_identity`), or there is none and the commit may create it. A run
        whose tasks write the data files checked it already when it loaded the table; with
        the catalog's PostgreSQL unknown here (the ledger's), the commit checks it."""
        if self.tasks_write_files or not self.cfg.sink.connection:
            return False
        sink = self.external(self.cfg.sink.connection, columns)
        try:
            sink.check_in(cur, sink.identifier(batch))
        finally:
            sink.close()
        return False

    def adopt_target(self, dsn: str, target_table: str | None, reason: str) -> str:
        """`offsetflow adopt-table`: see `IcebergSink.adopt`."""
        sink = self.external(dsn)
        try:
            return sink.adopt(resolve_identifier(self.iceberg, self.cfg.sink.table,
                                                 target_table or self.cfg.sink.table), reason)
        finally:
            sink.close()

    def after_commit(self, dsn: str, batch: Batch, spec: CommitSpec) -> None:
        """Data files no snapshot adds go: those of task attempts that died or lost their
        marker (the tasks wrote the files), else those of the batch's dead attempts."""
        if spec.task_files:
            sweep_batch_orphans(self.cfg, dsn, batch.batch_id)
        elif batch.attempts > 1:
            sweep_after_retry(self.cfg, dsn, batch.batch_id)

    # -- backfill and replay ---------------------------------------------------------------
    def owns_table(self, name: str) -> bool:
        """By the resolved identifier (`t` and `offsetflow.t` are one table here)."""
        return (resolve_identifier(self.iceberg, self.cfg.sink.table, name)
                == self.iceberg.identifier)

    # -- audit before publish: a branch of the live table (`sinks.iceberg.auditing`) ---------
    def audit_shadows(self, cur: psycopg2.extensions.cursor, target: str, audit_id: int
                      ) -> tuple[str, str | None]:
        from offsetflow.sinks.iceberg import auditing

        return auditing.audit_shadows(self.cfg, cur, target, audit_id)

    def audit_diff(self, cur: psycopg2.extensions.cursor, audit: Audit
                   ) -> tuple[dict[str, Any], str]:
        from offsetflow.sinks.iceberg import auditing

        return auditing.audit_diff(self.cfg, cur, audit)

    def publish_audit(self, cur: psycopg2.extensions.cursor, audit: Audit,
                      batches: Sequence[Batch]) -> int:
        from offsetflow.sinks.iceberg import auditing

        return auditing.publish_audit(self.cfg, cur, audit, batches)

    def discard_audit(self, cur: psycopg2.extensions.cursor, audit: Audit) -> None:
        from offsetflow.sinks.iceberg import auditing

        auditing.discard_audit(self.cfg, cur, audit)

    # -- repairs ---------------------------------------------------------------------------
    def complete_from(self, dsn: str, batch: Batch) -> IcebergSink:
        if self.cfg.sink.mode == "upsert":  # its find would skip the deletions memory
            raise BatchStateError(  # (review s24-complete M2)
                f"batch {batch.batch_id}: complete is not offered for Iceberg upsert "
                f"pipelines (the batch's deleted keys could not be remembered); run it")
        return self.external(dsn)

    def reset_check(self, dsn: str, topic: str, partitions: Sequence[int], offset: int
                    ) -> Callable[[], None] | None:
        """No coordinates index there: rows at or beyond `offset` would be appended again
        by the next batches (`refuse_rows_beyond`)."""
        return functools.partial(refuse_rows_beyond, self.cfg, dsn, topic, partitions, offset)
