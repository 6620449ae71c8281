"""Deserializers: Kafka values (bytes) to typed Arrow columns, with a reason for every bad one.

Fast path: pyarrow's C++ JSON reader over a chunk of newline-delimited values with the
declared schema, then a few vectorised checks for what pyarrow accepts but PostgreSQL, JSON
or the declared type cannot hold (a value that is not one object, invalid UTF-8, NUL in
strings, NaN/Infinity, float overflow, decimal precision). If the chunk has any bad record,
the slow path parses record by record in Python to say exactly which offsets are bad and
why; `tests/unit/source/test_deserialize_paths.py` holds both paths to the same answer.
Nothing is dropped silently and nothing raises: every input record comes out either as a good
row or as a `BadRecord`.

A null value (a tombstone) is a row too: its fields are null, except those the Kafka key
fills when the key is a JSON object with fields of the schema's names.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, time
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation, localcontext
from typing import Any

import numpy as np
import pyarrow as pa

from offsetflow.config import DECIMAL_RE
from offsetflow.source.json_fast import BadRecord, parse_fast

# a chunk the fast path refuses is halved down to this size before records are parsed one
# by one in Python (~10x slower than the fast path per record)
SLOW_PATH_ROWS = 1024


def arrow_type(t: str) -> pa.DataType:
    m = DECIMAL_RE.match(t)
    if m:
        return pa.decimal128(int(m.group(1)), int(m.group(2)))
    return {
        "string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
        "float": pa.float32(), "boolean": pa.bool_(), "timestamp": pa.timestamp("us", tz="UTC"),
        "date": pa.date32(), "json": pa.string(), "uuid": pa.string(),
    }[t]


def arrow_schema(schema: Mapping[str, str]) -> pa.Schema:
    return pa.schema([pa.field(name, arrow_type(t)) for name, t in schema.items()])


def text_value(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL character (\\u0000), which PostgreSQL text cannot "
                         "store")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate ({value[e.start]!r}), which is "
                         f"not valid Unicode") from e
    return value


def decimal_value(value: Any, t: str) -> Decimal:
    """As PostgreSQL's numeric(p,s): round to the scale (half away from zero), refuse what
    then needs more than p - s digits before the point."""
    m = DECIMAL_RE.match(t)
    assert m is not None
    precision, scale = int(m.group(1)), int(m.group(2))
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise ValueError(f"expected a decimal, got {value!r}")
    try:
        d = Decimal(str(value))
    except InvalidOperation as e:
        raise ValueError(f"{value!r} is not a decimal") from e
    if not d.is_finite():
        raise ValueError(f"{value!r} is not a finite decimal")
    too_big = ValueError(f"{value} does not fit in {t} (at most {precision - scale} digits "
                         f"before the point)")
    if d and d.adjusted() >= precision - scale:
        raise too_big
    with localcontext() as ctx:
        ctx.prec = 2 * precision + 2
        q = d.quantize(Decimal(1).scaleb(-scale), rounding=ROUND_HALF_UP)
    if q and q.adjusted() >= precision - scale:  # 999.995 -> 1000.00
        raise too_big
    return q


# a decimal inside a json column is written as a JSON number with every digit: json.dumps
# writes floats with float's repr, so the decimal travels as a marked string, unwrapped after
_DECIMAL_MARK = "\x00"
_DECIMAL_RE = re.compile(r'"\\u0000(-?[0-9]+(?:\.[0-9]+)?)\\u0000"')


def json_text(v: Any) -> str:
    """A record, array or map (or any value) as the JSON text of a jsonb column."""
    text = _DECIMAL_RE.sub(r"\1", json.dumps(jsonable(v), separators=(",", ":"),
                                             allow_nan=False, ensure_ascii=False))
    if "\\u0000" in text:
        raise ValueError("contains a NUL character (\\u0000), which PostgreSQL jsonb cannot "
                         "store")
    return text_value(text)


def jsonable(v: Any) -> Any:
    """A decoded Avro value as JSON: bytes/fixed as base64 (as Spark's to_json), decimals as
    numbers' text kept exact, dates, times and timestamps in ISO-8601, UUIDs as text."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, Decimal):  # a marker that `json_text` turns into a bare number
        return f"{_DECIMAL_MARK}{format(v, 'f')}{_DECIMAL_MARK}"
    if isinstance(v, (datetime, date, time)):
        return v.isoformat()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{v} cannot be stored in JSON")
    return v


def _coerce(value: Any, t: str) -> Any:
    """Check/convert one JSON value to the declared type; raise ValueError with why."""
    if value is None:
        return None
    if t == "string":
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return text_value(value)
    if t in ("long", "int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        limit = 2**63 if t == "long" else 2**31
        if not -limit <= value < limit:
            raise ValueError(f"{value} does not fit in {t}")
        return value
    if t in ("double", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            f = float(value)
        except OverflowError as e:
            raise ValueError(f"{value} overflows {t}") from e
        if t == "float":  # what float32 rounds it to: its largest value is not an overflow
            with np.errstate(over="ignore"):
                f = float(np.float32(f))
        if f in (float("inf"), float("-inf")):
            raise ValueError(f"{value} overflows {t}")
        return f
    if t == "boolean":
        if not isinstance(value, bool):
            raise ValueError(f"expected true/false, got {value!r}")
        return value
    if t == "json":  # any JSON value, nested or not, as the text of a jsonb column
        return json_text(value)
    if t == "timestamp":
        if isinstance(value, str):
            dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
            return dt if dt.tzinfo else dt.replace(tzinfo=UTC)
        raise ValueError(f"expected an ISO-8601 timestamp string, got {value!r}")
    if t == "date":
        if isinstance(value, str):
            return date.fromisoformat(value)
        raise ValueError(f"expected an ISO-8601 date string, got {value!r}")
    if DECIMAL_RE.match(t):
        return decimal_value(value, t)
    raise ValueError(f"unsupported type {t}")


def _no_constants(name: str) -> Any:
    raise ValueError(f"invalid JSON: {name} is not a JSON number")


class _TooDeep(ValueError):
    """Nested deeper than Python's recursive JSON parser goes."""


def _loads(value: bytes) -> Any:
    """json.loads that refuses what is not JSON (not UTF-8, NaN/Infinity). A record it
    refuses is tried alone through pyarrow's reader (`parse_json_record`), which skips
    NaN/Inf in undeclared fields and refuses them in declared ones (`_unfit_value`), as the
    fast path does."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"value is not UTF-8: {e.reason} at byte {e.start}") from e
    try:
        # numbers with a fraction or exponent as Decimal: every digit reaches a decimal
        # field, and a float field rounds once, from the text, as pyarrow does
        return json.loads(text, parse_constant=_no_constants, parse_float=Decimal)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} (character {e.pos})") from e
    except RecursionError as e:
        raise _TooDeep("JSON nested too deeply") from e


def _parse_deep(value: bytes, schema: Mapping[str, str]) -> dict[str, Any]:
    """A record too deep for Python's parser (or one it refuses) goes through pyarrow's
    (no recursion), alone, with the same checks as the fast path: both paths agree on it."""
    errors: list[str] = []
    res = parse_fast([value], arrow_schema(schema), errors, newlines=True)
    if res is None:
        raise ValueError(f"invalid JSON or a field that does not fit its type: "
                         f"{errors[0] if errors else 'refused by the JSON reader'}")
    table, bad, _ = res
    if bad:
        raise ValueError(bad[0].reason)
    return table.to_pylist()[0]  # type: ignore[no-any-return]


def parse_json_record(value: bytes | None, schema: Mapping[str, str]) -> dict[str, Any]:
    """Parse one record; raise ValueError naming the field and the problem."""
    if value is None:
        raise ValueError("value is null (tombstone)")
    try:
        doc = _loads(value)
    except _TooDeep:
        return _parse_deep(value, schema)
    except ValueError as e:
        # pyarrow's reader (the fast path) skips what Python refuses in a field the schema
        # does not declare (NaN, Inf): a record it takes alone, checked as there, is good
        # here too, so the answer never depends on which path a record's chunk takes
        try:
            return _parse_deep(value, schema)
        except ValueError:
            raise e from None
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    out: dict[str, Any] = {}
    for name, t in schema.items():
        try:
            out[name] = _coerce(doc.get(name), t)
        except (ValueError, OverflowError) as e:
            raise ValueError(f"field {name!r}: {e}") from e
    return out


def tombstone_fields(key: bytes | None, schema: Mapping[str, str]) -> dict[str, Any]:
    """The fields of a tombstone's row: from its key when the key is a JSON object with
    fields of the schema's names (each coerced, or null if it does not fit), else null."""
    out: dict[str, Any] = dict.fromkeys(schema)
    if key is None:
        return out
    try:
        doc = _loads(key)
    except ValueError:
        return out
    if isinstance(doc, dict):
        for name, t in schema.items():
            with contextlib.suppress(ValueError, OverflowError, TypeError):
                out[name] = _coerce(doc.get(name), t)
    return out


def deserialize_json(values: Sequence[bytes | None], schema: Mapping[str, str],
                     keys: Sequence[bytes | None] | None = None
                     ) -> tuple[pa.Table, list[BadRecord], list[int]]:
    """Parse a chunk. Returns the good rows' typed table, the bad records, and the chunk
    indices of the good rows (so raw columns can be aligned). Tombstones (null values) are
    good rows whose fields come from `keys` (see `tombstone_fields`)."""
    target = arrow_schema(schema)
    if None not in values:
        return _deserialize_values(values, schema, target)
    present = [i for i, v in enumerate(values) if v is not None]
    tombs = [i for i, v in enumerate(values) if v is None]
    table, bad, good = _deserialize_values([values[i] for i in present], schema, target)
    bad = [BadRecord(present[b.index], b.reason) for b in bad]
    good = [present[i] for i in good]
    rows = [tombstone_fields(keys[i] if keys is not None else None, schema) for i in tombs]
    tomb_table, tomb_bad = rows_to_table(rows, target)
    assert not tomb_bad  # coerced values always fit
    merged = pa.concat_tables([table, tomb_table])
    indices = good + tombs
    order = np.argsort(np.asarray(indices, dtype=np.int64), kind="stable")
    return merged.take(pa.array(order)), bad, sorted(indices)


def _deserialize_values(values: Sequence[bytes | None], schema: Mapping[str, str],
                        target: pa.Schema) -> tuple[pa.Table, list[BadRecord], list[int]]:
    """Fast path for the chunk; if it has a record the fast path cannot take, halve it
    and try again, so only pieces of `SLOW_PATH_ROWS` around such records are parsed in
    Python (both paths give the same result for every record)."""
    if values and "json" not in schema.values():  # a nested value: only Python keeps its text
        fast = parse_fast(values, target)
        if fast is not None:
            return fast
    if len(values) > SLOW_PATH_ROWS and "json" not in schema.values():
        mid = len(values) // 2
        t1, b1, g1 = _deserialize_values(values[:mid], schema, target)
        t2, b2, g2 = _deserialize_values(values[mid:], schema, target)
        return (pa.concat_tables([t1, t2]), b1 + [BadRecord(b.index + mid, b.reason) for b in b2],
                g1 + [g + mid for g in g2])
    rows: list[dict[str, Any]] = []
    good: list[int] = []
    bad: list[BadRecord] = []
    for i, v in enumerate(values):
        try:
            rows.append(parse_json_record(v, schema))
            good.append(i)
        except ValueError as e:
            bad.append(BadRecord(i, str(e)))
    table, refused = rows_to_table(rows, target)
    if refused:  # values the checks above let through but Arrow refuses: bad, not fatal
        bad = sorted(bad + [BadRecord(good[j], why) for j, why in refused],
                     key=lambda b: b.index)
        good = [g for j, g in enumerate(good) if j not in dict(refused)]
    return table, bad, good


def rows_to_table(rows: list[dict[str, Any]], target: pa.Schema
              ) -> tuple[pa.Table, list[tuple[int, str]]]:
    """Rows to a typed table. Should a value still not fit its Arrow type, that row (by
    position in `rows`) is returned as refused with Arrow's reason instead of raising."""
    try:
        cols = {name: pa.array([r[name] for r in rows], type=target.field(name).type)
                for name in target.names}
        return pa.table(cols, schema=target), []
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        pass
    refused: list[tuple[int, str]] = []
    for j, r in enumerate(rows):
        for name in target.names:
            try:
                pa.array([r[name]], type=target.field(name).type)
            except (pa.ArrowException, ValueError, TypeError, OverflowError) as e:
                refused.append((j, f"field {name!r}: {e}"))
                break
    bad = {j for j, _ in refused}
    table, _ = rows_to_table([r for j, r in enumerate(rows) if j not in bad], target)
    return table, refused
