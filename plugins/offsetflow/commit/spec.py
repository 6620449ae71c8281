"""What the commit protocol (`offsetflow.commit.protocol`) is given and what it gives back: what
step 4 writes and where (`CommitSpec`), step 4's counts (`Moved`), the commit's result
(`CommitResult`), and the shape of a sink outside PostgreSQL that takes step 4
(`ExternalSink`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import psycopg2.extensions

from offsetflow.commit.dead_letters import Coordinate
from offsetflow.ledger import Batch
from offsetflow.stage import Marker, Packing


@dataclass(frozen=True)
class CommitResult:
    batch_id: int
    status: str  # committed | already_committed
    rows_written: int
    bad_records: int
    records_per_range: dict[str, int]

    @property
    def message(self) -> str:
        if self.status == "already_committed":
            return f"batch {self.batch_id} was already committed; nothing to do"
        return (f"batch {self.batch_id} committed: {self.rows_written} rows, "
                f"{self.bad_records} dead letters")


class ExternalSink(Protocol):
    """Step 4 for a sink outside PostgreSQL; see `offsetflow.commit.protocol`'s docstring. Both
    methods run inside the commit's transaction (`cur`: stage, markers and ledger are
    readable) with the batch row locked, and return step 4's counts for `record_batch`."""

    def find(self, cur: psycopg2.extensions.cursor, batch: Batch) -> Moved | None:
        """The sink's own record that this batch is committed there, or None."""

    def write(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int) -> Moved:
        """Write the staged rows and commit them in the sink, tagged with the batch id."""

    def close(self) -> None:
        """Release what `find` left open for `write` (e.g. a producer holding its fence)."""


@runtime_checkable
class PartwiseSink(ExternalSink, Protocol):
    """An `ExternalSink` that takes the stage part by part while later parts are still read
    (`offsetflow.commit.partwise.PartwiseCommit`): a Kafka topic written into one open
    transaction. Nothing it takes becomes visible before its `write` commits; `close`
    (any failure, or the run aborted) leaves nothing visible either."""

    def begin_parts(self, cur: psycopg2.extensions.cursor, batch: Batch,
                    layout: Packing | None) -> None:
        """Before the first part, in the commit's transaction with the batch row locked
        (`layout`: the parts' sub-ranges, None where unknown): fence older attempts, look
        for the batch's own record (found: nothing is taken during the read)."""

    def take_parts(self, cur: psycopg2.extensions.cursor, batch: Batch,
                   staged: Sequence[Marker]) -> None:
        """The parts newly staged (`staged`: their markers, of the layout), perhaps none:
        called every poll while the read goes on. The sink writes what it may now."""


@dataclass(frozen=True)
class CommitSpec:
    """What step 4 writes and where; the same for every attempt of a batch.

    `tombstones`: upsert `delete` | `dead_letter`; append `dead_letter` | `null_row`. A
    tombstone is a staged row whose `value` IS NULL; without a `value` column (a transform
    dropped it) or without a dead-letter table nothing is told apart."""

    columns: tuple[str, ...]
    mode: str = "append"
    key: tuple[str, ...] = ()
    tombstones: str = "dead_letter"
    dead_letter_table: str | None = None
    bad_records_staged: bool = False  # the tasks staged bad records (bad_records: dead_letter)
    quality_routes: Mapping[Coordinate, list[str]] = field(default_factory=dict)
    # the batch's config fingerprint as this run took it up; None: not checked
    config_fingerprint: str | None = None
    # the stage generation this run staged under (None: not checked), and whether part k
    # is sub-range k of the batch's split (the fused path) or a Spark partition of a
    # transform's output
    stage_generation: int | None = None
    subrange_parts: bool = False
    external: ExternalSink | None = None  # step 4 outside PostgreSQL (Iceberg, Kafka)
    # the tasks wrote the rows to the sink's files, listed in their markers (the stage holds
    # only tombstones routed by policy): the sink reconciles the markers, the stage is not
    # counted against them (`sinks.task_data_files`)
    task_files: bool = False
    # format.schema_evolution: the evolved columns (name, PostgreSQL type) step 1's end adds
    # to the target or widens in the commit's transaction (`tables.evolve_target`)
    add_columns: tuple[tuple[str, str], ...] = ()
    # the value the rows already in the target take in an added column: the reader schema's
    # default as a record of an older writer gets it (`source.field_defaults`); none: NULL
    column_defaults: Mapping[str, object] = field(default_factory=dict)
    # the registry formats: each topic's reader schema id this run decoded with (None: the
    # writer's), recorded with the writer ids the markers name (`batches.schemas`)
    readers: Mapping[str, int | None] | None = None

    @property
    def routes_tombstones(self) -> bool:
        return (self.mode == "append" and self.tombstones == "dead_letter"
                and "value" in self.columns and self.dead_letter_table is not None)


@dataclass
class Moved:
    """Step 4's counts; `PartwiseCommit` adds to them part by part."""

    rows: int = 0
    dead: int = 0
    per_range: dict[str, int] = field(default_factory=dict)
    # step 4's own split of its wall time (an external sink's phases, e.g. a Kafka sink's
    # produce and commit), added to the batch's timings
    timings: dict[str, float] = field(default_factory=dict)
