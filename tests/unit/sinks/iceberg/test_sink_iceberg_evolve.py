"""format.schema_evolution on an Iceberg table (`sink_iceberg_evolve`), on real pyiceberg
tables in a SQLite catalog: the ids the tasks write with are the ids the commit gives, the
schema update and the rows commit in one snapshot, and a column that cannot be promoted or
an id taken meanwhile is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg.types import StringType

from offsetflow.errors import SchemaMismatchError, StagedRowsLostError
from offsetflow.sinks.iceberg.evolve import (
    check_files_schema,
    evolve_schema,
    evolved_metadata,
    pending_changes,
    schema_signature,
)

ADD = (("qty", "bigint"), ("coupon", "text"), ("price", "numeric(12,2)"))


@pytest.fixture
def table(tmp_path: Path) -> Any:
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("t", uri=f"sqlite:///{tmp_path / 'catalog.db'}",
                     warehouse=f"file://{tmp_path / 'warehouse'}")
    cat.create_namespace("lake")
    return cat.create_table("lake.t", schema=pa.schema([
        ("order_id", pa.int64()), ("qty", pa.int32()), ("price", pa.decimal128(10, 2))]))


def test_the_tasks_ids_are_the_commits_and_rows_commit_with_the_columns(table: Any) -> None:
    staged = evolved_metadata(table, ADD)
    assert table.schema().find_field("qty").field_type.__str__() == "int"  # not committed
    assert len(table.metadata.schemas) == 1
    sig = schema_signature(staged.schema())
    txn = table.transaction()
    assert evolve_schema(txn, "lake.t", ADD) == [
        "widen qty long", "add coupon string", "widen price decimal(12, 2)"]
    assert schema_signature(txn.table_metadata.schema()) == sig  # the same ids, again
    rows = pa.table({"order_id": [1], "qty": [2**40], "coupon": ["c"],
                     "price": pa.array([1], pa.decimal128(12, 2))})
    txn.append(rows)
    txn.commit_transaction()
    assert schema_signature(table.schema()) == sig
    snap = table.current_snapshot()
    assert snap.schema_id == table.schema().schema_id  # one commit: snapshot of the schema
    assert table.scan().to_arrow().to_pylist() == [
        {"order_id": 1, "qty": 2**40, "price": 1, "coupon": "c"}]
    # evolved already: nothing to stage, the metadata is the table's
    assert evolved_metadata(table, ADD) is table.metadata
    assert evolve_schema(table.transaction(), "lake.t", ADD) == []


def test_a_wider_column_is_kept_and_one_of_another_type_refused(table: Any) -> None:
    assert pending_changes("lake.t", table.schema(), [("order_id", "integer")]) == []
    with pytest.raises(SchemaMismatchError) as e:
        pending_changes("lake.t", table.schema(), [("qty", "text")])
    assert "Iceberg table lake.t has column 'qty' of type int, but the reader schema's " \
           "field 'qty' needs string" in str(e.value)


def test_files_written_with_an_id_the_table_gave_another_column_are_refused(
        table: Any) -> None:
    sig = schema_signature(evolved_metadata(table, ADD).schema())
    files = {0: [{"schema_fields": sig}], 1: [{}]}  # part 1: a marker without signature
    with table.update_schema() as u:  # another writer adds a column meanwhile
        u.add_column("other", StringType())
    txn = table.transaction()
    evolve_schema(txn, "lake.t", ADD)
    with pytest.raises(StagedRowsLostError) as e:
        check_files_schema(txn.table_metadata.schema(), files, "lake.t", 9)
    assert e.value.parts == [0]
    assert "field id 4 is 'coupon string' in its files, 'other string' in the table" \
        in str(e.value), e.value
    check_files_schema(txn.table_metadata.schema(), {1: [{}]}, "lake.t", 9)


def test_a_field_differing_from_a_column_only_in_case_is_refused(table: Any) -> None:
    """Spark and Trino resolve Iceberg names without case: `Coupon` beside `coupon` would
    make the table ambiguous to them, so neither the table's column nor another evolved
    field may differ from an added one only in case."""
    with table.update_schema() as u:
        u.add_column("Coupon", StringType())
    for cols in ([("coupon", "text")], [("note", "text"), ("NOTE", "text")]):
        with pytest.raises(SchemaMismatchError) as e:
            pending_changes("lake.t", table.schema(), cols)
        assert "differs from it only in case" in str(e.value), e.value
        with pytest.raises(SchemaMismatchError):
            evolved_metadata(table, cols)
    assert [f.name for f in table.schema().fields] == ["order_id", "qty", "price", "Coupon"]


def test_a_change_iceberg_cannot_promote_names_the_promotions_and_the_way_out() -> None:
    """int -> double is a widening Avro allows but Iceberg cannot make in place: the error
    says which promotions Iceberg makes and that renaming or dropping the column is the way
    out (declaring the old type only helps if the values fit it)."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import IntegerType, NestedField

    from offsetflow.errors import SchemaMismatchError
    from offsetflow.sinks.iceberg.evolve import pending_changes

    schema = Schema(NestedField(1, "qty", IntegerType(), required=False))
    with pytest.raises(SchemaMismatchError) as e:
        pending_changes("lake.t", schema, [("qty", "double precision")])
    text = str(e.value)
    assert "int -> long, float -> double" in text and "rename or drop the column" in text, text
