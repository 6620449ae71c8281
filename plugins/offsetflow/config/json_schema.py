"""The JSON Schema (draft 2020-12) of a pipeline YAML, for editors (`offsetflow schema`; VS
Code's YAML extension: `# yaml-language-server: $schema=pipeline.schema.json`).

Generated from the parser's own field tables (`config.tables`): the keys of every section,
their kinds, allowed values and forms, so it cannot drift from what the parser accepts; the
few rules between fields that a schema can say (one of two fields, which sink type takes
which field) are written here beside the parser's. The parser stays the authority (`offsetflow
validate`): columns of format.schema, partition transforms and the like are checked there.
"""

from __future__ import annotations

from typing import Any

from offsetflow.config.kafka_sink import FORBIDDEN_PRODUCER_KEYS
from offsetflow.config.schema import (
    AVRO_FIELD_TYPES,
    DECIMAL_RE,
    ENV_RE,
    FORBIDDEN_CLIENT_KEYS,
    IDENT_RE,
    RESERVED_COLUMNS,
)
from offsetflow.config.tables import CATALOG_FIELDS, FIELDS, SINK_TYPES, Spec

DRAFT = "https://json-schema.org/draft/2020-12/schema"
# a value that holds a `${VAR}`: resolved when the file is loaded, so any form may be meant
ENV_REF: dict[str, Any] = {"type": "string", "pattern": ENV_RE.pattern}
SCALAR: dict[str, Any] = {"type": ["string", "number", "boolean", "null"]}


def pipeline_json_schema() -> dict[str, Any]:
    """The schema of a pipeline YAML document."""
    return {
        "$schema": DRAFT,
        "title": "OffsetFlow pipeline",
        "description": "A pipeline of OffsetFlow (include/pipelines/<name>.yaml); "
                       "`offsetflow validate FILE` checks everything this schema cannot.",
        **_section(""),
    }


def _section(section: str) -> dict[str, Any]:
    prefix = f"{section}." if section else ""
    names = [n for n in FIELDS if n.startswith(prefix) and "." not in n[len(prefix):]]
    out: dict[str, Any] = {
        "type": "object",
        "properties": {n[len(prefix):]: _value(n, FIELDS[n]) for n in names},
        "additionalProperties": False,
    }
    required = [n[len(prefix):] for n in names
                if FIELDS[n].required and FIELDS[n].sinks == SINK_TYPES]
    if required:
        out["required"] = required
    rules = _RULES.get(section)
    if rules:
        out["allOf"] = rules()
    return out


def _value(name: str, spec: Spec) -> dict[str, Any]:
    v: dict[str, Any]
    if spec.kind == "section":
        v = _section(name)
    elif spec.kind == "mapping":
        v = _MAPPINGS[name]()
    elif spec.kind == "starting":
        v = _starting()
    elif spec.kind == "strings":
        one = _string(spec)
        v = {"anyOf": [one, {"type": "array", "items": one,
                             **({"minItems": 1} if name == "source.topics" else {})}]}
    elif spec.kind == "integer":
        v = {"type": "integer", **({"minimum": spec.minimum} if spec.minimum is not None
                                   else {})}
    elif spec.kind == "number":
        bound = "exclusiveMinimum" if spec.exclusive else "minimum"
        v = {"type": "number", **({bound: spec.minimum} if spec.minimum is not None else {})}
    elif spec.kind == "string":
        v = _string(spec)
    else:  # any
        v = {}
    return _or_null(v) if spec.nullable and v else v


def _or_null(v: dict[str, Any]) -> dict[str, Any]:
    """`v` or null (null: the field is not given), flat where it can be: editors complete
    the properties and values of a plain schema better than those of an `anyOf`."""
    if isinstance(v.get("type"), str):
        v = {**v, "type": [v["type"], "null"]}
        if "enum" in v:
            v["enum"] = [*v["enum"], None]
        return v
    return {"anyOf": [*v.get("anyOf", [v]), {"type": "null"}]} if set(v) <= {"anyOf"} \
        else {"anyOf": [v, {"type": "null"}]}


