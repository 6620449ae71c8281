"""Schema evolution under `format.schema_evolution` (pure logic: no registry, no database),
for Avro, Protobuf and JSON Schema (`schema_type`: the registry's AVRO | PROTOBUF | JSON).
Two questions, answered from schema texts:

- which columns a reader schema adds to `format.schema` (`evolved_columns`): its top-level
  fields that are not declared, typed as the Avro type mapping says (docs/formats.md);
- whether a batch's schemas may follow one another (`incompatibilities`): in the order the
  registry gave them ids, each schema must read the data of the one before (a field it adds
  has a default; a type it changes is a widening Avro promotes) and keep what the one
  before required (a field without a default is not removed). A batch holding a change
  that breaks this stops before anything is written (`SchemaEvolutionError`).

Why the reader schema decides the columns: every record of a run is decoded with it (Avro
resolution fills the defaults of fields its writer lacks), so the columns are known on the
driver before any task reads, the stage tables have them, and the commit adds them to the
target in its own transaction. Protobuf and JSON Schema records are read with their writer
schema (there is no resolution), so the subject's latest version (the run's reader, pinned
as for Avro) decides the columns, and a record whose schema lacks a field has NULL there.

What each format calls compatible (a reader of the newer schema still reads the older
one's data into the same columns):
- Protobuf: fields are matched by name (as the columns are); a field added or removed is
  compatible (proto3 has no required fields) unless proto2 `required`; a changed field
  number, or a type changed other than wire-compatibly wider (int32 -> int64, uint32 ->
  uint64/int64, sint32 -> sint64), is not. The message is the file's first top-level
  message no other message of the file uses as a field type (its "root").
- JSON Schema: a property added is compatible unless `required`; a `required` one removed
  is not; a type changed other than integer -> number, or null no longer allowed, is not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# primitive Avro types -> format.schema type
_PRIMITIVE = {"boolean": "boolean", "int": "int", "long": "long", "float": "float",
              "double": "double", "string": "string", "enum": "string"}
_LOGICAL = {"date": "date", "timestamp-millis": "timestamp", "timestamp-micros": "timestamp",
            "local-timestamp-millis": "timestamp", "local-timestamp-micros": "timestamp",
            "uuid": "uuid"}
# Avro's promotions (the spec's schema resolution): writer type -> reader types it may be
# read as; and the same among the column types the evolution adds
_PROMOTES = {"int": {"long", "float", "double"}, "long": {"float", "double"},
             "float": {"double"}, "string": {"bytes"}, "bytes": {"string"}}
NO_DEFAULT = object()
# Protobuf: wire-compatible changes that widen the column (varints of the same encoding)
_PROTO_PROMOTES = {"int32": {"int64"}, "uint32": {"uint64", "int64"}, "sint32": {"sint64"}}
# JSON Schema: an integer is a number
_JSON_PROMOTES = {"integer": {"number"}}
# FieldDescriptorProto.Type -> (base name, format.schema type)
_PROTO_TYPES = {1: ("double", "double"), 2: ("float", "float"), 3: ("int64", "long"),
                4: ("uint64", "long"), 5: ("int32", "int"), 6: ("fixed64", "long"),
                7: ("fixed32", "long"), 8: ("bool", "boolean"), 9: ("string", "string"),
                10: ("group", "json"), 12: ("bytes", "json"), 13: ("uint32", "long"),
                14: ("enum", "string"), 15: ("sfixed32", "int"), 16: ("sfixed64", "long"),
                17: ("sint32", "int"), 18: ("sint64", "long")}


@dataclass(frozen=True)
class Field:
    """One top-level field of a record schema: its base type (a union with null stripped),
    whether null is allowed, whether it has a default, and its column type."""

    name: str
    base: str  # primitive name, logical type name, or record/array/map/fixed/union
    nullable: bool
    has_default: bool
    column: str  # format.schema type of the column it lands in
    number: int | None = None  # Protobuf: the field number (records carry it, not the name)


def schema_fields(schema_text: str, schema_type: str = "AVRO") -> dict[str, Field]:
    """The top-level fields of a record schema (its text, as the registry holds it: for
    Protobuf the base64 FileDescriptorProto of `?format=serialized`); ValueError when it
    is not a record."""
    if schema_type == "PROTOBUF":
        return protobuf_fields(schema_text)
    if schema_type == "JSON":
        return json_schema_fields(schema_text)
    doc = json.loads(schema_text)
    if not isinstance(doc, dict) or doc.get("type") != "record":
        raise ValueError("the schema is not a record: format.schema names fields of a record")
    out: dict[str, Field] = {}
    for f in doc.get("fields") or []:
        base, nullable = _base(f.get("type"))
        out[str(f["name"])] = Field(str(f["name"]), base, nullable, "default" in f,
                                    _column(f.get("type")))
    return out


def _base(t: Any) -> tuple[str, bool]:
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        nullable = len(rest) < len(t)
        if len(rest) == 1:
            return _base(rest[0])[0], nullable
        return "union", nullable
    if isinstance(t, dict):
        logical = t.get("logicalType")
        if logical == "decimal":
            return f"decimal({t.get('precision')},{t.get('scale', 0)})", False
        if logical in _LOGICAL:
            return str(logical), False
        return _base(t.get("type"))[0] if t.get("type") in _PRIMITIVE or t.get(
            "type") in ("bytes", "null") else str(t.get("type")), False
    return str(t), False


def _column(t: Any) -> str:
    """The format.schema type of a field's column (the Avro type mapping of formats.md)."""
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        return _column(rest[0]) if len(rest) == 1 else "json"
    if isinstance(t, dict):
        logical = t.get("logicalType")
        if logical == "decimal":
            return f"decimal({t.get('precision')},{t.get('scale', 0)})"
        if logical in _LOGICAL:
            return _LOGICAL[str(logical)]
        inner = t.get("type")
        if inner == "enum":
            return "string"
        if isinstance(inner, str) and inner in _PRIMITIVE:
            return _PRIMITIVE[inner]
        return "json"  # record, array, map, fixed, bytes, time-*
    if isinstance(t, str) and t in _PRIMITIVE:
        return _PRIMITIVE[t]
    return "json"


