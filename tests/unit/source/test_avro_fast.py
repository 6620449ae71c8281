"""The fast Avro path against the record-by-record one it replaces: the resolution compiled
once per (writer, reader) gives fastavro's resolved record, and the column-wise conversion
gives the same table as `record_fields` + `rows_to_table`, or refuses the chunk (the slow
path then names the bad record)."""

from __future__ import annotations

import io
import json
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from offsetflow.source import AvroDecoder, arrow_schema, deserialize_avro
from offsetflow.source.avro import avro_value, record_fields
from offsetflow.source.avro_fast import resolution_fix, typed_columns
from offsetflow.source.deserialize import rows_to_table
from offsetflow.source.registry import RegisteredSchema

NESTED = {"type": "record", "name": "Inner", "fields": [{"name": "x", "type": "int"}]}
V1 = {"type": "record", "name": "R", "namespace": "t", "fields": [
    {"name": "id", "type": "int"},
    {"name": "n", "type": "long"},
    {"name": "f", "type": "float"},
    {"name": "gone", "type": "string", "default": ""},
    {"name": "note", "type": "string"},
    {"name": "inner", "type": NESTED}]}
V2 = {**V1, "fields": [
    {"name": "id", "type": "long"},  # promoted
    {"name": "n", "type": "double"},  # promoted
    {"name": "f", "type": "double"},  # promoted
    {"name": "note", "type": ["null", "string"], "default": None},  # made nullable
    {"name": "inner", "type": NESTED},
    {"name": "tags", "type": {"type": "array", "items": "string"}, "default": ["a"]},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}, "default": 3},
    {"name": "opt", "type": ["null", "long"], "default": None}]}


def _enc(schema: dict[str, Any], rec: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), rec)
    return buf.getvalue()


def test_compiled_resolution_gives_fastavros_resolved_record() -> None:
    fix = resolution_fix(fastavro, json.dumps(V1), json.dumps(V2))
    assert fix is not None
    w, r = fastavro.parse_schema(V1), fastavro.parse_schema(V2)
    for i in range(5):
        payload = _enc(V1, {"id": i, "n": 2**40 + i, "f": 0.1 * i, "gone": "g",
                            "note": f"n{i}", "inner": {"x": i}})
        want: Any = fastavro.schemaless_reader(io.BytesIO(payload), w, r)
        got: Any = fastavro.schemaless_reader(io.BytesIO(payload), w, None)
        fix(got)
        assert got == want and {k: type(v) for k, v in got.items()} == \
            {k: type(v) for k, v in want.items()}
    a: Any = fastavro.schemaless_reader(io.BytesIO(payload), w, None)
    b: Any = fastavro.schemaless_reader(io.BytesIO(payload), w, None)
    fix(a)
    fix(b)
    a["tags"].append("x")  # each record its own default list
    assert b["tags"] == ["a"]


@pytest.mark.parametrize("reader", [
    {**V1, "fields": [*V1["fields"][:5], {"name": "inner", "type": {
        "type": "record", "name": "Inner", "fields": [{"name": "x", "type": "long"}]}}]},
    {**V1, "name": "Other"},
    {**V1, "fields": [*V1["fields"], {"name": "req", "type": "int"}]},  # no default
    {**V1, "fields": [{"name": "ident", "type": "int", "aliases": ["id"]},
                      *V1["fields"][1:]]},
    {**V1, "fields": [{"name": "id", "type": ["null", "float", "int"]}, *V1["fields"][1:]]},
])
def test_changes_it_does_not_compile_are_left_to_fastavro(reader: dict[str, Any]) -> None:
    assert resolution_fix(fastavro, json.dumps(V1), json.dumps(reader)) is None


class _Registry:
    shown = "http://registry"

    def schema_by_id(self, schema_id: int) -> RegisteredSchema | None:
        return {1: RegisteredSchema(1, "AVRO", json.dumps(V1)),
                2: RegisteredSchema(2, "AVRO", json.dumps(V2))}.get(schema_id)


