"""Deserializers: Kafka values (bytes) to typed Arrow columns, with a reason for every bad one.

Fast path: pyarrow's C++ JSON reader over a chunk of newline-delimited values with the
declared schema. If the chunk has any bad record, the slow path parses record by record in
Python to say exactly which offsets are bad and why. Nothing is dropped silently: every
input record comes out either as a good row or as a `BadRecord`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import pyarrow as pa
import pyarrow.json as pajson

from offsetflow.config import DECIMAL_RE


@dataclass(frozen=True)
class BadRecord:
    index: int  # position in the chunk
    reason: str


def arrow_type(t: str) -> pa.DataType:
    m = DECIMAL_RE.match(t)
    if m:
        return pa.decimal128(int(m.group(1)), int(m.group(2)))
    return {
        "string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
        "float": pa.float32(), "boolean": pa.bool_(), "timestamp": pa.timestamp("us", tz="UTC"),
        "date": pa.date32(),
    }[t]


def arrow_schema(schema: Mapping[str, str]) -> pa.Schema:
    return pa.schema([pa.field(name, arrow_type(t)) for name, t in schema.items()])


def _coerce(value: Any, t: str) -> Any:
    """Check/convert one JSON value to the declared type; raise ValueError with why."""
    if value is None:
        return None
    if t == "string":
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return value
    if t in ("long", "int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        limit = 2**63 if t == "long" else 2**31
        if not -limit <= value < limit:
            raise ValueError(f"{value} does not fit in {t}")
        return value
    if t in ("double", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if t == "boolean":
        if not isinstance(value, bool):
            raise ValueError(f"expected true/false, got {value!r}")
        return value
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
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a decimal, got {value!r}")
        try:
            return Decimal(str(value))
        except InvalidOperation as e:
            raise ValueError(f"{value!r} is not a decimal") from e
    raise ValueError(f"unsupported type {t}")


def parse_json_record(value: bytes | None, schema: Mapping[str, str]) -> dict[str, Any]:
    """Parse one record; raise ValueError naming the field and the problem."""
    if value is None:
        raise ValueError("value is null (tombstone); a JSON pipeline needs a JSON object")
    try:
        doc = json.loads(value)
    except UnicodeDecodeError as e:
        raise ValueError(f"value is not UTF-8: {e.reason}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} (character {e.pos})") from e
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    out: dict[str, Any] = {}
    for name, t in schema.items():
        try:
            out[name] = _coerce(doc.get(name), t)
        except ValueError as e:
            raise ValueError(f"field {name!r}: {e}") from e
    return out


def deserialize_json(values: Sequence[bytes | None], schema: Mapping[str, str]
                     ) -> tuple[pa.Table, list[BadRecord], list[int]]:
    """Parse a chunk. Returns the good rows' typed table, the bad records, and the chunk
    indices of the good rows (so raw columns can be aligned)."""
    target = arrow_schema(schema)
    # pyarrow's JSON reader does not parse dates: read them as strings and cast after.
    read_schema = pa.schema([pa.field(f.name, pa.string()) if pa.types.is_date(f.type) else f
                             for f in target])
    fast_ok = all(v is not None and b"\n" not in v and b"\r" not in v for v in values)
    if fast_ok and values:
        try:
            buf = b"\n".join(values)  # type: ignore[arg-type]
            table = pajson.read_json(
                io.BytesIO(buf),
                read_options=pajson.ReadOptions(use_threads=False, block_size=max(1 << 20,
                                                                                 len(buf) + 1)),
                parse_options=pajson.ParseOptions(explicit_schema=read_schema,
                                                  unexpected_field_behavior="ignore",
                                                  newlines_in_values=False))
            if table.num_rows == len(values):
                table = table.select(target.names).cast(target)
                if table.schema.equals(target):
                    return table, [], list(range(len(values)))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            pass
    rows: list[dict[str, Any]] = []
    good: list[int] = []
    bad: list[BadRecord] = []
    for i, v in enumerate(values):
        try:
            rows.append(parse_json_record(v, schema))
            good.append(i)
        except ValueError as e:
            bad.append(BadRecord(i, str(e)))
    cols = {name: pa.array([r[name] for r in rows], type=target.field(name).type)
            for name in target.names}
    return pa.table(cols, schema=target), bad, good
