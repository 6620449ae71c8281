"""The one interface a pipeline's sink offers to the run, to backfills and replays and to
the operator's repairs: `Sink`, built for a pipeline config by `offsetflow.sinks.sink_for`.

What differs between PostgreSQL, an Iceberg table and a Kafka topic is a method here; the
callers (`offsetflow.job`, `offsetflow.ops`, `offsetflow.cli`) never ask which kind of sink
they hold. Step 4 of the commit outside PostgreSQL stays the `ExternalSink` of
`offsetflow.commit` (`external` builds it; None for PostgreSQL, whose step 4 runs in the
ledger's own transaction).

Defaults are those of a sink that writes rows into a table with the pipeline's name for it
(`sink.table`); each kind overrides what it does otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg2.extensions

from offsetflow.commit import Audit, CommitSpec, ExternalSink
from offsetflow.config import PipelineConfig, split_table_name
from offsetflow.errors import RequestError
from offsetflow.ledger import Batch
from offsetflow.ranges import OffsetRange

if TYPE_CHECKING:
    from offsetflow.sinks.iceberg import TaskFiles


class Sink(ABC):
    """A pipeline's sink (`cfg.sink`), as the run, the backfill and the repairs use it."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.cfg = cfg

    # -- the run (offsetflow.job) --------------------------------------------------------
    @property
    def tasks_write_files(self) -> bool:
        """Whether the Spark tasks write the batch's rows as the sink's data files
        themselves, so the driver commits files it never reads (`task_files`)."""
        return False

    def task_files(self, dsn: str, batch: Batch, columns: Sequence[tuple[str, str]],
                   evolved: Sequence[str] = (),
                   readers: Mapping[str, tuple[int, str] | None] | None = None,
                   tasks_here: bool = False) -> TaskFiles | None:
        """What the tasks need to write the batch's data files (`tasks_write_files`), the
        `evolved` columns (format.schema_evolution's) in their schema; None when they
        stage the rows in PostgreSQL. `readers`: the run's reader schemas (topic -> id,
        text), which say what a nested (`json`) field is; `tasks_here`: the tasks run on
        the driver's host (a local master), so a directory of this host is theirs too."""
        return None

    def check_before_read(self, batch: Batch) -> None:
        """Refuse the batch before anything is read, when its commit would be refused."""
        return None

    def prepare_target(self, cur: psycopg2.extensions.cursor, batch: Batch,
                       columns: Sequence[tuple[str, str]], evolved: Sequence[str] = ()
                       ) -> bool:
        """Before staging: the target the commit writes into exists (in the ledger's
        database), with `columns` (but `evolved`: format.schema_evolution's, which the
        commit adds). Returns whether the commit alters the target."""
        return False

    @property
    def commits_partwise(self) -> bool:
        """Whether step 4 may move the batch part by part while later parts are read
        (`offsetflow.commit.PartwiseCommit`): never for a sink that commits the whole
        batch at once in step 4. A sink whose `external` is not None then returns a
        `PartwiseSink` there, which takes the parts into its uncommitted transaction."""
        return False

    @abstractmethod
    def external(self, dsn: str, columns: Sequence[tuple[str, str]] | None = None,
                 spec: CommitSpec | None = None) -> ExternalSink | None:
        """Step 4 outside PostgreSQL for one commit attempt (`dsn`: the ledger's), or None
        where step 4 runs in the ledger's transaction. Without `columns` (a check made
        before anything is read: `commit.sink_holds`) the row shape is not checked and
        nothing can be written."""

    def after_commit(self, dsn: str, batch: Batch, spec: CommitSpec) -> None:
        """Best effort after the batch committed (`spec`: its commit's); never fails it."""
        return None

    # -- backfill and replay (offsetflow.ops.backfill) -----------------------------------
    def check_window_target(self, kind: str, target_table: str | None) -> None:
        """Refuse (RequestError) a `kind` window (replay, backfill) into `target_table`
        (None: the sink's own) that this sink cannot write."""
        return None

    def check_window_repeat(self, cur: psycopg2.extensions.cursor, kind: str,
                            target_table: str | None, ranges: Sequence[OffsetRange],
                            topic_ids: Mapping[str, str], allow_duplicates: bool) -> None:
        """Refuse (RequestError) a `kind` window into `target_table` (None: the sink's own)
        that earlier windows already wrote there when the target cannot replace what they
        wrote (a Kafka topic), unless `allow_duplicates`. A table replaces it (the commit
        deletes the window's rows first): nothing to refuse."""
        return None

    def owns_table(self, name: str) -> bool:
        """Whether `name` is the pipeline's own table, however spelled."""
        return split_table_name(name) == split_table_name(self.cfg.sink.table)

    def writes_live_output(self, target_table: str | None) -> bool:
        """Whether a backfill into `target_table` (None: the sink's own) writes where the
        live batches write, so it may only cover offsets they committed."""
        return target_table is None or self.owns_table(target_table)

    def window_target(self, target_table: str | None) -> str:
        """What a replay or backfill batch records as its target (assets and lineage
        name it)."""
        return target_table or self.cfg.sink.table

    # -- audit before publish (offsetflow.ops.audit) --------------------------------------
    def audit_shadows(self, cur: psycopg2.extensions.cursor, target: str, audit_id: int
                      ) -> tuple[str, str | None]:
        """Where an audited window into `target` (the live table) is written instead: the
        shadow table and the shadow dead-letter table; RequestError where this sink cannot
        audit a window."""
        raise RequestError(
            f"pipeline {self.cfg.name}: --audit is not available for sink.type "
            f"{self.cfg.sink.type} yet (PostgreSQL and Iceberg sinks only); run the window "
            f"without --audit, or into a side table (backfill --target-table) to inspect it "
            f"first")

    def audit_diff(self, cur: psycopg2.extensions.cursor, audit: Audit
                   ) -> tuple[dict[str, Any], str]:
        """The staged window against the live rows at its coordinates, and the digest of
        those live rows that publish checks again."""
        raise RequestError(f"pipeline {self.cfg.name}: its sink cannot audit a window")

    def publish_audit(self, cur: psycopg2.extensions.cursor, audit: Audit,
                      batches: Sequence[Batch]) -> int:
        """Make the live target what a direct replay of `batches` would have made, from
        the shadow, in `cur`'s transaction; refuse (AuditConflictError) when the live rows
        of the window changed since the diff. Returns the rows published."""
        raise RequestError(f"pipeline {self.cfg.name}: its sink cannot audit a window")

    def discard_audit(self, cur: psycopg2.extensions.cursor, audit: Audit) -> None:
        """Drop what the audited window staged, in `cur`'s transaction (idempotent)."""
        return None

    # -- repairs (offsetflow.cli.repair) -------------------------------------------------
    def adopt_target(self, dsn: str, target_table: str | None, reason: str) -> str:
        """`offsetflow adopt-table`: record the table now found as `target_table` (None:
        the sink's own) as the one the pipeline's batches live in, where the sink keeps
        such a record; returns what changed, in words. RequestError where it keeps none."""
        raise RequestError(f"pipeline {self.cfg.name}: its sink keeps no record of which "
                           f"table its batches live in; adopt-table is for Iceberg sinks")

    @abstractmethod
    def complete_from(self, dsn: str, batch: Batch) -> ExternalSink:
        """The external sink whose own record `offsetflow complete` completes `batch`
        from; BatchStateError where it cannot."""

    @property
    def reset_rows_table(self) -> str | None:
        """The table in the ledger's database whose rows at or beyond a position that
        `reset-position` sets would collide with the records read from there (they are
        refused, or moved aside); None where no row can collide."""
        return None

    @property
    def live_topic(self) -> str | None:
        """The Kafka topic the sink writes the records below a position to (moving a
        position back would write them there twice); None for a table."""
        return None

    def reset_check(self, dsn: str, topic: str, partitions: Sequence[int], offset: int
                    ) -> Callable[[], None] | None:
        """The sink's own refusal of `reset-position` to `offset` (it raises), run under
        the pipeline lock; None if it has none."""
        return None
