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
