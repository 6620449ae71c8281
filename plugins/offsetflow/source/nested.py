"""The typed (Arrow) form of a nested Avro field: what a `json` column of format.schema
holds when its reader schema says what it is (a record, an array or a map, recursively),
so a sink that has nested types (Iceberg: struct, list, map) can store it as them instead
of as JSON text.

Pure logic from schema texts. The mapping inside a nested value is the top-level one
(docs/formats.md): int -> int32, long -> int64, float/double, boolean, string/enum/uuid
-> string, bytes/fixed -> binary, decimal(p,s) -> decimal128(p,s), date -> date32,
timestamp-millis/micros (and local-timestamp-*, taken as UTC) -> timestamp(us, UTC),
time-millis/micros -> time64(us); `["null", T]` is an optional T, a bare T a required one.
A field whose schema has no such form (a union of two non-null types, a recursive record,
a null) has no nested type: its column stays JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

_PRIMITIVE: dict[str, pa.DataType] = {
    "boolean": pa.bool_(), "int": pa.int32(), "long": pa.int64(), "float": pa.float32(),
    "double": pa.float64(), "string": pa.string(), "bytes": pa.binary(),
}
_LOGICAL: dict[str, pa.DataType] = {
    "date": pa.date32(), "timestamp-millis": pa.timestamp("us", tz="UTC"),
    "timestamp-micros": pa.timestamp("us", tz="UTC"),
    "local-timestamp-millis": pa.timestamp("us", tz="UTC"),
    "local-timestamp-micros": pa.timestamp("us", tz="UTC"),
    "time-millis": pa.time64("us"), "time-micros": pa.time64("us"), "uuid": pa.string(),
}
MAX_DECIMAL_PRECISION = 38  # Iceberg's (and decimal128's)


class _NoForm(ValueError):
    """The schema has no nested Arrow form (the column stays JSON text)."""


def avro_nested_types(reader_text: str, columns: Mapping[str, str]) -> dict[str, pa.DataType]:
    """Of the `json` columns of `columns` (name -> format.schema type), those whose field in
    the Avro reader schema `reader_text` is a record, array or map with a typed form: name
    -> its Arrow type (struct, list or map)."""
    doc = json.loads(reader_text)
    if not isinstance(doc, dict) or doc.get("type") != "record":
        return {}
    names: dict[str, Any] = {}
    _collect_names(doc, doc.get("namespace"), names)
    out: dict[str, pa.DataType] = {}
    for f in doc.get("fields") or []:
        name = str(f.get("name"))
        if columns.get(name) != "json":
            continue
        try:
            t, _ = _arrow(f.get("type"), names, ())
        except _NoForm:
            continue
        if pa.types.is_struct(t) or pa.types.is_list(t) or pa.types.is_map(t):
            out[name] = t
    return out


def common_nested_types(per_topic: Mapping[str, Mapping[str, pa.DataType]]
                        ) -> dict[str, pa.DataType]:
    """The nested types of the columns every topic's reader schema gives one: where two
    topics' differ only by fields one of them has (a topic whose producers moved to a
    version that adds a field inside a record first), their union (`merged_type`: such a
    field optional), so that the table's struct is checked and evolved against every
    field a record of the batch can carry; a column typed incompatibly (another scalar
    type, a record against a map), or that a topic's schema gives no nested form, stays
    JSON text."""
    maps = list(per_topic.values())
    if not maps:
        return {}
    out: dict[str, pa.DataType] = {}
    for name, first in maps[0].items():
        merged: pa.DataType | None = first
        for m in maps[1:]:
            other = m.get(name)
            merged = None if merged is None or other is None else merged_type(merged, other)
        if merged is not None:
            out[name] = merged
    return out


def merged_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The nested type whose values are those of `a` and of `b`: a struct with the fields
    of both (one only one has, or optional in either: optional), a list or map of the
    merged element or value; None when they disagree on anything else (a scalar type, the
    kind, two field names differing only in case)."""
    if a == b:
        return a
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        theirs = {b.field(i).name: b.field(i) for i in range(b.num_fields)}
        fields: list[pa.Field] = []
        for i in range(a.num_fields):
            f = a.field(i)
            g = theirs.pop(f.name, None)
            t = f.type if g is None else merged_type(f.type, g.type)
            if t is None:
                return None
            fields.append(pa.field(f.name, t, nullable=g is None or f.nullable or g.nullable))
        fields += [pa.field(g.name, g.type, nullable=True) for g in theirs.values()]
        if len({f.name.lower() for f in fields}) != len(fields):
            return None  # engines that resolve names without case could not tell them apart
        return pa.struct(fields)
    if pa.types.is_list(a) and pa.types.is_list(b):
        t = merged_type(a.value_type, b.value_type)
        return None if t is None else pa.list_(pa.field(
            a.value_field.name, t, nullable=a.value_field.nullable or b.value_field.nullable))
    if pa.types.is_map(a) and pa.types.is_map(b) and a.key_type == b.key_type:
        t = merged_type(a.item_type, b.item_type)
        return None if t is None else pa.map_(a.key_type, pa.field(
            a.item_field.name, t, nullable=a.item_field.nullable or b.item_field.nullable))
    return None


