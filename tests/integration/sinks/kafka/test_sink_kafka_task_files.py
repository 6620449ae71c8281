"""The Kafka sink's record path without PostgreSQL (issue 32, task files).

The JSON values a task builds (`offsetflow.sinks.kafka.values.json_values`) are byte for
byte the ones PostgreSQL's `row_to_json` builds from the same rows staged as the tasks stage
them (binary COPY), read with the sink's own query under its `OUTPUT_SETTINGS`: the edge
cases of every type built in the task, checked against the stack's PostgreSQL."""

from __future__ import annotations

import io
import json
import random
from datetime import UTC, date, datetime
from typing import Any

import psycopg2
import pyarrow as pa
import pytest
from psycopg2 import sql

from offsetflow.sinks.kafka.form import OUTPUT_SETTINGS, parts_select_sql
from offsetflow.sinks.kafka.values import json_values
from offsetflow.stage import pgcopy

UTC = UTC
_rng = random.Random(32)
FLOATS = [0.0, -0.0, 1.0, -1.5, 100000.0, 1e15, 1e16, 1e20, 1e22, 1e100, 1e-4, 1e-5,
          1.5e-7, 0.1, 0.30000000000000004, 123456789012345.6, 1234567890123456.8,
          999999999999999.9, 2.2250738585072014e-308, 5e-324, 1.7976931348623157e308,
          float("nan"), float("inf"), float("-inf"), 0.001, 12.34, -0.00012, None,
          *(_rng.uniform(-1e6, 1e6) for _ in range(30)),
          *(10 ** _rng.uniform(-30, 30) for _ in range(30))]
REALS = [0.0, -0.0, 1.0, 100000.0, 1e6, 1234567.0, 1e-4, 1e-5, 0.1, 3.4e38, 1.4e-45,
         float("nan"), float("inf"), 123456.7, None,
         *(10 ** _rng.uniform(-20, 20) for _ in range(30))]
TEXTS = ["plain", "", "quote \" and backslash \\", "tab\tnew\nline\rcr\bbs\fff",
         "\x01\x1f ctl", "\x7f del", "unicode é ü 漢字 🎉", "\u2028\u2029", "/slash",
         "\\u0041 literal", None]
TIMES = [datetime(2026, 11, 27, 12, 0, tzinfo=UTC), datetime(2026, 1, 1, 0, 0, 0, 1, UTC),
         datetime(2026, 1, 1, 0, 0, 0, 100000, UTC), datetime(2026, 1, 1, 0, 0, 0, 123456, UTC),
         datetime(1970, 1, 1, tzinfo=UTC), datetime(1, 1, 1, tzinfo=UTC),
         datetime(9999, 12, 31, 23, 59, 59, 999999, UTC), datetime(1969, 12, 31, 23, 59, 59,
                                                                   500000, UTC), None]


def _column(values: list[Any], n: int) -> list[Any]:
    return [values[i % len(values)] for i in range(n)]


def _batch() -> tuple[pa.RecordBatch, dict[str, str]]:
    n = max(len(FLOATS), len(REALS), len(TEXTS), len(TIMES)) + 3
    cols: dict[str, tuple[pa.Array, str]] = {
        "topic": (pa.array(["src"] * n), "text"),
        "partition": (pa.array([0] * n, pa.int32()), "integer"),
        "offset": (pa.array(range(n), pa.int64()), "bigint"),
        "value": (pa.array([None if i == n - 1 else b"v" for i in range(n)], pa.binary()),
                  "bytea"),
        "d": (pa.array(_column(FLOATS, n), pa.float64()), "double precision"),
        "r": (pa.array(_column(REALS, n), pa.float32()), "real"),
        "t": (pa.array(_column(TEXTS, n), pa.string()), "text"),
        "ts": (pa.array(_column(TIMES, n), pa.timestamp("us", "UTC")), "timestamptz"),
        "ntz": (pa.array([None if t is None else t.replace(tzinfo=None)
                          for t in _column(TIMES, n)], pa.timestamp("us")), "timestamp"),
        "day": (pa.array(_column([date(2026, 2, 28), date(1, 1, 1), date(9999, 12, 31),
                                  None], n), pa.date32()), "date"),
        "i": (pa.array(_column([0, -1, 2**63 - 1, -2**63, None], n), pa.int64()), "bigint"),
        "small": (pa.array(_column([0, -32768, 32767, None], n), pa.int16()), "smallint"),
        "int": (pa.array(_column([7, -2**31, None], n), pa.int32()), "integer"),
        "b": (pa.array(_column([True, False, None], n), pa.bool_()), "boolean"),
        "weird \"name\" é": (pa.array(_column(["x"], n)), "text"),
    }
    batch = pa.RecordBatch.from_arrays([a for a, _ in cols.values()], names=list(cols))
    return batch, {c: t for c, (_, t) in cols.items()}


class _Sink:  # what `parts_select_sql` reads of a KafkaSinkConfig
    value_format = "json"
    value_columns: tuple[str, ...] = ()
    key_column = None
    headers = "none"


