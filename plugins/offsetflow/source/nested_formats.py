"""The typed (Arrow) form of a nested Protobuf or JSON Schema field, as `source.nested` gives
it for Avro: one mapping from the format's reader schema to an Arrow struct, list or map per
format; everything after it (the Iceberg column, parsing the staged JSON text into it, a
value that does not fit as a dead letter, fields added inside) is shared.

Protobuf (the registry's serialized FileDescriptorProto; the root message as schema
evolution reads it, `evolution.protobuf_root`): a message -> struct, `repeated` -> list, a
`map<k, v>` -> map; scalars as the top level maps them (int32/sint32/sfixed32 -> int32,
other integers -> int64, float/double, bool, string, an enum -> its name as string) and
bytes -> binary; `google.protobuf.Timestamp` -> timestamp(us, UTC), the wrappers
(`Int64Value`, ...) -> their scalar. Every field of a struct is optional: records are read
with their writer schema, and one that lacks a field has null there, as at top level (a
proto3 scalar without presence that its writer has reads as its default, `0` or `""`);
list elements and map values are never null in Protobuf, so they are required. A
recursive message, a group, another well-known type (Duration, Struct, Any, ...) or an
imported one has no form: the column stays JSON text.

JSON Schema: `type: object` with `properties` -> struct (a property in `required` whose
type does not allow null is a required field), `type: array` with `items` -> list, an
object with no properties and an `additionalProperties` schema -> map<string, T>; `integer`
-> int64, `number` -> float64, `boolean`, `string` (with `format: date-time` / `date` ->
timestamp(us, UTC) / date32, as at top level); `["T", "null"]`, or `oneOf`/`anyOf` of T and
null, is an optional T; local `$ref`s are followed. What has no single form (several
types, a `$ref` cycle or to another document, an object without properties, `allOf`,
tuple `items`) keeps its column JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from offsetflow.source.nested import avro_nested_types


class _NoForm(ValueError):
    """The schema has no nested Arrow form (the column stays JSON text)."""


def nested_types(format_type: str, reader_text: str, columns: Mapping[str, str]
                 ) -> dict[str, pa.DataType]:
    """Of the `json` columns of `columns` (name -> format.schema type), those whose field in
    the reader schema `reader_text` of `format_type` (avro, protobuf, json_schema) has a
    struct, list or map form: name -> that Arrow type. Other formats: none."""
    if format_type == "avro":
        return avro_nested_types(reader_text, columns)
    if format_type == "protobuf":
        return protobuf_nested_types(reader_text, columns)
    if format_type == "json_schema":
        return json_schema_nested_types(reader_text, columns)
    return {}


def _keep(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) or pa.types.is_list(t) or pa.types.is_map(t)


# --- Protobuf ------------------------------------------------------------------------------

# FieldDescriptorProto.Type -> Arrow type (the top-level mapping; bytes as binary)
_PROTO_SCALARS: dict[int, pa.DataType] = {
    1: pa.float64(), 2: pa.float32(), 3: pa.int64(), 4: pa.int64(), 5: pa.int32(),
    6: pa.int64(), 7: pa.int64(), 8: pa.bool_(), 9: pa.string(), 12: pa.binary(),
    13: pa.int64(), 14: pa.string(), 15: pa.int32(), 16: pa.int64(), 17: pa.int32(),
    18: pa.int64(),
}
_PROTO_WELL_KNOWN: dict[str, pa.DataType] = {
    "google.protobuf.Timestamp": pa.timestamp("us", tz="UTC"),
    "google.protobuf.DoubleValue": pa.float64(), "google.protobuf.FloatValue": pa.float32(),
    "google.protobuf.Int64Value": pa.int64(), "google.protobuf.UInt64Value": pa.int64(),
    "google.protobuf.Int32Value": pa.int32(), "google.protobuf.UInt32Value": pa.int64(),
    "google.protobuf.BoolValue": pa.bool_(), "google.protobuf.StringValue": pa.string(),
    "google.protobuf.BytesValue": pa.binary(),
}
_TYPE_MESSAGE, _TYPE_GROUP, _LABEL_REPEATED = 11, 10, 3


def protobuf_nested_types(serialized: str, columns: Mapping[str, str]
                          ) -> dict[str, pa.DataType]:
    """`nested_types` for a Protobuf reader schema (base64 FileDescriptorProto): the root
    message's message, repeated and map fields declared `json`."""
    from offsetflow.source.evolution import protobuf_root

    try:
        root_name = protobuf_root(serialized)
    except ValueError:
        return {}
    proto = _file(serialized)
    messages: dict[str, Any] = {}
    _index(proto.message_type, f".{proto.package}" if proto.package else "", messages)
    root = messages.get(f".{root_name}")
    if root is None:
        return {}
    out: dict[str, pa.DataType] = {}
    for f in root.field:
        if columns.get(f.name) != "json":
            continue
        try:
            t = _proto_field(f, messages, (f".{root_name}",))
        except _NoForm:
            continue
        if _keep(t):
            out[f.name] = t
    return out


def _file(serialized: str) -> Any:
    import base64

    from google.protobuf import descriptor_pb2

    return descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(serialized))


def _index(msgs: Any, prefix: str, out: dict[str, Any]) -> None:
    """Every message of the file (nested ones too) by its full name (`.pkg.Outer.Inner`)."""
    for m in msgs:
        name = f"{prefix}.{m.name}"
        out[name] = m
        _index(m.nested_type, name, out)


