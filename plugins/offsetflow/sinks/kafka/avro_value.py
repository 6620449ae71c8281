"""`sink.value_format: avro`: a record value in the Confluent wire format (magic byte 0, the
4-byte schema id, the Avro binary payload), re-encoded on the driver from the JSON text the
stage query builds (`form.select_sql`), one `AvroValueEncoder` per commit attempt.

Why from the JSON text: the stage query stays one query for every value format (the rows
are read once, in source order); the encoder is one call per record at the point where its
value bytes are produced. Why fastavro's `schemaless_writer` rather than confluent-kafka's
`AvroSerializer`: the serializer does the same fastavro call plus a subject lookup, a
context and a copy per record (measured: docs/sinks/kafka.md, "Avro values"), and the
sink needs the schema id pinned per batch, not whatever the serializer resolves.

The schema (`derive_schema`) follows the sink's columns: every field a union with null
(a staged column has no NOT NULL), numeric(p,s) an Avro decimal, timestamps
timestamp-micros (with time zone) or local-timestamp-micros, dates date, json/jsonb (Spark's
arrays, structs, maps) their JSON text as a string. A value that does not fit
(`ValueDoesNotFit`) is the record's problem: it is left out and routed like a record the
broker refuses, never the batch's.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

MAGIC = 0
_EPOCH_DATE = date(1970, 1, 1)
_NUMERIC = re.compile(r"^(?:numeric|decimal)\((\d+),\s*(\d+)\)$")
_NAME_BAD = re.compile(r"[^A-Za-z0-9_]")


class ValueDoesNotFit(ValueError):  # noqa: N818 - a record's verdict, not the batch's error
    """A staged value the Avro schema cannot hold (the reason names the field)."""


def record_name(topic: str) -> str:
    """An Avro record name from the output topic (Avro names: [A-Za-z_][A-Za-z0-9_]*)."""
    name = _NAME_BAD.sub("_", topic)
    return name if re.match(r"^[A-Za-z_]", name) else f"_{name}"


def avro_type(pg_type: str) -> Any:
    """The Avro type (without null) of a staged column's PostgreSQL type."""
    t = pg_type.lower()
    m = _NUMERIC.match(t)
    if m:
        return {"type": "bytes", "logicalType": "decimal", "precision": int(m.group(1)),
                "scale": int(m.group(2))}
    simple = {"bigint": "long", "int8": "long", "integer": "int", "int": "int", "int4": "int",
              "smallint": "int", "int2": "int", "boolean": "boolean", "bool": "boolean",
              "real": "float", "float4": "float", "double precision": "double",
              "float8": "double", "bytea": "bytes"}
    if t in simple:
        return simple[t]
    if t == "date":
        return {"type": "int", "logicalType": "date"}
    if t.startswith("timestamptz") or (t.startswith("timestamp") and "with time zone" in t
                                       and "without" not in t):
        return {"type": "long", "logicalType": "timestamp-micros"}
    if t.startswith("timestamp"):
        return {"type": "long", "logicalType": "local-timestamp-micros"}
    # text, varchar, unconstrained numeric (no precision for an Avro decimal), json/jsonb,
    # uuid and the rest: their text
    return "string"


def derive_schema(topic: str, columns: Mapping[str, str], fields: Sequence[str]
                  ) -> dict[str, Any]:
    """The value schema of `fields` (columns of the stage, in order), every one nullable."""
    return {"type": "record", "name": record_name(topic), "namespace": "offsetflow.sink",
            "fields": [{"name": c, "type": ["null", avro_type(columns[c])], "default": None}
                       for c in fields]}


def _branch(t: Any) -> Any:
    """The non-null branch of a nullable union (the type itself otherwise)."""
    if isinstance(t, list):
        rest = [b for b in t if b != "null"]
        return rest[0] if len(rest) == 1 else t
    return t


def _nullable(t: Any) -> bool:
    return t == "null" or (isinstance(t, list) and "null" in t)


def _to32(f: float) -> float:
    """`f` rounded to a 32-bit float as C does (infinity past its range; struct.pack
    refuses even the largest float's own shortest text, 3.4028235e+38)."""
    return float(ctypes.c_float(f).value)


def _shortest32(f: float) -> str:
    """The shortest decimal text that reads back as the 32-bit float `f`."""
    for digits in range(1, 10):
        text = f"{f:.{digits}g}"
        if _to32(float(text)) == f:
            return text
    return repr(f)


