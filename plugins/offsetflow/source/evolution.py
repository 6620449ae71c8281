"""Avro schema evolution under `format.schema_evolution` (pure logic: no registry, no
database). Two questions, answered from schema texts:

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
target in its own transaction.
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


@dataclass(frozen=True)
class Field:
    """One top-level field of a record schema: its base type (a union with null stripped),
    whether null is allowed, whether it has a default, and its column type."""

    name: str
    base: str  # primitive name, logical type name, or record/array/map/fixed/union
    nullable: bool
    has_default: bool
    column: str  # format.schema type of the column it lands in


def schema_fields(schema_text: str) -> dict[str, Field]:
    """The top-level fields of an Avro record schema (its text, as the registry holds it);
    ValueError when it is not a record."""
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
                    reserved: Iterable[str]) -> dict[str, str]:
    """Columns the reader schemas (topic -> schema text; None: the topic's subject has
    none) add to `declared`: their top-level fields no column has yet, in field order.
    ValueError names a field two topics' schemas type differently, or one that collides
    with a source column."""
    out: dict[str, str] = {}
    taken = set(reserved)
    for topic, text in sorted(readers.items()):
        if text is None:
            continue
        for name, f in schema_fields(text).items():
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


def _widens(old: str, new: str) -> bool:
    return old == new or new in _PROMOTES.get(old, set())


def incompatibilities(old_text: str, new_text: str) -> list[str]:
    """Why data of the older schema cannot be read as the newer one, or the newer drops
    what the older required: a field added without a default, a field removed that had no
    default, a type narrowed (not an Avro promotion), null no longer allowed."""
    old = schema_fields(old_text)
    out = unreadable(old_text, new_text)
    for name, o in old.items():
        if name not in schema_fields(new_text) and not o.has_default:
            out.append(f"required field {name!r} removed")
    return out


def unreadable(writer_text: str, reader_text: str) -> list[str]:
    """Why records written with one schema cannot be read as another (Avro resolution
    fails for them): a field the reader adds without a default, a type it narrows, null no
    longer allowed. Checked per pair, not along the chain of versions: a field removed and
    re-added with another type passes every step and still breaks the first writer."""
    old, new = schema_fields(writer_text), schema_fields(reader_text)
    out = []
    for name, f in new.items():
        o = old.get(name)
        if o is None:
            if not f.has_default:
                out.append(f"field {name!r} added without a default (records of the older "
                           f"schema have no value for it)")
            continue
        if not _widens(o.base, f.base):
            out.append(f"field {name!r} changed from {o.base} to {f.base} (not a widening)")
        elif o.nullable and not f.nullable:
            out.append(f"field {name!r} no longer allows null")
    return out


def column_widens(old: str, new: str) -> bool:
    """Whether a column of format.schema type `old` may be altered to `new` (a widening the
    target can take in place: int -> long/double, long -> double, float -> double)."""
    return old != new and new in {"int": {"long", "double"}, "long": {"double"},
                                  "float": {"double"}}.get(old, set())