def evolved_columns(readers: Mapping[str, str | None], declared: Mapping[str, str],
                    reserved: Iterable[str], schema_type: str = "AVRO") -> dict[str, str]:
    """Columns the reader schemas (topic -> schema text; None: the topic's subject has
    none) add to `declared`: their top-level fields no column has yet, in field order.
    ValueError names a field two topics' schemas type differently, or one that collides
    with a source column."""
    out: dict[str, str] = {}
    taken = set(reserved)
    for topic, text in sorted(readers.items()):
        if text is None:
            continue
        for name, f in schema_fields(text, schema_type).items():
            if name in declared:
                continue
            if name in taken:
                raise ValueError(f"topic {topic}: field {name!r} of the reader schema has the "
                                 f"name of a source column; it cannot become a column")
            if name in out and out[name] != f.column:
                raise ValueError(f"field {name!r} is {out[name]} in one topic's reader schema "
                                 f"and {f.column} in topic {topic}'s")
            out[name] = f.column
    return out


def _widens(old: str, new: str, schema_type: str = "AVRO") -> bool:
    promotes = {"PROTOBUF": _PROTO_PROMOTES, "JSON": _JSON_PROMOTES}.get(schema_type, _PROMOTES)
    return old == new or new in promotes.get(old, set())


def incompatibilities(old_text: str, new_text: str, schema_type: str = "AVRO") -> list[str]:
    """Why data of the older schema cannot be read as the newer one, or the newer drops
    what the older required: a field added without a default, a field removed that had no
    default, a type narrowed (not an Avro promotion), null no longer allowed."""
    old = schema_fields(old_text, schema_type)
    new = schema_fields(new_text, schema_type)
    out = unreadable(old_text, new_text, schema_type)
    for name, o in old.items():
        if name not in new and not o.has_default:
            out.append(f"required field {name!r} removed")
    return out


def unreadable(writer_text: str, reader_text: str, schema_type: str = "AVRO") -> list[str]:
    """Why records written with one schema cannot be read as another (Avro resolution
    fails for them; a Protobuf or JSON Schema record's value does not fit the reader's
    column): a field the reader adds without a default, a type it narrows, null no longer
    allowed. Checked per pair, not along the chain of versions: a field removed and
    re-added with another type passes every step and still breaks the first writer."""
    old = schema_fields(writer_text, schema_type)
    new = schema_fields(reader_text, schema_type)
    added = {"JSON": "added as required", "PROTOBUF": "added as required"}.get(
        schema_type, "added without a default")
    out = []
    if schema_type == "PROTOBUF" and protobuf_root(writer_text) != protobuf_root(reader_text):
        # a message added before the old root (or the root renamed): the fields compared
        # would be another message's, and the records still name theirs by index
        out.append(f"the root message changed from {protobuf_root(writer_text)} to "
                   f"{protobuf_root(reader_text)} (the fields are read from the file's "
                   f"first top-level message no other uses)")
    for name, f in new.items():
        o = old.get(name)
        if o is None:
            if not f.has_default:
                out.append(f"field {name!r} {added} (records of the older schema have no "
                           f"value for it)")
            continue
        if not _widens(o.base, f.base, schema_type):
            out.append(f"field {name!r} changed from {o.base} to {f.base} (not a widening)")
        elif o.number != f.number:
            out.append(f"field {name!r} changed its number from {o.number} to {f.number} "
                       f"(records of the older schema carry it under the old one)")
        elif o.nullable and not f.nullable:
            out.append(f"field {name!r} no longer allows null")
    return out


