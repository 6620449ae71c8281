"""The driver's side of task-side Iceberg data files (`offsetflow.sinks.iceberg.tasks`):
the files the batch's winning markers list, reconciled with the markers' row counts and
checked to exist, as the `DataFile`s of one fast append. No row is read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg2.extensions

from offsetflow.errors import IcebergTableReplacedError, StagedRowsLostError
from offsetflow.sinks.iceberg.datafiles import decode_data_file
from offsetflow.sinks.iceberg.files import canonical_path

if TYPE_CHECKING:
    from pyiceberg.manifest import DataFile
    from pyiceberg.table import Table


@dataclass
class StagedFiles:
    """The data files the markers list, part by part (encoded)."""

    by_part: dict[int, list[dict[str, Any]]]

    @property
    def records(self) -> int:
        return sum(int(f["records"]) for files in self.by_part.values() for f in files)

    @property
    def paths(self) -> list[str]:
        return [f["path"] for files in self.by_part.values() for f in files]


def staged_files(cur: psycopg2.extensions.cursor, batch_id: int) -> StagedFiles:
    """The files of every rows marker of the batch. A marker without a list staged its
    rows in PostgreSQL (a run before this path, or of another config): it is refused, and
    dropped with its part, so the next run writes that part's files."""
    cur.execute("""SELECT part, data_files FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows' ORDER BY part""", (batch_id,))
    rows = cur.fetchall()
    staged_in_pg = [int(p) for p, files in rows if files is None]
    if staged_in_pg:
        raise StagedRowsLostError(batch_id, staged_in_pg,
                                  f"part(s) {staged_in_pg} staged their rows in PostgreSQL, "
                                  f"not as Iceberg data files")
    return StagedFiles({int(p): list(files) for p, files in rows})


def check_files_exist(table: Table, staged: StagedFiles, batch_id: int) -> None:
    """Every listed file is still there (a maintenance sweep with too short an age could
    have taken an uncommitted batch's files): else the parts are dropped and read again."""
    from pyarrow import fs as pafs
    from pyiceberg.io.pyarrow import PyArrowFileIO

    io = PyArrowFileIO(dict(table.io.properties))
    lost: dict[int, str] = {}
    for part, files in staged.by_part.items():
        for f in files:
            scheme, netloc, path = PyArrowFileIO.parse_location(f["path"])
            info = io.fs_by_scheme(scheme, netloc).get_file_info(path)
            if info.type != pafs.FileType.File or info.size != int(f["size"]):
                lost.setdefault(part, canonical_path(f["path"]))
    if lost:
        raise StagedRowsLostError(batch_id, sorted(lost),
                                  f"data files the markers list are gone or changed (e.g. "
                                  f"{next(iter(lost.values()))})")


def check_files_table(table: Table, staged: StagedFiles, batch_id: int) -> None:
    """Every listed file was written for this very table (its UUID): one dropped and
    created again under the same name between the tasks' writes and the commit is another
    table, whose field ids and location the files do not share. Their parts are dropped and
    written again for it. A file listed without a UUID (a marker of an older OffsetFlow) is
    taken as the table's."""
    current = str(table.metadata.table_uuid)
    stale: dict[int, str] = {}
    for part, files in staged.by_part.items():
        for f in files:
            written_for = f.get("table_uuid")
            if written_for is not None and written_for != current:
                stale.setdefault(part, written_for)
    if stale:
        raise IcebergTableReplacedError(batch_id, sorted(stale), ".".join(table.name()),
                                        ", ".join(sorted(set(stale.values()))), current)


def check_files_spec(table: Table, staged: StagedFiles, batch_id: int) -> None:
    """Every listed file was written under the table's current partition spec: a fast
    append writes its files into one manifest of the current spec, so a file of another
    spec would be committed with wrong partition values, or not at all (pyiceberg's
    IndexError on a spec with more fields). Its parts are dropped and written again."""
    current = table.spec().spec_id
    stale: dict[int, int] = {}
    for part, files in staged.by_part.items():
        for f in files:
            if int(f["spec_id"]) != current:
                stale.setdefault(part, int(f["spec_id"]))
    if stale:
        raise StagedRowsLostError(batch_id, sorted(stale),
                                  f"data files were written under partition spec "
                                  f"{sorted(set(stale.values()))} of "
                                  f"{'.'.join(table.name())}, the table's is now spec "
                                  f"{current}")


def data_files(table: Table, staged: StagedFiles) -> list[DataFile]:
    """The `DataFile`s of a fast append, typed by the spec each file was written with."""
    specs = table.specs()
    schema = table.schema()
    return [decode_data_file(f, specs[int(f["spec_id"])].partition_type(schema))
            for files in staged.by_part.values() for f in files]