def _collect_names(t: Any, ns: str | None, out: dict[str, Any]) -> None:
    if isinstance(t, list):
        for x in t:
            _collect_names(x, ns, out)
        return
    if not isinstance(t, dict):
        return
    kind = t.get("type")
    if kind in ("record", "enum", "fixed", "error") and "name" in t:
        own = t.get("namespace", ns)
        name = str(t["name"])
        full = name if "." in name or not own else f"{own}.{name}"
        out[full] = t
        out.setdefault(name, t)
        ns = own
    for f in t.get("fields") or []:
        _collect_names(f.get("type"), ns, out)
    for k in ("items", "values"):
        if k in t:
            _collect_names(t[k], ns, out)
    if isinstance(kind, (dict, list)):
        _collect_names(kind, ns, out)


def _arrow(t: Any, names: Mapping[str, Any], seen: tuple[str, ...]
           ) -> tuple[pa.DataType, bool]:
    """(Arrow type, nullable) of Avro schema `t`; _NoForm when it has none."""
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        if len(rest) != 1:
            raise _NoForm("a union of more than one non-null type")
        inner, _ = _arrow(rest[0], names, seen)
        return inner, len(rest) < len(t)
    if isinstance(t, str):
        if t in _PRIMITIVE:
            return _PRIMITIVE[t], False
        if t in names:  # a named type used again (a record's recursion: below)
            return _arrow(names[t], names, seen)
        raise _NoForm(f"type {t}")
    if not isinstance(t, dict):
        raise _NoForm(f"schema {t!r}")
    logical = t.get("logicalType")
    kind = t.get("type")
    if logical == "decimal" and kind in ("bytes", "fixed"):
        p, s = int(t.get("precision", 0)), int(t.get("scale", 0))
        if not 0 < p <= MAX_DECIMAL_PRECISION or not 0 <= s <= p:
            raise _NoForm(f"decimal({p},{s})")
        return pa.decimal128(p, s), False
    if isinstance(logical, str) and logical in _LOGICAL:
        return _LOGICAL[logical], False
    if kind == "record":
        name = str(t.get("name", ""))
        if name and name in seen:
            raise _NoForm(f"recursive record {name}")
        fields = []
        for f in t.get("fields") or []:
            ft, nullable = _arrow(f.get("type"), names, (*seen, name))
            fields.append(pa.field(str(f["name"]), ft, nullable=nullable))
        if not fields:
            raise _NoForm("a record without fields")
        return pa.struct(fields), False
    if kind == "array":
        et, nullable = _arrow(t.get("items"), names, seen)
        return pa.list_(pa.field("element", et, nullable=nullable)), False
    if kind == "map":
        vt, nullable = _arrow(t.get("values"), names, seen)
        return pa.map_(pa.string(), pa.field("value", vt, nullable=nullable)), False
    if kind == "enum":
        return pa.string(), False
    if kind == "fixed":
        return pa.binary(), False
    if isinstance(kind, (str, list, dict)):
        return _arrow(kind, names, seen)
    raise _NoForm(f"schema {t!r}")
