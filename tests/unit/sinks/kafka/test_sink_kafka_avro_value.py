"""`sink.value_format: avro`'s pure parts: the schema derived from the stage's columns, a
staged JSON row re-encoded as Confluent wire-format Avro, and the values that do not fit
(the record's verdict, never the batch's)."""

from __future__ import annotations

import io
import json
import struct
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from fastavro import schemaless_reader

from offsetflow.sinks.kafka.avro_value import AvroValueEncoder, ValueDoesNotFit, derive_schema
from offsetflow.sinks.kafka.mark import NotProduced

COLUMNS = {"id": "bigint", "n": "integer", "amount": "numeric(10,2)",
           "at": "timestamp with time zone", "local": "timestamp without time zone",
           "day": "date", "doc": "jsonb", "name": "text", "f": "double precision",
           "b": "bytea", "ok": "boolean", "loose": "numeric"}


def encoder(columns: dict[str, str] = COLUMNS, sid: int = 42) -> AvroValueEncoder:
    return AvroValueEncoder(derive_schema("orders.out-1", columns, list(columns)), sid)


def read(enc: AvroValueEncoder, value: bytes) -> dict[str, object]:
    assert value[:5] == struct.pack(">bI", 0, enc.schema_id)
    return schemaless_reader(io.BytesIO(value[5:]), enc.parsed, None)  # type: ignore[return-value]


def test_the_derived_schema_follows_the_columns() -> None:
    schema = derive_schema("orders.out-1", COLUMNS, list(COLUMNS))
    assert schema["name"] == "orders_out_1"
    types = {f["name"]: f["type"] for f in schema["fields"]}
    assert all(t[0] == "null" for t in types.values())  # a staged column may be null
    assert types["amount"][1] == {"type": "bytes", "logicalType": "decimal", "precision": 10,
                                  "scale": 2}
    assert types["at"][1]["logicalType"] == "timestamp-micros"
    assert types["local"][1]["logicalType"] == "local-timestamp-micros"
    assert types["day"][1]["logicalType"] == "date"
    assert types["doc"][1] == types["name"][1] == types["loose"][1] == "string"
    assert derive_schema("t", {"ts": "timestamptz"}, ["ts"])["fields"][0]["type"][1][
        "logicalType"] == "timestamp-micros"


def test_a_staged_json_row_reads_back_as_its_values() -> None:
    enc = encoder()
    row = {"id": 2**40, "n": 7, "amount": 12.5, "at": "2026-01-02T03:04:05.123456+00:00",
           "local": "2026-01-02T03:04:05", "day": "2026-02-03", "doc": {"a": [1, {"b": None}]},
           "name": "é", "f": "NaN", "b": "\\x00ff", "ok": True, "loose": 1.000001}
    got = read(enc, enc.encode(json.dumps(row)))
    assert got["id"] == 2**40 and got["n"] == 7 and got["amount"] == Decimal("12.50")
    assert got["at"] == datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    assert got["day"] == date(2026, 2, 3)
    assert json.loads(str(got["doc"])) == row["doc"]
    assert got["name"] == "é" and got["b"] == b"\x00\xff" and got["ok"] is True
    assert got["f"] != got["f"]  # NaN: a double holds it
    assert got["loose"] == "1.000001"
    nulls = read(enc, enc.encode(json.dumps({c: None for c in COLUMNS})))
    assert set(nulls.values()) == {None}


@pytest.mark.parametrize(("row", "words"), [
    ({"amount": "NaN"}, "not a finite number"),
    ({"amount": 1e20}, "does not fit decimal(10,2)"),
    ({"amount": 1.234}, "more than 2 decimal places"),
    ({"n": 2**31}, "out of the range"),
    ({"id": "12"}, "field 'id': str"),
    ({"ok": 1}, "field 'ok'"),
    ({"day": 3}, "field 'day'"),
])
def test_a_value_that_does_not_fit_names_the_field(row: dict[str, object], words: str
                                                   ) -> None:
    with pytest.raises(ValueDoesNotFit, match=words.replace("(", r"\(").replace(")", r"\)")):
        encoder().encode(json.dumps(row))


def test_an_explicit_schema_refuses_a_null_for_a_required_field() -> None:
    enc = AvroValueEncoder({"type": "record", "name": "r", "fields": [
        {"name": "id", "type": "long"}]}, 3)
    assert read(enc, enc.encode('{"id": 5, "other": 1}')) == {"id": 5}
    with pytest.raises(ValueDoesNotFit, match="'id' is null"):
        enc.encode('{"id": null}')


def test_a_left_out_avro_record_round_trips_through_the_commit_metadata() -> None:
    rec = NotProduced("src", 1, 17, None, reason="the value does not fit: x")
    assert rec.token == "17:avro"
    assert "does not fit" in rec.error("out", None)