def _as_float(bits: int) -> Callable[[Any], float]:
    """A double (`bits` 64) or float (32) that holds the value as it is: a number it would
    round (a bigint past 2**53, a decimal's 17th digit, a double for a float) or overflow
    to infinity does not fit (its shortest text must read back as the same number)."""
    kind = "double" if bits == 64 else "float"

    def conv(v: Any) -> float:
        if isinstance(v, bool):
            raise ValueError("a boolean")
        if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity"):
            return float(v.replace("Infinity", "inf"))
        if not isinstance(v, (int, float, Decimal)):
            raise ValueError(f"{type(v).__name__} {v!r}")
        f = float(v)
        if bits == 32:
            f = _to32(f)
        shown = repr(f) if bits == 64 else _shortest32(f)
        if isinstance(v, int):  # a bigint: exactly, or not at all
            held = math.isfinite(f) and int(f) == v
        else:  # a fraction as staged: one of the float's shortest texts (several may be
            # as short at a power of two, and PostgreSQL may pick another than Python)
            digits = len((Decimal(repr(v)) if isinstance(v, float) else v
                          ).normalize().as_tuple().digits)
            held = math.isfinite(f) and digits <= len(
                Decimal(shown).normalize().as_tuple().digits)
        if not held:
            raise ValueError(f"{v} is not exactly an Avro {kind} (it would be written as "
                             f"{shown})")
        return f
    return conv


def _as_int(bits: int) -> Callable[[Any], int]:
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1

    def conv(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, Decimal)) or v != int(v):
            raise ValueError(f"{type(v).__name__} {v!r}")
        if not lo <= int(v) <= hi:
            raise ValueError(f"{v} is out of the range of a {bits}-bit integer")
        return int(v)
    return conv


def _as_decimal(precision: int, scale: int) -> Callable[[Any], Decimal]:
    def conv(v: Any) -> Decimal:
        if isinstance(v, bool) or not isinstance(v, (int, Decimal, str)):
            raise ValueError(f"{type(v).__name__} {v!r}")
        try:
            d = Decimal(v)
        except InvalidOperation:
            raise ValueError(f"{v!r} is not a number") from None
        if not d.is_finite():
            raise ValueError(f"{v} is not a finite number (an Avro decimal has no NaN or "
                             f"infinity)")
        try:
            q = d.quantize(Decimal(1).scaleb(-scale))
        except InvalidOperation:
            q = None
        if q is None or len(q.as_tuple().digits) > precision:
            raise ValueError(f"{v} does not fit decimal({precision},{scale})")
        if q != d:
            raise ValueError(f"{v} has more than {scale} decimal places")
        return q
    return conv


def _as_str(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, Decimal)):  # an unconstrained numeric: its digits as staged
        return format(v, "f") if isinstance(v, Decimal) else str(v)  # str: 1E-7
    # a nested value (json/jsonb): its compact JSON text
    return json_text(v)