def _string(spec: Spec) -> dict[str, Any]:
    v: dict[str, Any] = {"type": "string"}
    if spec.choices:
        v["enum"] = list(spec.choices)
    if spec.pattern:
        v["pattern"] = spec.pattern
    if spec.env and (spec.choices or spec.pattern):
        return {"anyOf": [v, ENV_REF]}
    return v


def _starting() -> dict[str, Any]:
    return {"anyOf": [
        {"enum": ["earliest", "latest"]},
        {"type": "object", "additionalProperties": False, "required": ["timestamp"],
         "properties": {"timestamp": {"anyOf": [
             {"type": "integer", "minimum": 0},
             {"type": "string", "description": "ISO-8601; a time without a zone is UTC"}]}}},
        {"type": "object", "additionalProperties": False, "required": ["offsets"],
         "properties": {"offsets": {
             "type": "object", "description": "topic -> {partition: offset}",
             "additionalProperties": {
                 "type": "object", "propertyNames": {"pattern": r"^\d+$"},
                 "additionalProperties": {"type": "integer", "minimum": 0}}}}},
    ]}


def _any_case(word: str) -> str:
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in word)


def _column_types() -> dict[str, Any]:
    """format.schema: column -> type (the parser reads the type in any case; `json` and
    `uuid` only with format.type avro or protobuf, which the parser checks)."""
    decimal = DECIMAL_RE.pattern.strip("^$").replace("decimal", _any_case("decimal"))
    words = "|".join(_any_case(t) for t in sorted(AVRO_FIELD_TYPES))
    return {"type": "object", "minProperties": 1,
            "propertyNames": {"pattern": IDENT_RE.pattern,
                              "not": {"enum": sorted(RESERVED_COLUMNS)}},
            "additionalProperties": {"anyOf": [
                {"enum": sorted(AVRO_FIELD_TYPES)},
                {"type": "string", "pattern": rf"^\s*(({words})|{decimal})\s*$"}]}}


def _settings(forbidden: set[str]) -> dict[str, Any]:
    """librdkafka settings: scalars, without the keys OffsetFlow owns."""
    return {"type": "object", "propertyNames": {"not": {"enum": sorted(forbidden)}},
            "additionalProperties": SCALAR}


def _catalog() -> dict[str, Any]:
    return {"type": "object",
            "properties": {k: _string(s) for k, s in CATALOG_FIELDS.items()},
            "additionalProperties": SCALAR}


_MAPPINGS = {
    "kafka.client": lambda: _settings(FORBIDDEN_CLIENT_KEYS),
    "sink.producer": lambda: _settings(FORBIDDEN_PRODUCER_KEYS),
    "format.schema": _column_types,
    "spark.conf": lambda: {"type": "object", "additionalProperties": SCALAR},
    "sink.catalog": _catalog,
}


def _one_of_two(a: str, b: str) -> dict[str, Any]:
    return {"not": {"required": [a, b]}}


def _sink_rules() -> list[dict[str, Any]]:
    """Each sink type takes its own fields (and needs its target)."""
    sink = {n[len("sink."):]: s for n, s in FIELDS.items()
            if n.startswith("sink.") and "." not in n[len("sink."):]}
    rules: list[dict[str, Any]] = [_one_of_two("conn_id", "connection")]
    for t in SINK_TYPES:
        is_t: dict[str, Any] = {"properties": {"type": {"const": t}}, "required": ["type"]}
        if t == "postgres":  # the default
            is_t = {"anyOf": [{"not": {"required": ["type"]}}, is_t]}
        rules.append({"if": is_t, "then": {
            "properties": {k: False for k, s in sink.items() if t not in s.sinks},
            "required": [k for k, s in sink.items() if s.required and t in s.sinks]}})
    return rules


_RULES = {
    "kafka": lambda: [_one_of_two("conn_id", "bootstrap_servers")],
    "source": lambda: [{"oneOf": [{"required": ["topics"]}, {"required": ["topic_pattern"]}]}],
    "sink": _sink_rules,
}
