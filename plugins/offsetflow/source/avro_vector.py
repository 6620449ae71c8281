"""A chunk of Avro records decoded column-wise with numpy, no Python call per record.

For the common shape of a topic, a flat record of primitives (`int`, `long`, `float`,
`double`, `boolean`, `string`, `bytes`, `null`, each possibly `["null", T]`; `date` and
`timestamp-millis/micros` logical types) in one writer schema per chunk read as written:
every record's position in the joined chunk advances field by field for all records at
once (zig-zag varints, fixed-width floats, length-prefixed strings gathered into one Arrow
buffer). Whatever it cannot take exactly as fastavro + `avro_value` would (a varint past 10
bytes, a position past its record's end, bytes left over, invalid UTF-8, a boolean byte
other than 0/1, a union index out of range, a value out of its column's range, a field
type it does not handle) makes it return None: the chunk is then decoded record by record,
which names each bad record. `tests/unit/source/test_avro_vector.py` holds both to the
same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offsetflow.source.avro_fast import Resolution

_PRIMITIVES = {"int", "long", "float", "double", "boolean", "string", "bytes", "null"}
_LOGICAL = {("long", "timestamp-millis"), ("long", "timestamp-micros"),
            ("long", "local-timestamp-millis"), ("long", "local-timestamp-micros"),
            ("int", "date"), ("string", "uuid")}
_UUID = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"  # str(UUID)
# years 1-9999 as Python's datetime holds them (fastavro's logical readers raise outside)
_MIN_US, _MAX_US = -62_135_596_800_000_000, 253_402_300_799_999_999
_MIN_DAY, _MAX_DAY = -719_162, 2_932_896


@dataclass(frozen=True)
class _Field:
    name: str
    kind: str  # one of _PRIMITIVES, or enum
    logical: str | None
    nullable: int  # -1: not a union; else the branch index of null in ["null", T]
    symbols: tuple[str, ...] = ()  # an enum's
    precision: int = 0  # a decimal's
    scale: int = 0


@dataclass(frozen=True)
class Layout:
    """A writer schema's top-level fields, in order, as the vectorised reader decodes them."""

    fields: tuple[_Field, ...]


def layout_of(schema: Any) -> Layout | None:
    """The layout of a parsed-from-JSON writer schema, or None when it is not a record of
    fields this reader handles."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        return None
    out = []
    for f in schema.get("fields") or []:
        t = f.get("type")
        nullable = -1
        if isinstance(t, list):
            if len(t) != 2 or "null" not in t:
                return None
            nullable = t.index("null")
            t = t[1 - nullable]
        logical = None
        if isinstance(t, dict) and t.get("type") == "enum" and isinstance(t.get("symbols"), list) \
                and not set(t) - {"type", "name", "namespace", "symbols", "doc", "aliases",
                                  "default"}:
            out.append(_Field(str(f["name"]), "enum", None, nullable,
                              tuple(str(x) for x in t["symbols"])))
            continue
        if isinstance(t, dict) and t.get("type") == "bytes" \
                and t.get("logicalType") == "decimal" \
                and not set(t) - {"type", "logicalType", "precision", "scale"} \
                and isinstance(t.get("precision"), int) and isinstance(t.get("scale", 0), int):
            out.append(_Field(str(f["name"]), "bytes", "decimal", nullable,
                              precision=t["precision"], scale=t.get("scale", 0)))
            continue
        if isinstance(t, dict):
            logical = t.get("logicalType")
            if set(t) - {"type", "logicalType"} or (t.get("type"), logical) not in _LOGICAL:
                return None
            t = t["type"]
        if not isinstance(t, str) or t not in _PRIMITIVES or (t == "null" and nullable >= 0):
            return None
        out.append(_Field(str(f["name"]), t, logical, nullable))
    return Layout(tuple(out))


class _Refused(Exception):
    """The chunk needs the record-by-record path."""


def decode_chunk(values: Sequence[bytes], layout: Layout, schema: Mapping[str, str],
                 target: pa.Schema, resolution: Resolution,
                 convert: Callable[[Any, str], Any]) -> pa.Table | None:
    """The declared columns of Confluent-framed `values` (all of `layout`'s writer,
    resolved to the reader schema by `resolution`), or None: the record-by-record path
    decides. `convert`: `avro_value`, for a reader default's column."""
    cols = _plan_columns(layout, schema, resolution)
    if cols is None:
        return None
    try:
        consts = {name: convert(resolution.defaults[name], t) for name, t in schema.items()
                  if name in resolution.defaults}
        return _decode(values, layout, schema, target, cols, consts)
    except (_Refused, ValueError, TypeError, OverflowError, pa.ArrowException):
        return None