def column_widens(old: str, new: str) -> bool:
    """Whether a column of format.schema type `old` may be altered to `new` (a widening the
    target can take in place: int -> long/double, long -> double, float -> double)."""
    return old != new and new in {"int": {"long", "double"}, "long": {"double"},
                                  "float": {"double"}}.get(old, set())


def protobuf_fields(serialized: str) -> dict[str, Field]:
    """The top-level fields of a Protobuf schema's root message (the file's first
    top-level message no other one uses as a field type), from the registry's base64
    FileDescriptorProto; ValueError when it cannot be read or has no message."""
    root = _proto_root(serialized)[1]
    out: dict[str, Field] = {}
    for f in root.field:
        base, column = _PROTO_TYPES.get(f.type, (str(f.type), "json"))
        if f.type == 11:  # a message: a Timestamp is a timestamp, others are json
            base = f.type_name.lstrip(".")
            column = "timestamp" if base == "google.protobuf.Timestamp" else "json"
        if f.label == 3:  # repeated (and maps)
            base, column = f"repeated {base}", "json"
        out[f.name] = Field(f.name, base, True, f.label != 2, column, f.number)
    return out


def protobuf_root(serialized: str) -> str:
    """The full name of the message `protobuf_fields` reads (the file's root)."""
    return _proto_root(serialized)[0]


def _proto_root(serialized: str) -> tuple[str, Any]:
    import base64

    from google.protobuf import descriptor_pb2

    try:
        proto = descriptor_pb2.FileDescriptorProto.FromString(
            base64.b64decode(serialized, validate=True))
    except Exception as e:  # noqa: BLE001 - .proto text, or not a descriptor
        raise ValueError(f"not a serialized Protobuf file: {e}") from None
    if not proto.message_type:
        raise ValueError("the schema has no message")
    prefix = f".{proto.package}." if proto.package else "."
    # a message's use of itself (a tree: `Node parent`) does not make it a part of another
    used = {f.type_name for m in proto.message_type for f in m.field
            if f.type_name != prefix + m.name}
    roots = [m for m in proto.message_type if prefix + m.name not in used]
    # messages that all use each other: the first, as a record's default index [0] names
    root = roots[0] if roots else proto.message_type[0]
    return (prefix + root.name).lstrip("."), root


def json_schema_fields(text: str) -> dict[str, Field]:
    """The top-level properties of a JSON Schema object schema; ValueError when it is not
    one. Typed as the json format reads them: integer -> long, number -> double, a string
    with format date-time / date -> timestamp / date, boolean, anything else -> json."""
    doc = json.loads(text)
    root = doc.get("type", "object") if isinstance(doc, dict) else None
    # an object, or an object or null (a null value is a tombstone-like record: no fields)
    is_object = root == "object" or (isinstance(root, list) and "object" in root
                                     and all(x in ("object", "null") for x in root))
    if not isinstance(doc, dict) or not isinstance(doc.get("properties", {}), dict) \
            or not is_object:
        raise ValueError("the schema is not an object with properties: format.schema names "
                         "its properties")
    required = set(doc.get("required") or [])
    out: dict[str, Field] = {}
    for name, prop in (doc.get("properties") or {}).items():
        prop = prop if isinstance(prop, dict) else {}
        t = prop.get("type")
        types = [x for x in t if x != "null"] if isinstance(t, list) else [t]
        nullable = t is None or (isinstance(t, list) and "null" in t)
        base = str(types[0]) if len(types) == 1 and types[0] is not None else "any"
        fmt = prop.get("format")
        column = {"integer": "long", "number": "double", "boolean": "boolean",
                  "string": {"date-time": "timestamp", "date": "date"}.get(
                      str(fmt), "string")}.get(base, "json")
        if base == "string" and fmt in ("date-time", "date"):
            base = f"string ({fmt})"
        out[str(name)] = Field(str(name), base, nullable,
                               name not in required or "default" in prop, column)
    return out
