"""The commit's check that the tasks' data files were written for the very table it commits
to (`sink_iceberg_staged.check_files_table`), on real pyiceberg tables in a SQLite catalog:
a table dropped and created again under the same name has another UUID."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from offsetflow.errors import IcebergTableReplacedError, StagedRowsLostError
from offsetflow.sinks.iceberg.staged import StagedFiles, check_files_table


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("t", uri=f"sqlite:///{tmp_path / 'catalog.db'}",
                     warehouse=f"file://{tmp_path / 'warehouse'}")
    cat.create_namespace("lake")
    return cat


def _files(by_part: dict[int, str | None]) -> StagedFiles:
    return StagedFiles({p: [{"path": f"/w/p{p}.parquet", "records": 1,
                             **({} if u is None else {"table_uuid": u})}]
                        for p, u in by_part.items()})


def test_files_of_a_replaced_table_are_refused_naming_the_table_and_both_uuids(
        catalog: Any) -> None:
    schema = pa.schema([("event_id", pa.string())])
    old = catalog.create_table("lake.t", schema=schema)
    old_uuid = str(old.metadata.table_uuid)
    check_files_table(old, _files({0: old_uuid, 1: old_uuid}), 7)  # the same table: fine
    catalog.drop_table("lake.t")
    new = catalog.create_table("lake.t", schema=schema)
    new_uuid = str(new.metadata.table_uuid)
    assert new_uuid != old_uuid
    with pytest.raises(IcebergTableReplacedError) as e:
        check_files_table(new, _files({0: old_uuid, 1: new_uuid, 2: old_uuid}), 7)
    assert isinstance(e.value, StagedRowsLostError)  # so the commit drops those parts
    assert e.value.parts == [0, 2]
    msg = str(e.value)
    assert "batch 7" in msg and "lake.t" in msg and old_uuid in msg and new_uuid in msg


def test_files_listed_without_a_uuid_are_taken_as_the_tables(catalog: Any) -> None:
    """Markers of an OffsetFlow before the check record no UUID: not refused forever."""
    table = catalog.create_table("lake.t", schema=pa.schema([("event_id", pa.string())]))
    check_files_table(table, _files({0: None, 1: str(table.metadata.table_uuid)}), 7)
