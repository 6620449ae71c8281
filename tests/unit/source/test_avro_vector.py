"""The vectorised Avro chunk decoder against the record-by-record path (fastavro per record,
`record_fields`, `rows_to_table`): on any chunk it either gives exactly the same table, or
gives none (the record-by-record path then decides, naming the bad records)."""

from __future__ import annotations

import io
import json
import math
import random
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from offsetflow.source import AvroDecoder, arrow_schema, deserialize_avro
from offsetflow.source.avro import avro_value, record_fields
from offsetflow.source.avro_fast import Resolution
from offsetflow.source.avro_vector import decode_chunk, layout_of
from offsetflow.source.deserialize import rows_to_table
from offsetflow.source.registry import RegisteredSchema

WRITER = {"type": "record", "name": "V", "fields": [
    {"name": "i", "type": "int"},
    {"name": "l", "type": "long"},
    {"name": "f", "type": "float"},
    {"name": "d", "type": "double"},
    {"name": "b", "type": "boolean"},
    {"name": "s", "type": "string"},
    {"name": "n", "type": ["null", "string"]},
    {"name": "nl", "type": ["long", "null"]},
    {"name": "by", "type": "bytes"},
    {"name": "z", "type": "null"},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "tu", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
    {"name": "lt", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
    {"name": "dt", "type": {"type": "int", "logicalType": "date"}},
    {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}},
    {"name": "ne", "type": ["null", {"type": "enum", "name": "E2", "symbols": ["X"]}]},
    {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "m", "type": {"type": "bytes", "logicalType": "decimal", "precision": 6,
                           "scale": 2}},
    {"name": "nm", "type": ["null", {"type": "bytes", "logicalType": "decimal",
                                     "precision": 12, "scale": 3}]}]}
PARSED = fastavro.parse_schema(WRITER)
COLUMNS = [
    {"i": "int", "l": "long", "f": "float", "d": "double", "b": "boolean", "s": "string",
     "n": "string", "nl": "long", "ts": "timestamp", "tu": "timestamp", "lt": "timestamp",
     "dt": "date", "z": "string", "missing": "long", "e": "string", "ne": "string",
     "u": "uuid", "m": "decimal(6,2)", "nm": "decimal(10,3)"},
    {"l": "int", "i": "double", "f": "double", "nl": "double", "n": "string", "u": "string",
     "m": "decimal(8,2)", "nm": "decimal(12,3)"},
    {"m": "decimal(8,3)", "nm": "decimal(5,3)"},  # another scale; fewer digits
]
EDGE_LONGS = [0, 1, -1, 63, 64, -64, -65, 2**31 - 1, -2**31, 2**31, 2**53 + 1, 2**63 - 1,
              -2**63]
TEXTS = ["", "a", "é", "日本語", "😀 emoji", "x" * 300, "tab\there"]


def _record(rng: random.Random) -> dict[str, Any]:
    return {
        "i": rng.choice([0, 1, -1, 2**31 - 1, -2**31, rng.randint(-1000, 1000)]),
        "l": rng.choice(EDGE_LONGS + [rng.randint(-2**62, 2**62)]),
        "f": rng.choice([0.0, 1.5, -2.25, float("inf"), float("nan"), 3.4e38, 1e-45,
                         rng.random()]),
        "d": rng.choice([0.0, -0.0, 1e308, float("-inf"), float("nan"), rng.random()]),
        "b": rng.random() < 0.5,
        "s": rng.choice(TEXTS),
        "n": rng.choice([None, *TEXTS]),
        "nl": rng.choice([None, *EDGE_LONGS]),
        "by": rng.choice([b"", b"\x00\xff", b"bytes"]),
        "z": None,
        "ts": datetime(rng.choice([1, 1970, 2026, 9999]), 1 + rng.randrange(12), 1, 2, 3, 4,
                       rng.randrange(1000) * 1000, tzinfo=UTC),
        "tu": rng.choice([None, datetime(2026, 11, 27, 1, 2, 3, rng.randrange(10**6),
                                         tzinfo=UTC)]),
        "lt": datetime(2026, 1, 2, 3, 4, 5, 6),
        "dt": datetime(rng.choice([1, 1970, 2026, 9999]), 12, 31).date(),
        "e": rng.choice("ABC"), "ne": rng.choice([None, "X"]),
        "m": rng.choice([Decimal("0.00"), Decimal("-0.01"), Decimal("9999.99"),
                         Decimal("-9999.99"), Decimal("1.28"), Decimal("-1.28"),
                         Decimal("-1.29"), Decimal("12.34")]),
        "nm": rng.choice([None, Decimal("0.000"), Decimal("123456789.123"),
                          Decimal("-9999999.999"), Decimal("-1.000"), Decimal("0.128")]),
        "u": uuid.UUID(int=rng.getrandbits(128)),
    }


