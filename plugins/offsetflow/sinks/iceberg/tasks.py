"""Task-side Iceberg data files (`sink.type: iceberg`, `mode: append`, fused path): each
Spark task writes its part's rows as Parquet data files into the table's location, with the
table's schema (field ids) and partition spec, through one rolling writer per partition
value bounded by the table's target file size, at most `MAX_OPEN_WRITERS` open at once (the
least recently used one is closed: its partition value gets another file if it comes back);
no catalog commit in tasks.

The files are named `<batch prefix>p<part>-<attempt>-<n>.parquet` (the prefix is the one
the orphan sweep knows, `sink_iceberg_files.batch_file_prefix`; the attempt id is unique),
and listed (`sink_iceberg_datafiles`) in the part's `staged_parts` marker, written in the
same PostgreSQL transaction as its dead letters (`staging.stage_rows(files=...)`). A task
attempt that dies, or whose marker loses to another attempt's, leaves only files no marker
names: orphans of this batch, which the driver deletes after the batch's commit. The driver
commits the markers' files in one catalog commit (`sink_iceberg.IcebergSink.write`) and
never reads a row.

Tombstones the pipeline routes to dead letters (`tombstones: dead_letter`) are not written
to files: they go to the part's PostgreSQL stage table, where the commit routes them as on
every other path.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.errors import IcebergLayoutError, SchemaMismatchError
from offsetflow.sinks.iceberg.datafiles import encode_data_file
from offsetflow.sinks.iceberg.evolve import schema_signature
from offsetflow.sinks.iceberg.layout import CORE_PIN
from offsetflow.sinks.iceberg.nested import keep_mask, rows_fit
from offsetflow.sinks.iceberg.warehouse import writing_to
from offsetflow.stage import stage_form

if TYPE_CHECKING:
    from pyiceberg.table import Table
    from pyiceberg.table.metadata import TableMetadata

log = logging.getLogger(__name__)

# open Parquet writers per task attempt (each holds a ~1 MB output buffer and an fd): a part
# whose rows span more partition values closes the least recently used one
MAX_OPEN_WRITERS = 32

# test-only fault hook in the task: `kill-after-files:<flag>` SIGKILLs the first attempt
# (the one that creates <flag>) after its files are written, before its marker commits;
# `pause-after-files:<flag>` makes part 0's attempt create <flag> there and wait until the
# test removes it; `note-open:<dir>` writes the attempt's peak of open writers to
# <dir>/p<part>-<attempt>
TASK_FAULT_ENV = "OFFSETFLOW_ICEBERG_TASK_FAULT"


def task_fault() -> str:
    """Test-only: TASK_FAULT_ENV's fault, or with `@<path>` what that file holds now (no
    fault while it is absent). Spark starts a Python daemon and new workers for every
    distinct task environment, so a test session sets the variable once and writes the file
    per fault instead of setting another value each time."""
    want = os.environ.get(TASK_FAULT_ENV, "")
    if not want.startswith("@"):
        return want
    try:
        with open(want[1:]) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


@dataclass(frozen=True)
class TaskFiles:
    """What a task needs to write one batch's data files: plain values shipped to tasks."""

    batch_id: int
    table_name: str
    metadata_json: str  # the table's metadata as the driver loaded it
    # FileIO settings (object-store credentials the tasks need to write): never in a repr
    io_properties: dict[str, str] = dc_field(repr=False)
    prefix: str  # sink_iceberg_files.batch_file_prefix(batch)
    target_bytes: int
    tombstones_to_stage: bool  # tombstones go to the stage (the commit routes them)
    # format.type protobuf: nested texts are its JSON mapping (`nested.json_mapping_number`)
    protobuf_text: bool = False

    @classmethod
    def of(cls, table: Table, batch_id: int, prefix: str, target_bytes: int,
           tombstones_to_stage: bool, metadata: TableMetadata | None = None,
           protobuf_text: bool = False) -> TaskFiles:
        """`metadata`: the table's with the batch's schema evolution staged (its field
        ids are the files'), else the table's as loaded."""
        meta = table.metadata if metadata is None else metadata
        return cls(batch_id, ".".join(table.name()), meta.model_dump_json(),
                   task_io_properties(table.io.properties), prefix, target_bytes,
                   tombstones_to_stage, protobuf_text)

    def writer(self, part: int) -> PartFiles:
        return PartFiles(self, part)


# catalog settings a FileIO never reads: the SQL catalog's database URI (with its password)
# and catalog credentials stay on the driver
_DRIVER_ONLY = ("uri", "credential", "token", "password")


def task_io_properties(props: Mapping[str, str]) -> dict[str, str]:
    """The FileIO properties shipped to the tasks: the table's, minus the catalog's own
    connection settings (`_DRIVER_ONLY`), which the tasks do not need."""
    return {k: v for k, v in props.items()
            if k not in _DRIVER_ONLY and not k.startswith(("jdbc.", "rest.", "oauth2"))}


