"""Property tests of the fast Avro paths (column-wise `avro_vector`, once-resolved
`avro_fast.Resolution`, column-wise `typed_columns`) against fastavro's own decoding and
resolution, record by record, on random and randomly corrupted payloads: a fast path may
refuse a chunk, never give a value that differs from fastavro's (silent corruption), and
the chunk's bad records are exactly the ones the record-by-record path finds."""

from __future__ import annotations

import io
import json
import math
import random
import uuid
from datetime import UTC, date, datetime, timedelta
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

ENUM: dict[str, Any] = {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}
WRITER: dict[str, Any] = {"type": "record", "name": "V", "fields": [
    {"name": "i", "type": "int"},
    {"name": "l", "type": "long"},
    {"name": "f", "type": "float"},
    {"name": "d", "type": "double"},
    {"name": "b", "type": "boolean"},
    {"name": "s", "type": "string"},
    {"name": "ns", "type": ["null", "string"]},
    {"name": "nl", "type": ["long", "null"]},
    {"name": "nd", "type": ["null", "double"]},
    {"name": "by", "type": "bytes"},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "tu", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
    {"name": "lt", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
    {"name": "dt", "type": {"type": "int", "logicalType": "date"}},
    {"name": "e", "type": ENUM},
    {"name": "u", "type": {"type": "string", "logicalType": "uuid"}},
    {"name": "m", "type": {"type": "bytes", "logicalType": "decimal", "precision": 38,
                           "scale": 4}},
    {"name": "m5", "type": ["null", {"type": "bytes", "logicalType": "decimal",
                                     "precision": 5, "scale": 0}]},
    {"name": "z", "type": "null"}]}
PARSED = fastavro.parse_schema(WRITER)
WID = 5
LONGS = [0, 1, -1, 63, -64, 64, -65, 2**31 - 1, -2**31, 2**31, -2**31 - 1, 2**53, 2**53 + 1,
         -2**53 - 1, 2**62, 2**63 - 1, -2**63, -2**63 + 1]
DOUBLES = [0.0, -0.0, 1.5, -2.25, 5e-324, 1.7976931348623157e308, float("inf"),
           float("-inf"), float("nan"), 3.4028235e38, 3.5e38, 1e-46]
TEXTS = ["", "a", "é", "日本語", "😀", "x" * 200, "\t\n", " "]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _ts(rng: random.Random) -> datetime:
    return rng.choice([
        datetime(1, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=UTC), EPOCH,
        datetime(1677, 9, 21, tzinfo=UTC), datetime(2262, 4, 12, tzinfo=UTC),  # ns limits
        datetime(2300, 1, 1, tzinfo=UTC), datetime(1500, 6, 1, 0, 0, 0, 1000, tzinfo=UTC),
        EPOCH + timedelta(milliseconds=rng.randint(-2**45, 2**45))])


def _dec(rng: random.Random, digits: int, scale: int) -> Decimal:
    n = rng.choice([0, 1, -1, 127, 128, -128, -129, 255, 256, -256, 10**digits - 1,
                    -(10**digits - 1), rng.randint(-10**digits + 1, 10**digits - 1)])
    return Decimal(n).scaleb(-scale)


def _record(rng: random.Random) -> dict[str, Any]:
    return {
        "i": rng.choice([x for x in LONGS if -2**31 <= x < 2**31]),
        "l": rng.choice(LONGS + [rng.randint(-2**63, 2**63 - 1)]),
        "f": rng.choice(DOUBLES),
        "d": rng.choice(DOUBLES + [rng.uniform(-1e300, 1e300)]),
        "b": rng.random() < 0.5,
        "s": rng.choice(TEXTS),
        "ns": rng.choice([None, *TEXTS]),
        "nl": rng.choice([None, *LONGS]),
        "nd": rng.choice([None, *DOUBLES]),
        "by": rng.choice([b"", b"\x00", b"\xff" * 3]),
        "ts": _ts(rng),
        "tu": rng.choice([None, _ts(rng)]),
        "lt": _ts(rng).replace(tzinfo=None),
        "dt": rng.choice([date(1, 1, 1), date(9999, 12, 31), date(1969, 12, 31),
                          date(2262, 4, 12), date(1970, 1, 1) + timedelta(rng.randint(-10**5,
                                                                                      10**5))]),
        "e": rng.choice("ABC"),
        "u": uuid.UUID(int=rng.getrandbits(128)),
        "m": _dec(rng, rng.choice([1, 5, 18, 19, 34, 38]), 4),
        "m5": rng.choice([None, _dec(rng, 5, 0)]),
        "z": None,
    }


def _wire(rec: dict[str, Any], schema: Any = PARSED, sid: int = WID) -> bytes:
    buf = io.BytesIO()
    buf.write(b"\x00" + sid.to_bytes(4, "big"))
    fastavro.schemaless_writer(buf, schema, rec)
    return buf.getvalue()


def _mutate(rng: random.Random, v: bytes) -> bytes:
    """One random corruption of a payload (the header kept)."""
    head, body = v[:5], bytearray(v[5:])
    how = rng.randrange(6)
    if how == 0 and body:  # truncated
        return head + bytes(body[:rng.randrange(len(body))])
    if how == 1:  # trailing bytes
        return head + bytes(body) + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3)))
    if how == 2 and body:  # one byte flipped
        j = rng.randrange(len(body))
        body[j] = rng.getrandbits(8)
        return head + bytes(body)
    if how == 3 and body:  # a byte dropped
        j = rng.randrange(len(body))
        return head + bytes(body[:j] + body[j + 1:])
    if how == 4:  # a byte inserted
        j = rng.randrange(len(body) + 1)
        return head + bytes(body[:j] + bytes([rng.getrandbits(8)]) + body[j:])
    # a 10- or 11-byte varint at the start (field i)
    return head + bytes([0xFF] * rng.randint(9, 10) + [rng.choice([0, 1, 2, 0x7F])]) + \
        bytes(body[1:])


