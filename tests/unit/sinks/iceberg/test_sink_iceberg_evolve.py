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


def _iceberg_columns(text: str, schema_type: str) -> list[tuple[str, str]]:
    """A reader schema's evolved columns as the stage types them (`stage_columns`)."""
    from offsetflow.commit.tables import pg_type
    from offsetflow.job.tasks import PG_TYPES, SPARK_TYPES
    from offsetflow.source import evolved_columns

    cols = evolved_columns({"t": text}, {"order_id": "long"}, {"topic"}, schema_type)
    return [(n, PG_TYPES.get(t) or pg_type(SPARK_TYPES.get(t, t))) for n, t in cols.items()]


def _schema_of(columns: list[tuple[str, str]]) -> Any:
    from pyiceberg.schema import Schema
    from pyiceberg.types import NestedField

    from offsetflow.sinks.iceberg.evolve import iceberg_type

    return Schema(*(NestedField(i + 1, n, iceberg_type(t), required=False)
                    for i, (n, t) in enumerate(columns)))


@pytest.mark.parametrize(("old", "new", "changes"), [
    ("TYPE_INT32", "TYPE_INT64", [("qty", "long", "widen")]),
    ("TYPE_SINT32", "TYPE_SINT64", [("qty", "long", "widen")]),
    ("TYPE_UINT32", "TYPE_UINT64", []),  # both long columns already
    ("TYPE_UINT32", "TYPE_INT64", []),
])
def test_protobufs_widenings_are_iceberg_promotions(old: str, new: str,
                                                    changes: list[Any]) -> None:
    """Each wire-compatible Protobuf widening (`source.evolution`) lands as a column type
    Iceberg promotes in place (int -> long) or as the same type: none stops the batch."""
    import base64

    from google.protobuf import descriptor_pb2

    fd = descriptor_pb2.FieldDescriptorProto

    def proto(t: str) -> str:
        f = descriptor_pb2.FileDescriptorProto(name="o.proto", package="t", syntax="proto3")
        m = f.message_type.add(name="Order")
        m.field.add(name="order_id", number=1, type=fd.TYPE_INT64, label=1)
        m.field.add(name="qty", number=2, type=getattr(fd, t), label=1)
        return base64.b64encode(f.SerializeToString()).decode()

    schema = _schema_of(_iceberg_columns(proto(old), "PROTOBUF"))
    got = pending_changes("lake.t", schema, _iceberg_columns(proto(new), "PROTOBUF"))
    assert [(n, str(t), how) for n, t, how in got] == changes


def test_json_schemas_integer_to_number_is_refused_naming_the_way_out() -> None:
    """JSON Schema's integer -> number is long -> double in Iceberg, which it cannot
    promote: SchemaMismatchError before anything is written, naming the column, both
    types and the way out (the same words as Avro's int -> double)."""
    import json

    def js(t: str) -> str:
        return json.dumps({"type": "object", "properties": {
            "order_id": {"type": "integer"}, "qty": {"type": t}}})

    schema = _schema_of(_iceberg_columns(js("integer"), "JSON"))
    assert str(schema.find_field("qty").field_type) == "long"
    with pytest.raises(SchemaMismatchError) as e:
        pending_changes("lake.t", schema, _iceberg_columns(js("number"), "JSON"))
    text = str(e.value)
    assert "column 'qty' of type long" in text and "needs double" in text, text
    assert "int -> long, float -> double" in text and "rename or drop the column" in text


def test_an_upsert_key_column_is_never_added_or_changed(table: Any) -> None:
    """The merge matches rows by the key: evolution refuses to add or promote a key column
    (SchemaEvolutionError naming it), on the driver before the tasks write
    (`evolved_metadata`) and in the commit's transaction (`evolve_schema`); other columns
    of the same reader schema evolve as before."""
    from offsetflow.errors import SchemaEvolutionError

    for cols in ([("qty", "bigint")], [("region", "text")]):
        with pytest.raises(SchemaEvolutionError) as e:
            evolved_metadata(table, cols, key=("order_id", cols[0][0]))
        assert f"upsert key column(s) ({'widen' if cols[0][0] == 'qty' else 'add'} " \
               f"{cols[0][0]!r}" in str(e.value), e.value
        with pytest.raises(SchemaEvolutionError):
            evolve_schema(table.transaction(), "lake.t", cols, key=(cols[0][0],))
    assert evolve_schema(table.transaction(), "lake.t", [("region", "text")],
                         key=("order_id",)) == ["add region string"]
    assert [f.name for f in table.schema().fields] == ["order_id", "qty", "price"]


ADDRESS = pa.struct([pa.field("street", pa.string(), nullable=False),
                     pa.field("zip", pa.int32())])


def test_an_added_json_column_with_a_nested_reader_type_is_that_struct(table: Any) -> None:
    """A `json` field evolution adds (jsonb in the stage) whose Avro reader schema is a
    record is added as that struct (ids the same on the driver and in the commit, the
    inner nullability kept); one without a nested form stays a string, and so does one the
    table holds as a string already (nothing changes under a running pipeline)."""
    add = [("address", "jsonb"), ("note", "jsonb")]
    nested = {"address": ADDRESS}
    staged = evolved_metadata(table, add, nested=nested)
    txn = table.transaction()
    done = evolve_schema(txn, "lake.t", add, nested=nested)
    assert [d.split("<")[0] for d in done] == ["add address struct", "add note string"]
    assert schema_signature(txn.table_metadata.schema()) == \
        schema_signature(staged.schema())
    txn.commit_transaction()
    address = table.schema().find_field("address")
    assert not address.required
    assert str(address.field_type) == "struct<5: street: required string, 6: zip: optional int>"
    # there now: nothing to add again (the fields inside evolve by nested_additions)
    assert evolve_schema(table.transaction(), "lake.t", add, nested=nested) == []
    # a string column of that name (an older table) keeps getting the JSON text
    with table.update_schema() as u:
        u.delete_column("address")
    with table.update_schema() as u:
        u.add_column("address", StringType())
    assert evolve_schema(table.transaction(), "lake.t", add, nested=nested) == []