@pytest.mark.parametrize("float_digits", [None, "0"])
def test_task_built_json_values_are_row_to_json_byte_for_byte(
        pg_dsn: str, unique: str, float_digits: str | None) -> None:
    """Every built type's edge cases (shortest floats in both notations, NaN and the
    infinities, -0, float4, control characters and non-ASCII text, timestamps with and
    without fractions and time zone at years 1 and 9999, dates, integer limits, NULLs, a
    tombstone, a column name needing escapes), whatever the session's own settings."""
    batch, types = _batch()
    payload = [c for c in types if c not in ("topic", "partition", "offset", "value")]
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            if float_digits is not None:
                cur.execute(f"SET extra_float_digits = {float_digits}")
            table = sql.Identifier(f"kv_{unique}")
            cur.execute(sql.SQL("CREATE TEMP TABLE {} ({})").format(table, sql.SQL(", ").join(
                sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                for c, t in types.items())))
            data = pgcopy.encode(batch, list(types.values()))
            assert data is not None
            cur.copy_expert(sql.SQL("COPY {} FROM STDIN (FORMAT binary)").format(table),
                            io.BytesIO(data))
            cur.execute(OUTPUT_SETTINGS)
            sink = _Sink()
            sink.value_columns = tuple(payload)
            cur.execute(parts_select_sql(sink, types, [(table, None)]))
            want = [r[4] for r in cur.fetchall()]
        conn.rollback()
    finally:
        conn.close()
    built = json_values(batch, payload, types)
    assert built is not None
    got = [None if v is None else v.decode() for v in built.to_pylist()]
    diffs = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    assert not diffs, diffs[:5]
    assert got[-1] is None  # the tombstone stays one
    assert any('"NaN"' in (v or "") for v in got)


def _raw_batch() -> tuple[pa.RecordBatch, dict[str, str]]:
    """Rows as a task stages them (before stage form): headers nested, timestamps with
    sub-millisecond fractions both sides of .5 ms and before 1970, a tombstone."""
    n = 12
    hdr = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    us = [1_700_000_000_000_000 + d for d in (0, 499, 500, 501, 999, 1500)] + \
         [-1_000_000 - d for d in (0, 499, 500, 501, 1500)] + [None]
    cols: dict[str, tuple[pa.Array, str]] = {
        "topic": (pa.array(["src"] * n), "text"),
        "partition": (pa.array([0] * n, pa.int32()), "integer"),
        "offset": (pa.array(range(n), pa.int64()), "bigint"),
        "timestamp": (pa.array(us, pa.int64()).cast(pa.timestamp("us", "UTC")),
                      "timestamptz"),
        "key": (pa.array([b"\x00\xffk", None] * 6, pa.binary()), "bytea"),
        "value": (pa.array([None if i == 3 else b"raw \xff" for i in range(n)], pa.binary()),
                  "bytea"),
        "headers": (pa.array([[{"key": "h", "value": b"\x01\x02"}, {"key": "n", "value": None}],
                              None, []] * 4, hdr), "jsonb"),
        "name": (pa.array(_column(TEXTS, n)), "text"),
        "amount": (pa.array(_column(FLOATS, n), pa.float64()), "double precision"),
        "at": (pa.array(_column(TIMES, n), pa.timestamp("us", "UTC")), "timestamptz"),
        "n": (pa.array(_column([5, None, -3], n), pa.int64()), "bigint"),
    }
    return (pa.RecordBatch.from_arrays([a for a, _ in cols.values()], names=list(cols)),
            {c: t for c, (_, t) in cols.items()})


class _Cfg:
    value_format = "json"
    value_columns: tuple[str, ...] = ()
    key_column: str | None = None
    value_column = "value"
    headers = "carry"


@pytest.mark.parametrize("shape", ["json source key", "json key_column text",
                                   "json key_column bigint", "json key_column timestamptz",
                                   "json key_column double", "json value_columns",
                                   "raw bytea", "raw text", "no headers"])
def test_task_built_records_are_the_stage_querys(pg_dsn: str, unique: str,
                                                 shape: str) -> None:
    """Every field the produce loop takes (key bytes, value, headers, timestamp) built in
    the task equals what the sink's stage query gives for the same staged rows."""
    from offsetflow.sinks.kafka.form import record_key
    from offsetflow.sinks.kafka.values import finished_records
    from offsetflow.stage import stage_form

    raw, types = _raw_batch()
    cfg = _Cfg()
    cfg.key_column = {"json key_column text": "name", "json key_column bigint": "n",
                      "json key_column timestamptz": "at",
                      "json key_column double": "amount"}.get(shape)
    if shape == "json value_columns":
        cfg.value_columns = ("n", "name")
    if shape.startswith("raw"):
        cfg.value_format = "raw"
        cfg.value_column = "value" if shape == "raw bytea" else "name"
    if shape == "no headers":
        cfg.headers = "none"
    staged = stage_form(raw, hex_binary=False)
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            table = sql.Identifier(f"kr_{unique}")
            cur.execute(sql.SQL("CREATE TEMP TABLE {} ({})").format(table, sql.SQL(", ").join(
                sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                for c, t in types.items())))
            data = pgcopy.encode(staged, list(types.values()))
            assert data is not None
            cur.copy_expert(sql.SQL("COPY {} FROM STDIN (FORMAT binary)").format(table),
                            io.BytesIO(data))
            cur.execute(OUTPUT_SETTINGS)
            cur.execute(parts_select_sql(cfg, types, [(table, None)]))  # type: ignore[arg-type]
            want = [(t, p, o, record_key(k), None if v is None else
                     v.encode() if isinstance(v, str) else bytes(v), h, ts)
                    for t, p, o, k, v, h, ts in cur.fetchall()]
        conn.rollback()
    finally:
        conn.close()
    built = finished_records(cfg, types, staged)  # type: ignore[arg-type]
    assert built is not None
    got = [(r["topic"], r["partition"], r["offset"], r["key"], r["value"],
            None if r["headers"] is None else json.loads(r["headers"]), r["ts"])
           for r in built.to_pylist()]
    diffs = [(w, g) for w, g in zip(want, got, strict=True) if w != g]
    assert not diffs, diffs[:3]