def json_text(v: Any) -> str:
    """Compact JSON text of a nested value as `json.loads(parse_float=Decimal)` read it: a
    fraction keeps its digits as written (`1.10`, a double's 17th digit) and stays a
    number (json.dumps has no way to write a Decimal as one)."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{json_text(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(json_text(x) for x in v) + "]"
    if isinstance(v, Decimal):
        if not v.is_finite():
            raise ValueError(f"{v} is not a JSON number")
        return format(v, "f")
    return json.dumps(v)


def _as_bytes(v: Any) -> bytes:
    if isinstance(v, str) and v.startswith("\\x"):  # bytea as row_to_json writes it
        return bytes.fromhex(v[2:])
    raise ValueError(f"{type(v).__name__} {v!r}")


def _as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise ValueError(f"{type(v).__name__} {v!r}")


def _as_date(v: Any) -> int:
    if not isinstance(v, str):
        raise ValueError(f"{type(v).__name__} {v!r}")
    return (date.fromisoformat(v) - _EPOCH_DATE).days


def _millis(local: bool) -> Callable[[Any], int]:
    """timestamp-millis: a timestamp with sub-millisecond digits does not fit (it would be
    cut)."""
    micros = _micros(local)

    def conv(v: Any) -> int:
        us = micros(v)
        if us % 1000:
            raise ValueError(f"{v} has sub-millisecond digits a timestamp-millis cannot hold")
        return us // 1000
    return conv


def _of(kind: type, v: Any) -> Any:
    if not isinstance(v, kind):
        raise ValueError(f"{type(v).__name__} {v!r} (not a JSON {kind.__name__})")
    return v


def _record(fields: Sequence[Mapping[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """A nested record (an explicit schema's): each present field converted as its type
    (a missing one: fastavro writes its default or refuses)."""
    convs = [(str(f["name"]), _converter(f["type"])) for f in fields]

    def conv(v: Any) -> dict[str, Any]:
        row = _of(dict, v)
        return {name: c(row[name]) for name, c in convs if name in row}
    return conv


def _micros(local: bool) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if not isinstance(v, str):
            raise ValueError(f"{type(v).__name__} {v!r}")
        ts = datetime.fromisoformat(v)
        if ts.tzinfo is None:
            ts = ts.replace(tzinfo=UTC)  # local-timestamp: wall clock as if UTC
        elif local:
            ts = ts.replace(tzinfo=UTC)
        delta = ts - datetime(1970, 1, 1, tzinfo=UTC)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return conv


def _converter(t: Any) -> Callable[[Any], Any]:
    """How a JSON value (as `json.loads` with Decimal numbers reads it) becomes the datum
    fastavro writes for Avro type `t`; raises ValueError when it cannot (also inside an
    explicit schema's arrays, maps and records: fastavro itself would truncate a fraction
    into a long or write a long into an int)."""
    if _nullable(t) and t != "null":
        inner = _converter(_branch(t)) if _branch(t) is not t else None
        if inner is not None:
            return lambda v: None if v is None else inner(v)
    t = _branch(t)
    if isinstance(t, dict):
        logical, base = t.get("logicalType"), t.get("type")
        if logical == "decimal" and base == "bytes":
            return _as_decimal(int(t["precision"]), int(t.get("scale", 0)))
        if logical == "date":
            return _as_date
        if logical in ("timestamp-micros", "local-timestamp-micros"):
            return _micros(logical.startswith("local"))
        if logical in ("timestamp-millis", "local-timestamp-millis"):
            return _millis(logical.startswith("local"))
        if base == "array":
            items = _converter(t["items"])
            return lambda v: [items(x) for x in _of(list, v)]
        if base == "map":
            values = _converter(t["values"])
            return lambda v: {k: values(x) for k, x in _of(dict, v).items()}
        if base == "record":
            return _record(t.get("fields") or [])
        if isinstance(base, str) and base not in ("enum", "fixed"):
            return _converter(base)
        return lambda v: v  # an explicit schema's complex type: fastavro checks it
    return {"long": _as_int(64), "int": _as_int(32), "float": _as_float(32),
            "double": _as_float(64), "string": _as_str, "bytes": _as_bytes,
            "boolean": _as_bool}.get(t, lambda v: v) if isinstance(t, str) else (lambda v: v)


class AvroValueEncoder:
    """A staged row's JSON value -> Confluent wire-format Avro bytes with `schema_id`."""

    def __init__(self, schema: Mapping[str, Any], schema_id: int) -> None:
        from fastavro import parse_schema

        self.schema_id = schema_id
        self.parsed = parse_schema(dict(schema))
        self.header = struct.pack(">bI", MAGIC, schema_id)
        fields = schema.get("fields") or []
        self.fields = [(f["name"], _nullable(f["type"]), _converter(f["type"]))
                       for f in fields]

    def encode(self, value: str) -> bytes:
        """Raises ValueDoesNotFit naming the field and why."""
        from fastavro import schemaless_writer

        try:
            row = json.loads(value, parse_float=Decimal)
        except RecursionError:  # a nested value deeper than Python's JSON reader goes
            raise ValueDoesNotFit("the value is nested too deeply to re-encode") from None
        except ValueError as e:
            raise ValueDoesNotFit(f"the value is not a JSON object: {e}") from None
        if not isinstance(row, dict):
            raise ValueDoesNotFit("the value is not a JSON object")
        datum: dict[str, Any] = {}
        for name, nullable, conv in self.fields:
            v = row.get(name)
            if v is None:
                if not nullable:
                    raise ValueDoesNotFit(f"field {name!r} is null (or missing), and the "
                                          f"schema's field is not nullable")
                datum[name] = None
                continue
            try:
                datum[name] = conv(v)
            except RecursionError:
                raise ValueDoesNotFit(f"field {name!r} is nested too deeply to re-encode"
                                      ) from None
            except (ValueError, TypeError, OverflowError) as e:
                raise ValueDoesNotFit(f"field {name!r}: {e}") from None
        buf = io.BytesIO()
        buf.write(self.header)
        try:
            schemaless_writer(buf, self.parsed, datum)
        except (ValueError, TypeError, OverflowError, KeyError, AttributeError,
                RecursionError, struct.error) as e:
            raise ValueDoesNotFit(f"fastavro refused the record: {type(e).__name__}: {e}"
                                  ) from None
        return buf.getvalue()