def _one(avro_type: object) -> AvroValueEncoder:
    return AvroValueEncoder({"type": "record", "name": "r", "fields": [
        {"name": "a", "type": avro_type}]}, 5)


def test_a_nested_number_stays_the_number_it_was_with_its_digits() -> None:
    """A json/jsonb column is its JSON text: a fraction of 16 or 17 significant digits (a
    Spark double such as 0.1 + 0.2) stays a number, not a string, and keeps its digits."""
    enc = encoder({"doc": "jsonb"})
    doc = '{"x": 0.30000000000000004, "y": 1.10, "z": 123456789012345678.5, "n": [1e2, -0.0]}'
    got = read(enc, enc.encode('{"doc": ' + doc + "}"))
    assert json.loads(str(got["doc"]), parse_float=Decimal) == json.loads(
        doc, parse_float=Decimal)
    assert '"x":0.30000000000000004' in str(got["doc"]) and '"y":1.10' in str(got["doc"])


@pytest.mark.parametrize(("avro_type", "value", "words"), [
    # a narrower explicit type may hold a value only as it is: never rounded or overflowed
    ({"type": "long", "logicalType": "timestamp-millis"}, '"2026-01-02T03:04:05.123456Z"',
     "millisecond"),
    ("double", "1e400", "double"),
    ("double", str(2**53 + 1), "double"),
    ("float", "0.30000000000000004", "float"),
    ("float", "1e39", "float"),
    ({"type": "array", "items": "long"}, "[1.5]", "field 'a'"),
    ({"type": "array", "items": "int"}, "[99999999999]", "out of the range"),
    ({"type": "array", "items": "float"}, "[1e400]", "float"),
    ({"type": "map", "values": "long"}, '{"k": 2.5}', "field 'a'"),
    ({"type": "record", "name": "inner", "fields": [{"name": "i", "type": "int"}]},
     '{"i": 4294967296}', "out of the range"),
])
def test_a_narrower_type_refuses_a_value_it_would_alter(avro_type: object, value: str,
                                                         words: str) -> None:
    with pytest.raises(ValueDoesNotFit, match=words):
        _one(avro_type).encode('{"a": ' + value + "}")


@pytest.mark.parametrize(("avro_type", "value", "back"), [
    ({"type": "long", "logicalType": "timestamp-millis"}, '"2026-01-02T03:04:05.123Z"',
     datetime(2026, 1, 2, 3, 4, 5, 123000, tzinfo=UTC)),
    ("double", "0.1", 0.1),
    ("double", "12", 12.0),
    ("double", '"NaN"', None),
    ("float", "0.1", None),
    ("float", "3.4028235e+38", None),
    ({"type": "array", "items": "double"}, "[0.5, 2]", [0.5, 2.0]),
    ({"type": "map", "values": ["null", "long"]}, '{"k": 3, "m": null}', {"k": 3, "m": None}),
    ({"type": "record", "name": "inner", "fields": [{"name": "i", "type": "int"}]},
     '{"i": 4}', {"i": 4}),
])
def test_a_narrower_type_takes_a_value_it_holds_as_it_is(avro_type: object, value: str,
                                                          back: object) -> None:
    enc = _one(avro_type)
    got = read(enc, enc.encode('{"a": ' + value + "}"))["a"]
    if back is not None:
        assert got == back


def test_a_value_nested_deeper_than_the_json_reader_goes_is_a_dead_letter() -> None:
    """PostgreSQL's jsonb nests deeper than Python's JSON reader: the record's verdict
    (ValueDoesNotFit), never a RecursionError that fails every attempt of the batch."""
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(ValueDoesNotFit, match="nested too deeply"):
        encoder({"doc": "jsonb"}).encode('{"doc": ' + deep + "}")


def test_an_unconstrained_numeric_is_its_digits_as_staged() -> None:
    """numeric (no precision) is a string of its digits as PostgreSQL wrote them: never
    Python's exponent form (str(Decimal) writes 0.0000001 as 1E-7)."""
    enc = encoder({"loose": "numeric"})
    for digits in ("0.0000001", "-0.00000012300", "123456789012345678901234567890.5", "0"):
        assert read(enc, enc.encode('{"loose": ' + digits + "}"))["loose"] == digits


@pytest.mark.parametrize("text", ["1.2621775e-29", "1.5474251e+26", "1.2379401e+27",
                                  "3.4028235e+38", "1e-45"])
def test_a_real_columns_own_text_fits_its_float_also_at_a_power_of_two(text: str) -> None:
    """PostgreSQL writes a real's shortest text; at a power of two another text as short
    may read back as the same float (Python's choice): either is the float, as it is."""
    enc = encoder({"r": "real"})
    got = read(enc, enc.encode('{"r": ' + text + "}"))["r"]
    assert isinstance(got, float) and got != 0
