"""Binary COPY encoder against a straightforward per-row struct.pack reference."""

from __future__ import annotations

import datetime as dt
import random
import struct
from typing import Any

import pyarrow as pa
import pytest

from offsetflow.stage import pgcopy

UTC = dt.UTC
EPOCH = dt.datetime(2000, 1, 1, tzinfo=UTC)


def ref_field(v: Any, t: str) -> bytes:
    if v is None:
        return struct.pack(">i", -1)
    if t == "text":
        data = v.encode()
    elif t == "bytea":
        data = v
    elif t == "jsonb":
        data = b"\x01" + v.encode()
    elif t == "integer":
        data = struct.pack(">i", v)
    elif t == "bigint":
        data = struct.pack(">q", v)
    elif t == "smallint":
        data = struct.pack(">h", v)
    elif t == "double precision":
        data = struct.pack(">d", v)
    elif t == "real":
        data = struct.pack(">f", v)
    elif t == "boolean":
        data = b"\x01" if v else b"\x00"
    elif t in ("timestamptz", "timestamp"):
        delta = v - (EPOCH if v.tzinfo else EPOCH.replace(tzinfo=None))
        data = struct.pack(">q", (delta.days * 86400 + delta.seconds) * 10**6
                           + delta.microseconds)
    elif t == "date":
        data = struct.pack(">i", (v - EPOCH.date()).days)
    else:
        raise AssertionError(t)
    return struct.pack(">i", len(data)) + data


def reference(rows: list[tuple[Any, ...]], types: list[str]) -> bytes:
    out = [pgcopy.HEADER]
    for row in rows:
        out.append(struct.pack(">h", len(types)))
        out += [ref_field(v, t) for v, t in zip(row, types, strict=True)]
    out.append(pgcopy.TRAILER)
    return b"".join(out)


SCHEMA = pa.schema([
    ("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
    ("ts", pa.timestamp("us", tz="UTC")), ("key", pa.binary()), ("headers", pa.string()),
    ("amount", pa.float64()), ("ok", pa.bool_()), ("day", pa.date32()),
    ("small", pa.int16()), ("ratio", pa.float32())])
TYPES = ["text", "integer", "bigint", "timestamptz", "bytea", "jsonb", "double precision",
         "boolean", "date", "smallint", "real"]


def random_rows(n: int, seed: int) -> list[tuple[Any, ...]]:
    rnd = random.Random(seed)

    def maybe(v: Any) -> Any:
        return None if rnd.random() < 0.15 else v
    rows = []
    for i in range(n):
        rows.append((
            maybe(rnd.choice(["orders", "é-ü", ""])), maybe(rnd.randint(-2**31, 2**31 - 1)),
            maybe(rnd.randint(-2**63, 2**63 - 1)),
            maybe(dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(
                microseconds=rnd.randint(-10**15, 4 * 10**15))),
            maybe(rnd.randbytes(rnd.randint(0, 40))), maybe('[{"key":"k","value":"AA=="}]'),
            maybe(rnd.uniform(-1e6, 1e6)), maybe(rnd.random() < 0.5),
            maybe(dt.date(1990, 1, 1) + dt.timedelta(days=rnd.randint(0, 20000))),
            maybe(rnd.randint(-2**15, 2**15 - 1)), maybe(0.5 * i)))
    return rows


@pytest.mark.parametrize("n,seed", [(1, 1), (17, 2), (500, 3)])
def test_encode_matches_reference(n: int, seed: int) -> None:
    rows = random_rows(n, seed)
    batch = pa.RecordBatch.from_pylist([dict(zip(SCHEMA.names, r, strict=True)) for r in rows],
                                       schema=SCHEMA)
    assert pgcopy.encode(batch, TYPES) == reference(rows, TYPES)


def test_sliced_and_chunked_input() -> None:
    rows = random_rows(60, 9)
    table = pa.Table.from_pylist([dict(zip(SCHEMA.names, r, strict=True)) for r in rows],
                                 schema=SCHEMA)
    chunked = pa.concat_tables([table.slice(0, 25), table.slice(25)])
    assert pgcopy.encode(chunked, TYPES) == reference(rows, TYPES)
    sliced = table.to_batches()[0].slice(10, 30)
    assert pgcopy.encode(sliced, TYPES) == reference(rows[10:40], TYPES)


def test_empty_batch_and_unsupported_types() -> None:
    empty = pa.RecordBatch.from_pylist([], schema=pa.schema([("x", pa.int64())]))
    assert pgcopy.encode(empty, ["bigint"]) == pgcopy.HEADER + pgcopy.TRAILER
    dec = pa.RecordBatch.from_pydict({"d": pa.array([1], pa.decimal128(10, 2))})
    assert pgcopy.encode(dec, ["numeric(10,2)"]) is None
    with pytest.raises(ValueError, match="1 columns but 2"):
        pgcopy.encode(dec, ["numeric(10,2)", "text"])