class PartFiles:
    """One task attempt's rolling writers (one per partition value of the table's spec)."""

    def __init__(self, tf: TaskFiles, part: int) -> None:
        from pyiceberg.io import load_file_io
        from pyiceberg.io.pyarrow import schema_to_pyarrow
        from pyiceberg.schema import sanitize_column_names
        from pyiceberg.table.locations import load_location_provider
        from pyiceberg.table.metadata import TableMetadataUtil

        self.tf, self.part = tf, part
        self.meta = TableMetadataUtil.parse_raw(tf.metadata_json)
        self.schema = self.meta.schema()
        self.signature = schema_signature(self.schema)
        self.file_schema = sanitize_column_names(self.schema)
        self.spec = self.meta.spec()
        self.partition_type = self.spec.partition_type(self.schema)
        self.arrow = schema_to_pyarrow(self.file_schema, include_field_ids=True)
        self.names = [f.name for f in self.schema.fields]  # as the stage calls them
        self.io = load_file_io(dict(tf.io_properties), self.meta.location)
        self.locations = load_location_provider(self.meta.location, self.meta.properties)
        self.attempt = uuid.uuid4().hex[:12]
        self.open: dict[str, _Rolling] = {}
        self.files: list[dict[str, Any]] = []
        self.rows = 0
        self._seq = 0
        self.peak_open = 0  # most writers open at once (MAX_OPEN_WRITERS bounds it)
        self.closed_early = 0  # files closed to make room for another partition value
        # records whose nested values do not fit the table's types: dead letters, taken
        # by the staging transaction (`take_unfit`)
        self.unfit: list[dict[str, Any]] = []

    def write(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.RecordBatch | None]:
        """Write a raw chunk (reader columns + typed fields) to the part's files. Returns
        (the rows written, the tombstones that go to the stage instead or None). A
        warehouse that cannot be written is a WarehouseWriteError (`writing_to`)."""
        with writing_to(self.meta.location, f"writing part {self.part}'s data files",
                        self.tf.batch_id):
            return self._write_chunk(batch)

    def _write_chunk(self, batch: pa.RecordBatch
                     ) -> tuple[pa.RecordBatch, pa.RecordBatch | None]:
        tombstones = None
        if self.tf.tombstones_to_stage and batch.column("value").null_count:
            is_null = pc.is_null(batch.column("value"))
            tombstones = batch.filter(is_null)
            batch = batch.filter(pc.invert(is_null))
        if batch.num_rows:
            table, refused = self._to_table(batch)
            if refused:  # those records only: dead letters with their coordinates
                self._refuse(batch, refused)
                keep = keep_mask(batch.num_rows, refused)
                batch, table = batch.filter(keep), table.filter(keep)
        if batch.num_rows:
            if self.spec.is_unpartitioned():
                self._write(None, table)
            else:
                for key, rows in self._partitions(table):
                    self._write(key, rows)
            self.rows += batch.num_rows
        return batch, tombstones

    def _partitions(self, table: pa.Table) -> list[tuple[Any, pa.Table]]:
        """The chunk split by partition value. A worker that cannot compute the spec
        (pyiceberg-core missing here, though the driver has it) says so once, by name."""
        from pyiceberg.exceptions import NotInstalledError
        from pyiceberg.io.pyarrow import _determine_partitions  # noqa: PLC2701 - no public API

        try:
            return [(tp.partition_key, tp.arrow_table_partition)
                    for tp in _determine_partitions(self.spec, self.schema, table)]
        except NotInstalledError as e:
            fields = ", ".join(f"{f.transform}({self.schema.find_column_name(f.source_id)})"
                               for f in self.spec.fields)
            raise IcebergLayoutError(
                f"batch {self.tf.batch_id}: the Spark worker of part {self.part} cannot "
                f"compute the partition spec of Iceberg table {self.tf.table_name} "
                f"([{fields}]): {e}; nothing was committed. Install {CORE_PIN} where the "
                f"Spark workers run (the driver has it), or evolve the table's spec") from None

    def take_unfit(self) -> list[dict[str, Any]]:
        """The records refused since the last call (a nested value that does not fit the
        table's type), as dead-letter rows with their coordinates and why."""
        out, self.unfit = self.unfit, []
        return out

    def _refuse(self, batch: pa.RecordBatch, refused: dict[int, str]) -> None:
        idx = sorted(refused)
        rows = batch.select(["topic", "partition", "offset", "timestamp", "key", "value"]
                            ).take(pa.array(idx)).to_pylist()
        for i, row in zip(idx, rows, strict=True):
            self.unfit.append({**row, "error": f"iceberg {self.tf.table_name}: "
                                               f"{refused[i]}"})

    def close(self) -> list[dict[str, Any]]:
        """Close every open file; the encoded data files the part wrote."""
        with writing_to(self.meta.location, f"closing part {self.part}'s data files",
                        self.tf.batch_id):
            for r in self.open.values():
                self._finish(r)
        self.open.clear()
        if self.closed_early:
            log.info("part %d: %d data files closed early (more than %d partition values "
                     "open at once)", self.part, self.closed_early, MAX_OPEN_WRITERS)
        _note_open(self.part, self.attempt, self.peak_open)
        _fault(self.part, [f["path"] for f in self.files])
        return self.files

    # -- helpers -----------------------------------------------------------------------
    def _to_table(self, batch: pa.RecordBatch) -> tuple[pa.Table, dict[int, str]]:
        """The chunk in the table's Arrow schema (field ids), with the lineage column;
        and the rows whose nested values do not fit the table's types (index -> why)."""
        formed = stage_form(batch, hex_binary=False)
        types = [(n, f.type) for n, f in zip(self.names, self.arrow, strict=True)]
        have, refused = rows_fit(types, dict(zip(formed.schema.names, formed.columns,
                                                 strict=True)), self.tf.protobuf_text)
        have[LINEAGE_COLUMN] = pa.array([self.tf.batch_id] * batch.num_rows, pa.int64())
        extra = sorted(set(have) - set(self.names))
        if extra:
            raise SchemaMismatchError(f"batch {self.tf.batch_id}: its rows do not fit the "
                                      f"Iceberg table {self.tf.table_name} (columns {extra} "
                                      f"are not in the table)")
        cols = []
        for name, field in zip(self.names, self.arrow, strict=True):
            col = have.get(name)
            cols.append(pa.nulls(batch.num_rows, field.type) if col is None
                        else col.cast(field.type))
        return pa.Table.from_arrays(cols, schema=self.arrow), refused

    def _write(self, key: Any, table: pa.Table) -> None:
        """Append to the open file of `key`'s partition value (opened on first use, after
        closing the least recently used one if `MAX_OPEN_WRITERS` are open), and close it
        once it reaches the target size: the next rows start a new one."""
        path_key = "" if key is None else key.to_path()
        r = self.open.pop(path_key, None)  # put back last: `open` is in LRU order
        if r is None:
            from pyiceberg.io.pyarrow import ParquetFormatWriter

            if len(self.open) >= MAX_OPEN_WRITERS:
                self._finish(self.open.pop(next(iter(self.open))))
                self.closed_early += 1

            self._seq += 1
            name = f"{self.tf.prefix}p{self.part}-{self.attempt}-{self._seq:05d}.parquet"
            path = self.locations.new_data_location(name, key)
            out = self.io.new_output(path)
            r = _Rolling(path, key, out,
                         ParquetFormatWriter(out, self.file_schema, self.meta.properties))
        self.open[path_key] = r
        self.peak_open = max(self.peak_open, len(self.open))
        r.writer.write(table)
        r.written += table.nbytes
        fos = getattr(r.writer, "_fos", None)  # the file's true size when it can tell
        size = fos.tell() if fos is not None and hasattr(fos, "tell") else r.written
        if size >= self.tf.target_bytes:
            self._finish(r)
            del self.open[path_key]

    def _finish(self, r: _Rolling) -> None:
        from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
        from pyiceberg.typedef import Record

        stats = r.writer.close()
        df = DataFile.from_args(
            content=DataFileContent.DATA, file_path=r.path, file_format=FileFormat.PARQUET,
            partition=r.key.partition if r.key is not None else Record(),
            file_size_in_bytes=len(r.out), sort_order_id=None, equality_ids=None,
            key_metadata=None,
            **stats.to_serialized_dict())
        self.files.append({**encode_data_file(df, self.meta.default_spec_id,
                                              self.partition_type),
                           # checked at the commit: the table, and what its field ids mean
                           "table_uuid": str(self.meta.table_uuid),
                           "schema_fields": self.signature})