def _proto_field(f: Any, messages: Mapping[str, Any], seen: tuple[str, ...]) -> pa.DataType:
    """The Arrow type of field `f` (a repeated one: its list or map)."""
    if f.label == _LABEL_REPEATED:
        entry = messages.get(f.type_name) if f.type == _TYPE_MESSAGE else None
        if entry is not None and entry.options.map_entry:
            by_name = {x.name: x for x in entry.field}
            key = _proto_single(by_name["key"], messages, seen)
            if pa.types.is_boolean(key):
                key = pa.string()  # the JSON mapping's keys "true" / "false"
            value = _proto_single(by_name["value"], messages, seen)
            return pa.map_(key, pa.field("value", value, nullable=False))
        return pa.list_(pa.field("element", _proto_single(f, messages, seen),
                                 nullable=False))
    return _proto_single(f, messages, seen)


def _proto_single(f: Any, messages: Mapping[str, Any], seen: tuple[str, ...]
                  ) -> pa.DataType:
    if f.type in _PROTO_SCALARS:
        return _PROTO_SCALARS[f.type]
    if f.type == _TYPE_GROUP:
        raise _NoForm(f"group {f.name}")
    if f.type != _TYPE_MESSAGE:
        raise _NoForm(f"field type {f.type}")
    name = f.type_name.lstrip(".")
    if name in _PROTO_WELL_KNOWN:
        return _PROTO_WELL_KNOWN[name]
    msg = messages.get(f.type_name)
    if msg is None:  # another well-known type, or an imported message
        raise _NoForm(f"message {name}")
    if f.type_name in seen:
        raise _NoForm(f"recursive message {name}")
    fields = [pa.field(x.name, _proto_field(x, messages, (*seen, f.type_name)))
              for x in msg.field]
    if not fields:
        raise _NoForm(f"message {name} without fields")
    return pa.struct(fields)


# --- JSON Schema ---------------------------------------------------------------------------

def json_schema_nested_types(text: str, columns: Mapping[str, str]
                             ) -> dict[str, pa.DataType]:
    """`nested_types` for a JSON Schema reader schema: the root object's object and array
    properties declared `json`."""
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    props = doc.get("properties") if isinstance(doc, dict) else None
    if not isinstance(props, dict):
        return {}
    out: dict[str, pa.DataType] = {}
    for name, prop in props.items():
        if columns.get(str(name)) != "json":
            continue
        try:
            t, _ = _js(prop, doc, ())
        except _NoForm:
            continue
        if _keep(t):
            out[str(name)] = t
    return out


def _js(s: Any, root: Any, refs: tuple[str, ...]) -> tuple[pa.DataType, bool]:
    """(Arrow type, nullable) of JSON schema `s`; _NoForm when it has none."""
    if not isinstance(s, dict):
        raise _NoForm(f"schema {s!r}")
    if "$ref" in s:
        ref = s["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#") or ref in refs:
            raise _NoForm(f"$ref {ref!r}")
        return _js(_pointer(root, ref), root, (*refs, ref))
    if any(k in s for k in ("allOf", "not", "if", "prefixItems")):
        raise _NoForm("allOf / not / if / prefixItems")
    for k in ("oneOf", "anyOf"):
        if k in s:
            if "type" in s or not isinstance(s[k], list):
                raise _NoForm(k)
            rest = [x for x in s[k] if not (isinstance(x, dict) and x.get("type") == "null")]
            if len(rest) != 1:
                raise _NoForm(f"{k} of several types")
            t, nullable = _js(rest[0], root, refs)
            return t, nullable or len(rest) < len(s[k])
    kind = s.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    rest = [k for k in kinds if k != "null"]
    if len(rest) != 1 or not isinstance(rest[0], str):
        raise _NoForm(f"type {kind!r}")
    return _js_typed(rest[0], s, root, refs), len(rest) < len(kinds)


def _js_typed(kind: str, s: Mapping[str, Any], root: Any, refs: tuple[str, ...]
              ) -> pa.DataType:
    if kind == "object":
        props = s.get("properties")
        if isinstance(props, dict) and props:
            required = set(s.get("required") or [])
            fields = []
            for name, p in props.items():
                t, nullable = _js(p, root, refs)
                fields.append(pa.field(str(name), t, nullable=nullable
                                       or name not in required))
            return pa.struct(fields)
        extra = s.get("additionalProperties")
        if props is None and isinstance(extra, dict) and "patternProperties" not in s:
            t, nullable = _js(extra, root, refs)
            return pa.map_(pa.string(), pa.field("value", t, nullable=nullable))
        raise _NoForm("an object without properties")
    if kind == "array":
        items = s.get("items")
        if not isinstance(items, dict):
            raise _NoForm("an array without one items schema")
        t, nullable = _js(items, root, refs)
        return pa.list_(pa.field("element", t, nullable=nullable))
    if kind == "string":
        return {"date-time": pa.timestamp("us", tz="UTC"), "date": pa.date32()}.get(
            str(s.get("format")), pa.string())
    scalar = {"integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}.get(kind)
    if scalar is None:
        raise _NoForm(f"type {kind}")
    return scalar


def _pointer(root: Any, ref: str) -> Any:
    """The schema a local `$ref` (`#`, `#/definitions/X`, `#/$defs/X`) points at."""
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise _NoForm(f"$ref {ref!r} points at nothing")
        node = node[part]
    return node