def _plan_columns(layout: Layout, schema: Mapping[str, str], resolution: Resolution
                  ) -> dict[str, _Field] | None:
    """declared column -> the writer field it takes (a column the reader record lacks is
    NULL, one the reader's default fills is that value); None when a declared type and its
    field's type convert in a way not done here."""
    by_name = {f.name: f for f in layout.fields if f.name not in resolution.drop}
    out = {}
    for name, t in schema.items():
        f = by_name.get(name)
        if f is None or name in resolution.defaults:
            continue
        promoted = resolution.promote.get(name, f.kind)
        ok = {"long": ("int", "long"), "int": ("int", "long"),
              "double": ("int", "long", "float", "double"), "float": ("float",),
              "boolean": ("boolean",), "string": ("string",)}.get(t)
        # int -> long keeps the value; one to float/double is float(v): only a double
        # column takes that as it is
        takes = (ok is not None and f.kind in ok and promoted in ok and f.logical is None
                 and (promoted in (f.kind, "long") or t == "double")) \
            or (t == "timestamp" and f.kind == "long" and "timestamp" in (f.logical or "")) \
            or (t == "date" and f.logical == "date") or f.kind == "null" \
            or (t == "string" and f.kind == "enum") \
            or (t.startswith("decimal(") and f.logical == "decimal"
                and t.endswith(f",{f.scale})") and name not in resolution.promote) \
            or (t in ("string", "uuid") and f.kind == "string" and f.logical == "uuid")
        if not takes:
            return None
        out[name] = f
    return out


def _decode(values: Sequence[bytes], layout: Layout, schema: Mapping[str, str],
            target: pa.Schema, cols: dict[str, _Field], consts: dict[str, Any]) -> pa.Table:
    n = len(values)
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=n)
    ends = np.cumsum(lengths)
    pos = ends - lengths + 5  # after each record's header
    data = np.frombuffer(b"".join(values) + bytes(16), dtype=np.uint8)
    got: dict[str, tuple[Any, np.ndarray | None]] = {}  # field -> (values, valid mask)
    for f in layout.fields:
        valid: np.ndarray | None = None
        at = pos
        if f.nullable >= 0:
            branch, pos = _varint(data, pos, ends)
            if np.any((branch != 0) & (branch != 1)):
                raise _Refused
            valid = branch != f.nullable
            at = pos[valid]
        vals, after = _read(data, at, ends if valid is None else ends[valid], f.kind)
        if valid is None:
            pos = after
        else:
            pos = pos.copy()
            pos[valid] = after
        if f.name in cols:
            got[f.name] = (vals, valid)
        else:  # fastavro decodes every field: what it refuses in one is a bad record too
            _check_unused(vals, f)
    if not np.array_equal(pos, ends):
        raise _Refused  # bytes left over, or read past a record's end
    arrays = []
    for name, t in schema.items():
        at_type = target.field(name).type
        if name in consts:
            arrays.append(pa.array([consts[name]] * n, at_type))
            continue
        if name not in got or cols[name].kind == "null":
            arrays.append(pa.nulls(n, at_type))
            continue
        vals, valid = got[name]
        arrays.append(_column(vals, valid, n, t, cols[name], at_type))
    return pa.Table.from_arrays(arrays, schema=target)