def _wire(rec: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    buf.write(b"\x00\x00\x00\x00\x05")
    fastavro.schemaless_writer(buf, PARSED, rec)
    return buf.getvalue()


def _reference(values: list[bytes], columns: dict[str, str]) -> tuple[list[Any], bool]:
    """Rows the record-by-record path gives, and whether it found any record bad."""
    rows = []
    bad = False
    for v in values:
        try:
            datum = fastavro.schemaless_reader(io.BytesIO(v[5:]), PARSED, None)
            rows.append(record_fields(datum, columns))
        except Exception:  # noqa: BLE001 - a dead letter on that path
            bad = True
    table, refused = rows_to_table(rows, arrow_schema(columns))
    return table.to_pylist(), bad or bool(refused)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b and type(a) is type(b))


def _check(values: list[bytes], columns: dict[str, str], expect_table: bool | None = None
           ) -> None:
    layout = layout_of(WRITER)
    assert layout is not None
    got = decode_chunk(values, layout, columns, arrow_schema(columns), Resolution(),
                       avro_value)
    want, bad = _reference(values, columns)
    if got is not None:
        assert not bad
        assert _same(got.to_pylist(), want)
    if expect_table is not None:
        assert (got is not None) is expect_table


@pytest.mark.parametrize("columns", COLUMNS)
def test_random_chunks_decode_as_record_by_record(columns: dict[str, str]) -> None:
    rng = random.Random(30)
    for _ in range(20):
        values = [_wire(_record(rng)) for _ in range(rng.randint(1, 60))]
        _check(values, columns)
    # a chunk of plain values is taken by the vectorised path
    plain = [_wire({**_record(rng), "l": 5, "i": 3, "f": 1.5, "u": uuid.UUID(int=5),
                    "nm": Decimal("-1.500")})
             for _ in range(10)]
    # (another scale than the writer's: record by record, for decimal_value's rounding)
    _check(plain, columns, expect_table=columns is not COLUMNS[2])


def test_what_fastavro_refuses_in_a_field_no_column_takes_is_refused_too() -> None:
    rng = random.Random(5)
    marker = _wire({**_record(rng), "s": "MARK"})
    at = marker.index(b"MARK")
    chunk = [_wire(_record(rng)) for _ in range(3)]
    not_utf8 = marker[:at] + b"\xff\xfe\xfd\xfc" + marker[at + 4:]
    # "s" (not UTF-8 there) is not a column: fastavro still decodes it, and refuses
    _check([*chunk, not_utf8], {"l": "long"}, expect_table=False)
    assert _reference([*chunk, not_utf8], {"l": "long"})[1]
    odd_uuid = _wire({**_record(rng), "u": "{00000000-0000-0000-0000-000000000001}"})
    _check([*chunk, odd_uuid], {"l": "long"}, expect_table=False)
    upper = _wire({**_record(rng), "u": "0000000A-0000-0000-0000-00000000000B"})
    _check([*chunk, upper], {"u": "uuid"}, expect_table=False)  # str(UUID) lowercases
    _check(chunk, {"l": "long"}, expect_table=True)


def _poison(rng: random.Random) -> list[bytes]:
    good = _wire(_record(rng))
    marker = _wire({**_record(rng), "s": "MARK"})
    n_at = marker.index(b"MARK")
    return [
        good[:-1],  # truncated
        good + b"\x00",  # a byte left over
        good[:5] + b"\xff" * 11 + good[16:],  # a varint past 10 bytes
        marker[:n_at] + b"\xff\xfe\xfd\xfc" + marker[n_at + 4:],  # not UTF-8
        _wire({**_record(rng), "s": "nul\x00"}),  # NUL, which PostgreSQL text refuses
        good[:5],  # no payload at all
    ]