def _columns(rng: random.Random) -> dict[str, str]:
    """A random declared schema over the writer's fields (and one it lacks)."""
    choices = {
        "i": ["int", "long", "double", "float", "string"], "l": ["long", "int", "double"],
        "f": ["float", "double"], "d": ["double", "float"], "b": ["boolean"],
        "s": ["string", "uuid", "json"], "ns": ["string"], "nl": ["long", "int", "double"],
        "nd": ["double", "float"], "by": ["json"], "ts": ["timestamp"],
        "tu": ["timestamp"], "lt": ["timestamp"], "dt": ["date"], "e": ["string"],
        "u": ["uuid", "string"], "m": ["decimal(38,4)", "decimal(20,4)", "decimal(10,2)"],
        "m5": ["decimal(5,0)", "decimal(3,0)", "decimal(10,0)"], "z": ["string", "long"],
        "missing": ["long"]}
    names = rng.sample(sorted(choices), rng.randint(1, len(choices)))
    return {n: rng.choice(choices[n]) for n in names}


class _Registry:
    shown = "http://registry"

    def __init__(self, schemas: dict[int, Any]) -> None:
        self.schemas = schemas

    def schema_by_id(self, schema_id: int) -> RegisteredSchema | None:
        s = self.schemas.get(schema_id)
        return None if s is None else RegisteredSchema(schema_id, "AVRO", json.dumps(s))


def _reference(values: list[bytes | None], columns: dict[str, str],
               writers: dict[int, Any], reader: Any
               ) -> tuple[list[dict[str, Any]], list[int]]:
    """fastavro (its own resolution to `reader`), then the record-by-record conversion:
    the good rows and the bad records' indices."""
    rows, good, bad = [], [], []
    parsed_reader = None if reader is None else fastavro.parse_schema(reader)
    for j, v in enumerate(values):
        if v is None:
            rows.append(dict.fromkeys(columns))
            good.append(j)
            continue
        sid = int.from_bytes(v[1:5], "big")
        try:
            buf = io.BytesIO(v[5:])
            w = fastavro.parse_schema(writers[sid])
            datum = fastavro.schemaless_reader(buf, w, None if sid == _reader_id(writers, reader)
                                               else parsed_reader)
            if buf.read():
                raise ValueError("left over")
            rows.append(record_fields(datum, columns))
            good.append(j)
        except Exception:  # noqa: BLE001 - a dead letter on that path
            bad.append(j)
    table, refused = rows_to_table(rows, arrow_schema(columns))
    gone = {k for k, _ in refused}
    return table.to_pylist(), sorted(bad + [good[k] for k in gone])