def test_a_record_the_compiled_resolution_cannot_take_fails_as_fastavro_says() -> None:
    good = b"\x00\x00\x00\x00\x01" + _enc(V1, {"id": 1, "n": 2, "f": 0.5, "gone": "",
                                               "note": "x", "inner": {"x": 1}})
    dec = AvroDecoder(_Registry(), {"t": (2, json.dumps(V2))})  # type: ignore[arg-type]
    assert dec.plan(1, "t").fix is not None  # type: ignore[union-attr]
    table, bad, ok = deserialize_avro([good, good[:-1], good + b"\x00"], ["t"] * 3,
                                      {"id": "long", "tags": "json", "opt": "long"}, dec)
    assert ok == [0] and table.to_pylist() == [{"id": 1, "tags": '["a"]', "opt": None}]
    assert bad[0].reason.startswith("schema id 1: payload does not decode")
    assert bad[1].reason.startswith("schema id 1: 1 bytes left after the record")


COLUMNS = {"i": "int", "l": "long", "d": "double", "f": "float", "b": "boolean",
           "s": "string", "u": "uuid", "ts": "timestamp", "dt": "date",
           "m": "decimal(6,2)", "j": "json"}
PLAIN = {"i": 1, "l": 2**40, "d": 1.5, "f": 0.25, "b": True, "s": "é",
         "u": uuid.UUID(int=7), "ts": datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
         "dt": date(2026, 1, 2), "m": Decimal("12.34"), "j": {"a": [1, "x", None]}}
# one value per column that is odd but fits, or does not fit: column -> values
ODD: dict[str, list[Any]] = {
    "i": [2**31, -2**31, True, 1.0, "1"],
    "l": [2**63, -2**63, False],
    "d": [2**60, 3, float("nan"), Decimal("1.5"), "x", True],
    "f": [3.5e38, float("inf"), 3, Decimal("2.5")],
    "b": [1, None],
    "s": ["a\x00b", "\ud800", uuid.UUID(int=1), 5],
    "u": ["0000000000000000000000000000000A", "not-a-uuid", 3],
    "ts": [datetime(2026, 1, 1), datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=5))),
           date(2026, 1, 1), "2026-01-01"],
    "dt": [datetime(2026, 1, 1, 5), "2026-01-01"],
    "m": [Decimal("1.555"), Decimal("1.5"), Decimal("9999.995"), Decimal("10000"), 3, 2.5,
          Decimal("-0.00"), Decimal("1E+2")],
    "j": [{"b": b"\x00\x01"}, [Decimal("0.10")], {"t": datetime(2026, 1, 1, tzinfo=UTC)},
          "a\x00", "\x001\x00", float("nan"), {"u": uuid.UUID(int=3)}, "\ud800"],
}


def _reference(records: list[dict[str, Any]]) -> tuple[list[Any], set[int]]:
    """The record-by-record conversion: rows, and the indices it refuses."""
    rows: list[dict[str, Any] | None] = []
    refused: set[int] = set()
    for j, r in enumerate(records):
        try:
            rows.append(record_fields(r, COLUMNS))
        except ValueError:
            refused.add(j)
            rows.append(None)
    table, more = rows_to_table([r for r in rows if r is not None], arrow_schema(COLUMNS))
    kept = [j for j in range(len(records)) if j not in refused]
    refused |= {kept[k] for k, _ in more}
    return table.to_pylist(), refused


@pytest.mark.parametrize(("column", "value"),
                         [(c, v) for c, vs in ODD.items() for v in vs])
def test_columns_equal_the_record_by_record_conversion_or_refuse(column: str,
                                                                 value: Any) -> None:
    records = [dict(PLAIN), {**PLAIN, column: value}, {**PLAIN, column: None}]
    rows, refused = _reference(records)
    got = typed_columns(records, None, COLUMNS, arrow_schema(COLUMNS), avro_value)
    if refused:
        assert got is None, (value, refused)
    else:
        assert got is not None, value
        assert repr(got.to_pylist()) == repr(rows)  # NaN too


def test_key_fields_fill_columns_over_the_value_and_tombstones() -> None:
    schema = {"i": "int", "s": "string"}
    records = [{"i": 1, "s": "a"}, None, {"i": 3, "s": "c"}]
    keys = [{"i": 10, "z": 1}, {"i": 20}, None]
    got = typed_columns(records, keys, schema, arrow_schema(schema), avro_value)
    assert got is not None and got.to_pylist() == [
        {"i": 10, "s": "a"}, {"i": 20, "s": None}, {"i": 3, "s": "c"}]