@dataclass
class _Rolling:
    path: str
    key: Any
    out: Any
    writer: Any
    written: int = 0  # bytes handed to the writer (Arrow, uncompressed: pyiceberg's proxy)


def _note_open(part: int, attempt: str, peak: int) -> None:
    """Test-only (TASK_FAULT_ENV `note-open:<dir>`): the attempt's peak of open writers."""
    point, _, folder = task_fault().partition(":")
    if point == "note-open" and folder:
        with open(os.path.join(folder, f"p{part}-{attempt}"), "w") as f:
            f.write(str(peak))


def _fault(part: int, paths: list[str]) -> None:
    """Test-only (TASK_FAULT_ENV); <flag> gets this attempt's pid and file paths."""
    want = task_fault()
    point, _, flag = want.partition(":")
    note = "\n".join([str(os.getpid()), *paths])
    if point == "kill-after-files" and flag:
        try:
            fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # an earlier attempt died here: this one lives
        os.write(fd, note.encode())
        os.close(fd)
        log.warning("%s: killing this task attempt (test fault)", want)
        os.kill(os.getpid(), signal.SIGKILL)
    if point == "pause-after-files" and flag and part == 0 and not os.path.exists(flag + ".done"):
        with open(flag + ".done", "w"), open(flag + ".tmp", "w") as f:
            f.write(note)
        os.rename(flag + ".tmp", flag)  # the test reads it once it exists
        deadline = time.monotonic() + 600
        while os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