def _reader_id(writers: dict[int, Any], reader: Any) -> int | None:
    return next((k for k, s in writers.items() if s == reader), None)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, float) and isinstance(b, float) and a == 0 == b:
        return math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b and type(a) is type(b))


def _diff(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> str:
    for j, (a, b) in enumerate(zip(got, want, strict=False)):
        if not _same(a, b):
            return f"row {j}: " + ", ".join(f"{k}: {a.get(k)!r} != {b.get(k)!r}"
                                            for k in b if not _same(a.get(k), b[k]))
    return f"{len(got)} rows != {len(want)}"


def _check_chunk(values: list[bytes | None], columns: dict[str, str],
                 writers: dict[int, Any], reader: Any, rid: int | None) -> bool:
    """The whole chunk path (vectorised, resolved, typed or record by record, as it
    chooses) against the reference; True when the column-wise path took it."""
    topics = ["t"] * len(values)
    decoder = AvroDecoder(_Registry(writers),  # type: ignore[arg-type]
                          {"t": None if reader is None or rid is None
                           else (rid, json.dumps(reader))})
    table, bad, ok = deserialize_avro(values, topics, columns, decoder)
    want, want_bad = _reference(values, columns, writers, reader)
    got = table.to_pylist()
    assert [b.index for b in bad] == want_bad, (columns, [b.reason for b in bad])
    assert ok == [j for j in range(len(values)) if j not in set(want_bad)]
    assert _same(got, want), (columns, _diff(got, want))
    found = decoder.vectorised(WID, {"t"}) if values and all(
        v is not None and v[1:5] == WID.to_bytes(4, "big") for v in values) else None
    if found is None:
        return False
    direct = decode_chunk(values, found[0], columns, arrow_schema(columns),  # type: ignore[arg-type]
                          found[1], avro_value)
    if direct is not None:
        assert not want_bad
        assert _same(direct.to_pylist(), want), (columns, _diff(direct.to_pylist(), want))
    return direct is not None


def test_random_chunks_as_written_decode_as_fastavro() -> None:
    rng = random.Random(3030)
    taken = 0
    for _ in range(150):
        cols = _columns(rng)
        values: list[bytes | None] = [_wire(_record(rng)) for _ in range(rng.randint(1, 40))]
        taken += _check_chunk(values, cols, {WID: WRITER}, None, None)
    assert taken > 10  # the column-wise path is exercised, not only refused


def test_random_corruptions_are_refused_and_only_the_bad_record_is_a_dead_letter() -> None:
    rng = random.Random(4040)
    for _ in range(300):
        cols = _columns(rng)
        values: list[bytes | None] = [_wire(_record(rng)) for _ in range(rng.randint(1, 12))]
        for _ in range(rng.randint(1, 2)):
            j = rng.randrange(len(values))
            v = values[j]
            assert v is not None
            values[j] = _mutate(rng, v)
        _check_chunk(values, cols, {WID: WRITER}, None, None)


def test_edge_varints_bytes_and_unions_by_hand() -> None:
    """Zig-zag of int64 min/max, 10-byte varints, an out-of-range union branch or enum
    symbol index, a decimal with leading zero / 0xff bytes."""
    rng = random.Random(1)
    base = _record(rng)
    cols = {"l": "long", "nl": "long", "e": "string", "m": "decimal(38,4)", "i": "int"}
    for rec in [{**base, "l": 2**63 - 1}, {**base, "l": -2**63}, {**base, "nl": -2**63}]:
        assert _check_chunk([_wire(rec)] * 3, cols, {WID: WRITER}, None, None)
    good = _wire(base)
    # a union branch index 2 / -1 for nl; an enum index 3 / -1: splice by re-encoding
    fields = WRITER["fields"]
    prefix = _wire({**base}, fastavro.parse_schema({**WRITER, "fields": fields[:7]}))
    for branch in (b"\x04", b"\x01", b"\x7f"):
        odd = prefix + branch + good[len(prefix) + 1:]
        _check_chunk([good, odd, good], cols, {WID: WRITER}, None, None)
    # a decimal as bytes with leading zeros (not minimal) and with leading 0xff
    for raw in [b"\x00\x00\x00\x01", b"\xff\xff\xff\xff", b"\x00\xff", b"", b"\x00" * 16,
                b"\x80" + b"\x00" * 15, b"\x00" * 17 + b"\x05"]:
        rec = {**base, "m": Decimal(int.from_bytes(raw, "big", signed=True)).scaleb(-4)}
        enc = _wire(rec)
        # replace the encoding of m with `raw` as written (lengths may differ)
        m_at = len(_wire(rec, fastavro.parse_schema({**WRITER, "fields": fields[:16]})))
        m_len = len(_wire(rec, fastavro.parse_schema({**WRITER, "fields": fields[:17]}))) - m_at
        spliced = enc[:m_at] + _zigzag(len(raw)) + raw + enc[m_at + m_len:]
        _check_chunk([spliced, good], cols, {WID: WRITER}, None, None)


def _zigzag(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while True:
        b = z & 0x7F
        z >>= 7
        if z:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def test_a_chunk_of_mixed_writer_ids_decodes_as_fastavro() -> None:
    rng = random.Random(9)
    other = {**WRITER, "fields": [f for f in WRITER["fields"] if f["name"] != "s"]}
    writers = {WID: WRITER, 6: other}
    parsed_other = fastavro.parse_schema(other)
    values: list[bytes | None] = []
    for _ in range(30):
        r = _record(rng)
        values.append(_wire(r) if rng.random() < 0.5 else _wire(r, parsed_other, 6))
    _check_chunk(values, {"s": "string", "l": "long", "m": "decimal(38,4)"}, writers, WRITER,
                 WID)
    _check_chunk(values, {"s": "string", "l": "long"}, writers, other, 6)


# --- writer -> reader resolution, compiled once (avro_fast) vs fastavro's own ---

def _evolve(rng: random.Random) -> dict[str, Any]:
    """A random reader schema for WRITER: fields dropped, promoted, made nullable,
    reordered, added with a default (null or a value)."""
    out = []
    promos = {"int": ["long", "float", "double"], "long": ["float", "double"],
              "float": ["double"]}
    for f in WRITER["fields"]:
        r = rng.random()
        if r < 0.15:
            continue  # dropped
        t = f["type"]
        if r < 0.45 and isinstance(t, str) and t in promos:
            out.append({"name": f["name"], "type": rng.choice(promos[t])})
        elif r < 0.6 and not isinstance(t, list) and t != "null":
            u = ["null", t] if rng.random() < 0.5 else [t, "null"]
            out.append({"name": f["name"], "type": u, **({"default": None} if u[0] == "null"
                                                         else {})})
        else:
            out.append(f)
    adds: list[dict[str, Any]] = [{"name": "a_null", "type": ["null", "long"], "default": None},
            {"name": "a_long", "type": "long", "default": -2**63},
            {"name": "a_str", "type": "string", "default": "é\u00e9"},
            {"name": "a_dbl", "type": "double", "default": 1.5},
            {"name": "a_enum", "type": {"type": "enum", "name": "E9", "symbols": ["P", "Q"]},
             "default": "Q"},
            {"name": "a_dec", "type": {"type": "bytes", "logicalType": "decimal",
                                       "precision": 6, "scale": 2}, "default": "\u0001\u0000"},
            {"name": "a_date", "type": {"type": "int", "logicalType": "date"},
             "default": -1},
            {"name": "a_arr", "type": {"type": "array", "items": "long"}, "default": [1]},
            {"name": "a_union", "type": ["string", "null"], "default": "x"}]
    out += rng.sample(adds, rng.randint(0, len(adds)))
    rng.shuffle(out)
    return {"type": "record", "name": "V", "fields": out}


def _reader_columns(rng: random.Random, reader: dict[str, Any]) -> dict[str, str]:
    kinds = {"int": "long", "long": "long", "float": "double", "double": "double",
             "boolean": "boolean", "string": "string", "bytes": "json", "null": "string",
             "timestamp-millis": "timestamp", "timestamp-micros": "timestamp",
             "local-timestamp-millis": "timestamp", "date": "date", "uuid": "uuid",
             "decimal": "decimal(38,4)", "enum": "string", "array": "json"}
    out = {}
    for f in reader["fields"]:
        t = f["type"]
        if isinstance(t, list):
            t = next(x for x in t if x != "null")
        k = t if isinstance(t, str) else t.get("logicalType") or t["type"]
        col = kinds[k]
        if f["name"] == "m5":
            col = "decimal(5,0)"
        if f["name"] == "a_dec":
            col = "decimal(6,2)"
        if k in ("int", "long") and rng.random() < 0.3:
            col = rng.choice(["int", "double", "string"])  # some refused values
        if rng.random() < 0.8:
            out[f["name"]] = col
    return out or {"l": "long"}


def test_random_evolutions_resolve_as_fastavro_resolves() -> None:
    rng = random.Random(5050)
    for _ in range(120):
        reader = _evolve(rng)
        try:
            fastavro.parse_schema(reader)
        except Exception:  # noqa: BLE001 - not a schema fastavro takes
            continue
        cols = _reader_columns(rng, reader)
        values: list[bytes | None] = [_wire(_record(rng)) for _ in range(rng.randint(1, 25))]
        if rng.random() < 0.3:
            j = rng.randrange(len(values))
            v = values[j]
            assert v is not None
            values[j] = _mutate(rng, v)
        if rng.random() < 0.2:
            values[rng.randrange(len(values))] = None  # a tombstone
        _check_chunk(values, cols, {WID: WRITER, 9: reader}, reader, 9)


@pytest.mark.parametrize("reader_type,value", [
    ("long", 2**31 - 1), ("float", 2**53 + 1), ("double", 2**63 - 1), ("float", -2**63)])
def test_promotions_keep_fastavro_values(reader_type: str, value: int) -> None:
    w = {"type": "record", "name": "P", "fields": [{"name": "x", "type": "long"}]}
    r = {"type": "record", "name": "P", "fields": [{"name": "x", "type": reader_type}]}
    v = b"\x00\x00\x00\x00\x01" + _zigzag(value)
    decoder = AvroDecoder(_Registry({1: w, 2: r}), {"t": (2, json.dumps(r))})  # type: ignore[arg-type]
    _, got = decoder.decode(v, "t")
    want = fastavro.schemaless_reader(io.BytesIO(v[5:]), fastavro.parse_schema(w),
                                      fastavro.parse_schema(r))
    assert _same(got, want)
    assert Resolution() == Resolution()
    assert layout_of(w) is not None


@pytest.mark.parametrize("column", ["decimal(38,4)", "decimal(10,4)"])
def test_a_decimal_of_minus_two_to_the_127_is_a_dead_letter_not_a_value(column: str) -> None:
    """-2**127 as 16 bytes: 39 digits, more than any decimal128 precision. fastavro rounds
    it to the writer's 38 and the record-by-record path refuses it for the column; Arrow's
    validate() passed it (its absolute value overflows), so the column-wise path stored a
    39-digit value in a decimal(p,4) column."""
    rng = random.Random(1)
    base = _record(rng)
    fields = WRITER["fields"]
    raw = b"\x80" + b"\x00" * 15
    rec = {**base, "m": Decimal(0)}
    enc = _wire(rec)
    m_at = len(_wire(rec, fastavro.parse_schema({**WRITER, "fields": fields[:16]})))
    spliced = enc[:m_at] + _zigzag(len(raw)) + raw + enc[m_at + 2:]  # 0: length 1, 1 byte
    cols = {"m": column, "l": "long"}
    decoder = AvroDecoder(_Registry({WID: WRITER}), {"t": None})  # type: ignore[arg-type]
    found = decoder.vectorised(WID, {"t"})
    assert found is not None
    got = decode_chunk([spliced, enc], found[0], cols, arrow_schema(cols), found[1],
                       avro_value)
    assert got is None, got.to_pylist()
    table, bad, ok = deserialize_avro([spliced, enc], ["t", "t"], cols, decoder)
    assert [b.index for b in bad] == [0] and ok == [1]
    assert table.column("m").to_pylist() == [Decimal("0.0000")]


KEY: dict[str, Any] = {"type": "record", "name": "K", "fields": [
    {"name": "l", "type": "long"},
    {"name": "m", "type": {"type": "bytes", "logicalType": "decimal", "precision": 38,
                           "scale": 4}}]}


def test_a_keyed_records_fate_does_not_depend_on_its_chunk_neighbours() -> None:
    """format.key avro: the value's field `m` does not fit decimal(20,4), the key's `m`
    (filling that column over it) does. Record by record, the value's field is converted
    first and makes the record a dead letter; the column-wise conversion of the chunk
    (`typed_columns`) took the key's value and never checked the value's: the record landed
    when its chunk was clean and was a dead letter when a neighbour was bad."""
    rng = random.Random(2)
    cols = {"l": "long", "m": "decimal(20,4)", "s": "string"}
    keyp = fastavro.parse_schema(KEY)
    big = _wire({**_record(rng), "m": Decimal(10**30)})
    fine = _wire({**_record(rng), "m": Decimal(1)})
    key = _wire({"l": 1, "m": Decimal("2.5")}, keyp, 7)
    fates = []
    for values in ([big, fine], [big, fine, fine[:-1]]):
        decoder = AvroDecoder(_Registry({WID: WRITER}), {"t": None})  # type: ignore[arg-type]
        keyed = AvroDecoder(_Registry({7: KEY}), {"t": None})  # type: ignore[arg-type]
        n = len(values)
        _, bad, ok = deserialize_avro(list(values), ["t"] * n, cols, decoder, [key] * n, keyed)
        fates.append((0 in ok, [b.index for b in bad if b.index < 2]))
    assert fates[0] == fates[1], fates
    assert fates[0] == (False, [0])  # as the record-by-record path decides


KEY2: dict[str, Any] = {"type": "record", "name": "K", "fields": [
    {"name": "l", "type": "double"}, {"name": "kx", "type": "long", "default": 7}]}


def test_random_keyed_chunks_decode_as_record_by_record() -> None:
    """format.key avro: values, tombstones, null and corrupted keys, keys read as written
    or resolved to a later key schema; against fastavro + record_fields per record."""
    keyp = fastavro.parse_schema(KEY)
    for seed in range(120):
        rng = random.Random(seed)
        cols = {**_columns(rng), **({"kx": "long"} if rng.random() < 0.5 else {})}
        reader = KEY2 if rng.random() < 0.5 else None
        n = rng.randint(1, 8)
        values = [_wire(_record(rng)) if rng.random() < 0.85 else None for _ in range(n)]
        keys: list[bytes | None] = []
        for _ in range(n):
            r = rng.random()
            rec = _record(rng)
            k = _wire({"l": rec["l"], "m": rec["m"]}, keyp, 7)
            keys.append(None if r < 0.15 else _mutate(rng, k) if r > 0.9 else k)
        kd = AvroDecoder(_Registry({7: KEY, 8: KEY2}),  # type: ignore[arg-type]
                         {"t": None if reader is None else (8, json.dumps(reader))})
        vd = AvroDecoder(_Registry({WID: WRITER}), {"t": None})  # type: ignore[arg-type]
        table, bad, _ = deserialize_avro(values, ["t"] * n, cols, vd, keys, kd)
        rows, good, bad_want = [], [], []
        for j in range(n):
            try:
                v, kb = values[j], keys[j]
                row = dict.fromkeys(cols) if v is None else record_fields(
                    fastavro.schemaless_reader(io.BytesIO(v[5:]), PARSED, None), cols)
                if kb is not None:
                    buf = io.BytesIO(kb[5:])
                    kdat = fastavro.schemaless_reader(
                        buf, keyp, None if reader is None else fastavro.parse_schema(reader))
                    if buf.read():
                        raise ValueError("left over")
                    row.update(record_fields(kdat, cols, only_present=True))
                rows.append(row)
                good.append(j)
            except Exception:  # noqa: BLE001 - a dead letter on that path
                bad_want.append(j)
        want, refused = rows_to_table(rows, arrow_schema(cols))
        assert [b.index for b in bad] == sorted(bad_want + [good[x] for x, _ in refused])
        assert _same(table.to_pylist(), want.to_pylist()), (seed, _diff(
            table.to_pylist(), want.to_pylist()))


# --- random flat layouts: every field kind the column-wise decoder takes, each possibly
# nullable either way round, into each column type it may be declared as ---

_KINDS: dict[str, tuple[Any, Any, list[str]]] = {  # kind: (Avro type, value, columns)
    "int": ("int", lambda r: r.choice([0, -1, 2**31 - 1, -2**31, r.randint(-99, 99)]),
            ["int", "long", "double"]),
    "long": ("long", lambda r: r.choice(LONGS), ["long", "int", "double"]),
    "float": ("float", lambda r: r.choice(DOUBLES), ["float", "double"]),
    "double": ("double", lambda r: r.choice(DOUBLES), ["double", "float"]),
    "boolean": ("boolean", lambda r: r.random() < .5, ["boolean"]),
    "string": ("string", lambda r: r.choice([*TEXTS, "a\x00b"]), ["string", "json", "uuid"]),
    "bytes": ("bytes", lambda r: r.choice([b"", b"\x00\x01"]), ["json"]),
    "tsm": ({"type": "long", "logicalType": "timestamp-millis"}, _ts, ["timestamp"]),
    "tsu": ({"type": "long", "logicalType": "timestamp-micros"}, _ts, ["timestamp"]),
    "ltm": ({"type": "long", "logicalType": "local-timestamp-millis"},
            lambda r: _ts(r).replace(tzinfo=None), ["timestamp"]),
    "ltu": ({"type": "long", "logicalType": "local-timestamp-micros"},
            lambda r: _ts(r).replace(tzinfo=None), ["timestamp"]),
    "date": ({"type": "int", "logicalType": "date"},
             lambda r: date(1970, 1, 1) + timedelta(r.randint(-719162, 2932896)), ["date"]),
    "uuid": ({"type": "string", "logicalType": "uuid"},
             lambda r: uuid.UUID(int=r.getrandbits(128)), ["uuid", "string"]),
    "dec": ({"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 2},
            lambda r: _dec(r, r.choice([1, 9, 20]), 2),
            ["decimal(10,2)", "decimal(38,2)", "decimal(5,2)"]),
    "enum": (None, lambda r: r.choice("XYZ"), ["string"]),
}


def test_random_flat_layouts_decode_as_fastavro() -> None:
    taken = 0
    for seed in range(150):
        rng = random.Random(seed)
        kinds = [rng.choice(sorted(_KINDS)) for _ in range(rng.randint(1, 6))]
        fields, cols, nullable = [], {}, []
        for i, k in enumerate(kinds):
            t = _KINDS[k][0] or {"type": "enum", "name": f"E{i}", "symbols": ["X", "Y", "Z"]}
            nl = rng.random() < 0.4
            if nl:
                t = ["null", t] if rng.random() < .5 else [t, "null"]
            fields.append({"name": f"f{i}", "type": t})
            nullable.append(nl)
            if rng.random() < 0.8:
                cols[f"f{i}"] = rng.choice(_KINDS[k][2])
        writer = {"type": "record", "name": "R", "fields": fields}
        parsed = fastavro.parse_schema(writer)
        values: list[bytes | None] = []
        for _ in range(rng.randint(1, 20)):
            rec = {f"f{i}": None if nullable[i] and rng.random() < .3 else _KINDS[k][1](rng)
                   for i, k in enumerate(kinds)}
            try:
                v = _wire(rec, parsed)
            except Exception:  # noqa: BLE001 - a value the writer schema cannot hold
                continue
            values.append(_mutate(rng, v) if rng.random() < 0.05 else v)
        if values:
            taken += _check_chunk(values, cols or {"x": "long"}, {WID: writer}, None, None)
    assert taken > 30