@pytest.mark.parametrize("columns", COLUMNS)
def test_poison_makes_the_chunk_take_the_record_by_record_path(
        columns: dict[str, str]) -> None:
    rng = random.Random(7)
    for p in _poison(rng):
        chunk = [_wire(_record(rng)) for _ in range(5)]
        chunk.insert(2, p)
        _check(chunk, columns, expect_table=False)


class _Registry:
    shown = "http://registry"

    def schema_by_id(self, schema_id: int) -> RegisteredSchema | None:
        return RegisteredSchema(5, "AVRO", json.dumps(WRITER)) if schema_id == 5 else None


def test_deserialize_avro_names_the_bad_records_of_a_chunk_the_vector_path_refused() -> None:
    rng = random.Random(3)
    values: list[bytes | None] = [_wire(_record(rng)) for _ in range(4)]
    good = values[0]
    assert good is not None
    values[1] = good[:-1]
    cols = {"l": "long", "s": "string"}
    table, bad, ok = deserialize_avro(values, ["t"] * 4, cols,
                                      AvroDecoder(_Registry(), {"t": None}))  # type: ignore[arg-type]
    assert ok == [0, 2, 3] and table.num_rows == 3
    assert [b.index for b in bad] == [1] and "payload does not decode" in bad[0].reason


@pytest.mark.parametrize("schema", [
    {"type": "record", "name": "R", "fields": [{"name": "a", "type": {
        "type": "array", "items": "long"}}]},
    {"type": "record", "name": "R", "fields": [{"name": "u", "type": ["null", "long",
                                                                      "string"]}]},
    {"type": "record", "name": "R", "fields": [{"name": "m", "type": {
        "type": "fixed", "name": "F", "size": 8, "logicalType": "decimal", "precision": 4,
        "scale": 2}}]},
    "long",
])
def test_schemas_it_does_not_take_have_no_layout(schema: Any) -> None:
    assert layout_of(schema) is None


READER = {"type": "record", "name": "V", "fields": [
    {"name": "i", "type": "long"},  # int -> long
    {"name": "l", "type": "double"},  # long -> double
    {"name": "f", "type": "double"},  # float -> double
    {"name": "s", "type": ["null", "string"], "default": None},  # made nullable
    {"name": "n", "type": ["null", "string"]},
    {"name": "extra", "type": "long", "default": 42},  # added
    {"name": "tags", "type": {"type": "array", "items": "string"}, "default": ["x"]},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}


class _Evolved:
    shown = "http://registry"

    def schema_by_id(self, schema_id: int) -> RegisteredSchema | None:
        return {5: RegisteredSchema(5, "AVRO", json.dumps(WRITER)),
                6: RegisteredSchema(6, "AVRO", json.dumps(READER))}.get(schema_id)


@pytest.mark.parametrize("columns", [
    {"i": "long", "l": "double", "f": "double", "s": "string", "n": "string",
     "extra": "long", "tags": "json", "ts": "timestamp", "b": "boolean"},
    {"i": "int", "l": "long"},  # l is a double in the reader: every record is a dead letter
    {"f": "float"},  # a float promoted to double: the record-by-record path
])
def test_a_chunk_resolved_to_another_reader_schema_decodes_as_fastavro_resolves_it(
        columns: dict[str, str]) -> None:
    rng = random.Random(11)
    values: list[bytes | None] = [_wire({**_record(rng), "s": "é"}) for _ in range(30)]
    decoder = AvroDecoder(_Evolved(), {"t": (6, json.dumps(READER))})  # type: ignore[arg-type]
    found = decoder.vectorised(5, {"t"})
    assert found is not None
    if "extra" in columns:  # this chunk is one the column-wise path takes
        assert decode_chunk(values, found[0], columns, arrow_schema(columns),  # type: ignore[arg-type]
                            found[1], avro_value) is not None
    table, bad, ok = deserialize_avro(values, ["t"] * 30, columns, decoder)
    reader = fastavro.parse_schema(READER)
    rows, refused = [], []
    for j, v in enumerate(values):
        assert v is not None
        datum = fastavro.schemaless_reader(io.BytesIO(v[5:]), PARSED, reader)
        try:
            rows.append(record_fields(datum, columns))
        except ValueError:
            refused.append(j)
    want, more = rows_to_table(rows, arrow_schema(columns))
    assert not more
    assert [b.index for b in bad] == refused
    assert _same(table.to_pylist(), want.to_pylist())