def _varint(data: np.ndarray, pos: np.ndarray, ends: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """Zig-zag varints at `pos` (int64) and the positions after them."""
    acc = np.zeros(len(pos), dtype=np.uint64)
    cur = pos.copy()
    live = np.ones(len(pos), dtype=bool)
    for k in range(10):
        if np.any(cur[live] >= ends[live]):
            raise _Refused  # the record ends inside the varint
        b = data[cur[live]].astype(np.uint64)
        if k == 9 and np.any(b > 1):
            raise _Refused  # beyond 64 bits
        acc[live] |= (b & np.uint64(0x7F)) << np.uint64(7 * k)
        cur[live] += 1
        more = (b & np.uint64(0x80)) != 0
        idx = np.flatnonzero(live)
        live[idx[~more]] = False
        if not live.any():
            break
    if live.any():
        raise _Refused
    value = (acc >> np.uint64(1)).astype(np.int64) ^ -(acc & np.uint64(1)).astype(np.int64)
    return value, cur


def _read(data: np.ndarray, pos: np.ndarray, ends: np.ndarray, kind: str
          ) -> tuple[Any, np.ndarray]:
    if kind in ("int", "long", "enum"):
        return _varint(data, pos, ends)
    if kind == "null":
        return None, pos
    if kind in ("float", "double", "boolean"):
        width = {"float": 4, "double": 8, "boolean": 1}[kind]
        if np.any(pos + width > ends):
            raise _Refused
        raw = data[pos[:, None] + np.arange(width)]
        if kind == "boolean":
            if np.any(raw > 1):
                raise _Refused
            return raw[:, 0].astype(bool), pos + 1
        dtype = np.dtype("<f4") if kind == "float" else np.dtype("<f8")
        return raw.reshape(-1).view(dtype).astype(np.float64), pos + width
    # string, bytes: a length, then that many bytes
    size, start = _varint(data, pos, ends)
    if np.any(size < 0) or np.any(start + size > ends):
        raise _Refused
    offsets = np.zeros(len(pos) + 1, dtype=np.int64)
    np.cumsum(size, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise _Refused
    idx = np.repeat(start - offsets[:-1], size) + np.arange(offsets[-1])
    return (offsets.astype(np.int32), data[idx]), start + size


def _column(vals: Any, valid: np.ndarray | None, n: int, t: str, f: _Field,
            at: pa.DataType) -> pa.Array:
    mask = None if valid is None else ~valid  # pyarrow: True = null
    if f.logical == "decimal":
        return _decimals(vals, valid, n, f, at)
    if f.kind == "string":
        offsets, raw = vals
        if valid is not None:  # nulls take no bytes: their offsets repeat
            full = np.zeros(n + 1, dtype=np.int32)
            full[1:][valid] = np.diff(offsets)
            offsets = np.cumsum(full, dtype=np.int32)
        arr = pa.StringArray.from_buffers(
            n, pa.py_buffer(offsets.tobytes()), pa.py_buffer(raw.tobytes()),
            None if mask is None else pa.array(valid).buffers()[1])
        try:
            arr.validate(full=True)  # invalid UTF-8: fastavro's decode refuses it
        except pa.ArrowInvalid:
            raise _Refused from None
        if pc.any(pc.match_substring(arr, "\x00")).as_py():
            raise _Refused  # NUL: the record-by-record path names it
        if f.logical == "uuid" and not pc.all(pc.match_substring_regex(arr, _UUID)).as_py():
            raise _Refused  # not as str(UUID(...)) writes it: fastavro + avro_value decide
        return arr
    full_vals = vals
    if valid is not None:
        full_vals = np.zeros(n, dtype=vals.dtype)
        full_vals[valid] = vals
    live = full_vals if valid is None else full_vals[valid]
    if f.kind == "enum":
        if len(live) and (live.min() < 0 or live.max() >= len(f.symbols)):
            raise _Refused
        return pa.array(f.symbols, at).take(pa.array(full_vals, pa.int64(), mask=mask))
    if t == "int" and len(live) and (live.min() < -2**31 or live.max() >= 2**31):
        raise _Refused
    if t == "timestamp":
        us = full_vals * 1000 if "millis" in (f.logical or "") else full_vals
        if "millis" in (f.logical or "") and len(live) and (
                live.min() < _MIN_US // 1000 or live.max() > _MAX_US // 1000):
            raise _Refused
        if len(live) and ((us if valid is None else us[valid]).min() < _MIN_US
                          or (us if valid is None else us[valid]).max() > _MAX_US):
            raise _Refused
        return pa.array(us, pa.int64(), mask=mask).cast(at)
    if t == "date":
        if len(live) and (live.min() < _MIN_DAY or live.max() > _MAX_DAY):
            raise _Refused
        return pa.array(full_vals.astype(np.int32), pa.int32(), mask=mask).cast(at)
    if t == "float":
        return pa.array(full_vals.astype(np.float32), at, mask=mask)
    if t == "double" and f.kind in ("int", "long"):
        return pa.array(full_vals.astype(np.float64), at, mask=mask)
    return pa.array(full_vals, at, mask=mask)


def _decimals(vals: Any, valid: np.ndarray | None, n: int, f: _Field, at: pa.DataType
              ) -> pa.Array:
    """Big-endian two's complement unscaled values (Avro's bytes decimal, at the declared
    scale) as Arrow decimal128: each sign-extended into 16 little-endian bytes. Refused:
    more than 16 bytes, -2**127 (Arrow's validate passes it at any precision), more
    digits than the writer's precision (fastavro would round) or the column's (a dead
    letter)."""
    offsets, raw = vals
    sizes = np.diff(offsets).astype(np.int64)
    m = len(sizes)
    if np.any(sizes > 16):
        raise _Refused
    out = np.zeros((m, 16), dtype=np.uint8)
    if len(raw):
        first = raw[np.minimum(offsets[:-1], len(raw) - 1)]
        out[(sizes > 0) & (first >= 0x80)] = 0xFF
        rows = np.repeat(np.arange(m), sizes)
        j = np.arange(len(raw)) - np.repeat(offsets[:-1].astype(np.int64), sizes)
        out[rows, np.repeat(sizes, sizes) - 1 - j] = raw
    # -2**127: Arrow's precision check takes its absolute value, which overflows int128
    # to itself (negative), so validate() passes it for every precision (pyarrow 26)
    if np.any((out[:, 15] == 0x80) & ~out[:, :15].any(axis=1)):
        raise _Refused
    full = out
    validity = None
    if valid is not None:
        full = np.zeros((n, 16), dtype=np.uint8)
        full[valid] = out
        validity = pa.array(valid).buffers()[1]
    checks = [at] + ([pa.decimal128(f.precision, f.scale)]
                     if 0 < f.precision < at.precision else [])
    if f.precision <= 0:
        raise _Refused
    arr = None
    for typ in checks:
        a = pa.Array.from_buffers(typ, n, [validity, pa.py_buffer(full.tobytes())])
        try:
            a.validate(full=True)
        except pa.ArrowInvalid:
            raise _Refused from None
        arr = arr if arr is not None else a
    return arr


def _check_unused(vals: Any, f: _Field) -> None:
    """Refuse what fastavro refuses in a field no column takes: invalid UTF-8, a uuid it
    might not read, a date or timestamp outside years 1-9999, an enum index out of range."""
    if f.kind == "string":
        offsets, raw = vals
        arr = pa.StringArray.from_buffers(len(offsets) - 1, pa.py_buffer(offsets.tobytes()),
                                          pa.py_buffer(raw.tobytes()))
        try:
            arr.validate(full=True)
        except pa.ArrowInvalid:
            raise _Refused from None
        if f.logical == "uuid" and not pc.all(pc.match_substring_regex(arr, _UUID)).as_py():
            raise _Refused
        return
    if vals is None or f.kind == "bytes" or not len(vals):
        return
    if f.kind == "enum":
        bad = vals.min() < 0 or vals.max() >= len(f.symbols)
    elif f.logical == "date":
        bad = vals.min() < _MIN_DAY or vals.max() > _MAX_DAY
    elif f.logical and "millis" in f.logical:
        bad = vals.min() < _MIN_US // 1000 or vals.max() > _MAX_US // 1000
    elif f.logical and "micros" in f.logical:
        bad = vals.min() < _MIN_US or vals.max() > _MAX_US
    else:
        bad = False
    if bad:
        raise _Refused
