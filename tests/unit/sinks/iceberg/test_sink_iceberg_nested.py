"""JSON text of nested values -> the Iceberg table's struct/list/map types, record by
record; and the nested fields a table lacks."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

import pyarrow as pa
import pytest

from offsetflow.errors import SchemaMismatchError
from offsetflow.sinks.iceberg.nested import (
    check_nested,
    nested_additions,
    nested_from_json,
    rows_fit,
)

LINE = pa.struct([pa.field("sku", pa.string(), nullable=False),
                  pa.field("price", pa.decimal128(5, 2), nullable=False),
                  pa.field("at", pa.timestamp("us", tz="UTC")),
                  pa.field("day", pa.date32()),
                  pa.field("blob", pa.binary())])
LINES = pa.list_(pa.field("element", LINE, nullable=False))
TAGS = pa.map_(pa.string(), pa.field("value", pa.int64()))


def test_values_parse_into_their_types() -> None:
    text = ('[{"sku":"A","price":123.45,"at":"2026-01-02T03:04:05.123000+00:00",'
            '"day":"2026-01-02","blob":"AAE="}]')
    arr, refused = nested_from_json(pa.array([text, None, "[]"]), LINES, "lines")
    assert refused == {}
    assert arr.to_pylist() == [
        [{"sku": "A", "price": Decimal("123.45"),
          "at": datetime(2026, 1, 2, 3, 4, 5, 123000, tzinfo=UTC),
          "day": date(2026, 1, 2), "blob": b"\x00\x01"}], None, []]
    arr, refused = nested_from_json(pa.array(['{"a":1,"b":null}']), TAGS, "tags")
    assert refused == {} and arr.to_pylist() == [[("a", 1), ("b", None)]]


def test_a_value_that_does_not_fit_refuses_its_row_only() -> None:
    good = '[{"sku":"A","price":1.5}]'
    overflow = '[{"sku":"A","price":1.5},{"sku":"B","price":1234.5}]'
    null_required = '[{"sku":null,"price":1}]'
    unknown = '[{"sku":"A","price":1,"colour":"red"}]'
    arr, refused = nested_from_json(pa.array([good, overflow, null_required, unknown]),
                                    LINES, "lines")
    assert sorted(refused) == [1, 2, 3]
    assert "lines[1].price: 1234.5 does not fit in decimal(5,2)" in refused[1]
    assert "lines[0].sku is null" in refused[2]
    assert "['colour']" in refused[3]
    assert arr.to_pylist()[0] == [{"sku": "A", "price": Decimal("1.50"), "at": None,
                                   "day": None, "blob": None}]


def test_rows_fit_parses_only_text_columns_the_table_holds_nested() -> None:
    cols = {"lines": pa.array(['[{"sku":"A","price":1}]']), "note": pa.array(['{"a":1}'])}
    out, refused = rows_fit([("lines", LINES), ("note", pa.string())], cols)
    assert refused == {}
    assert out["note"] is cols["note"]  # a string column keeps its JSON text
    assert out["lines"].type == LINES


def test_fields_the_table_lacks_are_named() -> None:
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import assign_fresh_schema_ids

    schema = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(  # noqa: SLF001
        pa.schema([pa.field("lines", LINES), pa.field("tags", TAGS)])))
    newer = pa.list_(pa.field("element", pa.struct(
        [*LINE, pa.field("qty", pa.int32())]), nullable=False))
    assert nested_additions(schema, {"lines": LINES, "tags": TAGS}) == []
    assert nested_additions(schema, {"lines": newer}) == [
        (("lines", "element", "qty"), pa.int32())]
    with pytest.raises(SchemaMismatchError, match=r"lines\.element\.qty"):
        check_nested("db.t", schema, {"lines": newer}, 7)


def test_fields_the_reader_makes_optional_or_wider_are_named() -> None:
    """A required field the reader makes optional (or no longer has), a list element it
    makes optional, a float it makes a double: the table must loosen them (under
    add_columns its update does), else the batch is refused by name before it writes."""
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import assign_fresh_schema_ids
    from pyiceberg.types import DoubleType

    from offsetflow.sinks.iceberg.nested import nested_relaxations

    addr = pa.struct([pa.field("street", pa.string(), nullable=False),
                      pa.field("w", pa.float32(), nullable=False),
                      pa.field("zip", pa.int32(), nullable=False)])
    schema = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(  # noqa: SLF001
        pa.schema([pa.field("address", addr), pa.field("lines", LINES)])))
    assert nested_relaxations(schema, {"address": addr, "lines": LINES}) == []
    newer = pa.struct([pa.field("street", pa.string()),  # optional now; zip gone
                       pa.field("w", pa.float64(), nullable=False)])
    loose_lines = pa.list_(pa.field("element", LINE))
    assert nested_relaxations(schema, {"address": newer, "lines": loose_lines}) == [
        (("address", "street"), None), (("address", "w"), DoubleType()),
        (("address", "zip"), None), (("lines", "element"), None)]
    with pytest.raises(SchemaMismatchError, match=r"address\.street \(optional\)"):
        check_nested("db.t", schema, {"address": newer}, 7)


def test_a_nested_field_differing_only_in_case_is_refused() -> None:
    """A reader's nested field `Street` beside the table's `street` is never added (Spark
    and Trino could no longer resolve either), as a top-level column is not."""
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import assign_fresh_schema_ids

    addr = pa.struct([pa.field("street", pa.string())])
    schema = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(  # noqa: SLF001
        pa.schema([pa.field("address", addr), pa.field("lines", LINES)])))
    newer = pa.struct([pa.field("street", pa.string()), pa.field("Street", pa.string())])
    with pytest.raises(SchemaMismatchError, match=r"'address\.Street'.*'address\.street'"):
        nested_additions(schema, {"address": newer})
    renamed = pa.list_(pa.field("element", pa.struct(
        [*LINE, pa.field("SKU", pa.string())]), nullable=False))
    with pytest.raises(SchemaMismatchError, match=r"lines\.element\.SKU"):
        check_nested("db.t", schema, {"lines": renamed}, 7)


def test_a_number_a_double_would_round_is_refused_not_changed() -> None:
    """Every digit of a JSON number reaches a double field, or the row is refused: the
    shortest form (Avro, Protobuf) and a `%.17g` producer's form of the same double land;
    2**53 + 1, 20 significant digits and 1e400 do not land rounded or infinite."""
    nums = pa.list_(pa.field("element", pa.float64()))
    fits = ["[0.1]", "[0.10000000000000001]", "[9007199254740992]", "[1e22]",
            "[0.30000000000000004]", "[1152921504606846976]", "[-0.0]", "[5e-324]"]
    bad = ["[9007199254740993]", "[12345.678901234567891]", "[1e400]"]
    arr, refused = nested_from_json(pa.array(fits + bad), nums, "xs")
    assert sorted(refused) == [8, 9, 10], refused
    assert "xs[0]: 9007199254740993 has more digits than a double holds" in refused[8]
    assert "beyond the range of a double" in refused[10]
    assert arr.to_pylist()[:8] == [[0.1], [0.1], [2.0**53], [1e22], [0.30000000000000004],
                                   [2.0**60], [-0.0], [5e-324]]
    # a float field: Protobuf's "Infinity" is a float's value, not an overflow
    f32 = pa.list_(pa.field("element", pa.float32()))
    arr, refused = nested_from_json(pa.array(['["Infinity", 0.1]']), f32, "fs", True)
    assert refused == {} and arr.to_pylist() == [[float("inf"), pytest.approx(0.1)]]


def test_a_string_is_a_number_in_protobufs_json_mapping_only() -> None:
    """Protobuf's JSON mapping writes 64-bit integers (and integer map keys) as strings, and
    NaN/Infinity as names: numbers there. Anywhere else a string in a numeric field (a zip
    code "02134" where an older version had an int, a producer that does not validate) is
    refused, never landed as 2134."""
    zips = pa.struct([pa.field("zip", pa.int64()), pa.field("w", pa.float64())])
    texts = ['{"zip":"02134"}', '{"zip":"42"}', '{"w":"NaN"}', '{"zip":7,"w":0.5}']
    arr, refused = nested_from_json(pa.array(texts), zips, "a")
    assert sorted(refused) == [0, 1, 2], refused
    assert "a.zip: expected an integer, got '02134'" in refused[0]
    assert arr.to_pylist()[3] == {"zip": 7, "w": 0.5}
    arr, refused = nested_from_json(pa.array(texts[1:]), zips, "a", True)
    assert refused == {} and arr.to_pylist()[0] == {"zip": 42, "w": None}
