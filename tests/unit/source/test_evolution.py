"""Schema evolution's pure rules (`offsetflow.source.evolution`) and the target's column
checks (`offsetflow.commit.tables.pending_columns`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from offsetflow.commit.tables import pending_columns
from offsetflow.errors import SchemaMismatchError
from offsetflow.source import evolved_columns, field_defaults, incompatibilities, unreadable


def _s(*fields: dict[str, Any]) -> str:
    return json.dumps({"type": "record", "name": "R", "fields": list(fields)})


BASE = ({"name": "id", "type": "long"}, {"name": "qty", "type": "int"})


def test_added_fields_become_columns_with_the_avro_type_mapping() -> None:
    reader = _s(*BASE, {"name": "note", "type": ["null", "string"], "default": None},
                {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []},
                {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"},
                 "default": 0},
                {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal",
                                            "precision": 10, "scale": 2}, "default": "\u0000"},
                {"name": "kind", "type": {"type": "enum", "name": "K", "symbols": ["A"]},
                 "default": "A"})
    assert evolved_columns({"t": reader}, {"id": "long"}, {"topic", "value"}) == {
        "qty": "int", "note": "string", "tags": "json", "at": "timestamp",
        "amount": "decimal(10,2)", "kind": "string"}


def test_a_field_named_like_a_source_column_is_refused() -> None:
    with pytest.raises(ValueError, match="source column"):
        evolved_columns({"t": _s(*BASE, {"name": "value", "type": "string"})}, {"id": "long"},
                        {"value"})


def test_two_topics_typing_a_field_differently_are_refused() -> None:
    with pytest.raises(ValueError, match="'qty' is int in one topic"):
        evolved_columns({"a": _s(*BASE), "b": _s(BASE[0], {"name": "qty", "type": "string"})},
                        {"id": "long"}, ())


@pytest.mark.parametrize(("new", "why"), [
    (_s(*BASE, {"name": "c", "type": "string", "default": ""}), []),
    (_s(BASE[0], {"name": "qty", "type": "long"}), []),  # widened
    (_s(BASE[0], {"name": "qty", "type": ["null", "int"], "default": None}), []),
    (_s(*BASE, {"name": "c", "type": "string"}), ["field 'c' added without a default"]),
    (_s(BASE[0], {"name": "qty", "type": "string"}), ["field 'qty' changed from int to string"]),
    (_s(BASE[0]), ["required field 'qty' removed"]),
])
def test_incompatibilities(new: str, why: list[str]) -> None:
    got = incompatibilities(_s(*BASE), new)
    assert len(got) == len(why) and all(w in g for w, g in zip(why, got, strict=True)), got


def test_narrowed_and_nullability_removed_are_incompatible() -> None:
    wide = _s(BASE[0], {"name": "qty", "type": ["null", "long"], "default": None})
    got = incompatibilities(wide, _s(BASE[0], {"name": "qty", "type": "long"}))
    assert got == ["field 'qty' no longer allows null"]
    got = incompatibilities(_s(BASE[0], {"name": "qty", "type": "long"}), _s(*BASE))
    assert got == ["field 'qty' changed from long to int (not a widening)"]


def test_pending_columns_add_widen_fit_or_refuse() -> None:
    have = {"a": "integer", "b": "bigint", "c": "text", "d": "numeric(10,2)"}
    assert pending_columns("t", have, [("a", "bigint"), ("b", "integer"), ("d", "numeric(10,2)"),
                                       ("e", "jsonb")]) == [("a", "bigint", "widen"),
                                                            ("e", "jsonb", "add")]
    with pytest.raises(SchemaMismatchError, match="column 'c' of type text, but the reader "
                                                  "schema's field 'c' needs bigint"):
        pending_columns("t", have, [("c", "bigint")])
    assert pending_columns("t", {"at": "timestamp with time zone"}, [("at", "timestamptz")]) == []


def test_schema_ids_noted_per_partition_with_their_first_offset() -> None:
    from offsetflow.stage import note_schema_ids

    def v(sid: int) -> bytes:
        return b"\x00" + sid.to_bytes(4, "big") + b"payload"

    values = [v(7), None, b'{"not": "wire"}', v(9), v(7), b"\x00\x00"]
    acc: dict[str, dict[str, int]] = {}
    note_schema_ids(acc, values, [10, 11, 12, 13, 14, 15], "t", 0)  # one range
    note_schema_ids(acc, [v(9)], [3], "t", 0)  # a later chunk: an earlier offset wins
    assert acc == {"t/0": {"7": 10, "9": 3}}
    packed: dict[str, dict[str, int]] = {}  # several ranges in one chunk
    note_schema_ids(packed, values, [10, 11, 12, 13, 14, 15], "t", 0,
                    ["t", "t", "u", "u", "t", "u"], [0, 0, 1, 1, 0, 1])
    assert packed == {"t/0": {"7": 10}, "u/1": {"9": 13}}


def _pipeline(**over: Any) -> Any:
    from offsetflow.config import parse_pipeline

    raw: dict[str, Any] = {
        "name": "p", "kafka": {}, "source": {"topics": ["t"]},
        "format": {"type": "avro", "schema": {"id": "long"}, "schema_evolution": "add_columns",
                   "schema_registry": {"url": "http://r:8081"}},
        "sink": {"table": "t"}}
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and k in raw else v
    return parse_pipeline(raw, "p.yaml", {"OFFSETFLOW_PG_DSN": "postgresql://x@y/z"})


def test_schema_evolution_config_where_it_is_built_and_in_the_fingerprint() -> None:
    from offsetflow.errors import ConfigError

    cfg = _pipeline()
    assert _pipeline(sink={"type": "iceberg", "table": "lake.t", "catalog": {
        "warehouse": "file:///w"}}).schema_evolution == "add_columns"
    assert cfg.schema_evolution == "add_columns"
    # into Iceberg in mode upsert, and for Protobuf and JSON Schema values too
    iceberg = {"type": "iceberg", "table": "lake.t", "catalog": {"warehouse": "file:///w"}}
    assert _pipeline(sink={**iceberg, "mode": "upsert", "key": ["id"]}
                     ).schema_evolution == "add_columns"
    for fmt in ("protobuf", "json_schema"):
        for mode in ({}, {"mode": "upsert", "key": ["id"]}):
            assert _pipeline(format={"type": fmt}, sink={**iceberg, **mode}
                             ).schema_evolution == "add_columns"
    assert _pipeline(format={"schema_evolution": "fail"}).fingerprint() != cfg.fingerprint()
    assert _pipeline(format={"schema_evolution": None}).schema_evolution is None
    for over, words in [
        ({"format": {"schema_evolution": "add"}}, "format.schema_evolution"),
        ({"format": {"type": "json", "schema_registry": None}}, "schema-registry formats"),
        ({"sink": {"type": "kafka", "topic": "out"}}, "built for sink.type postgres and "
                                                      "iceberg only"),
        ({"transform": "pkg.mod.fn"}, "does not work with a transform yet"),
    ]:
        with pytest.raises(ConfigError, match=words):
            _pipeline(**over)


def test_a_field_readded_with_another_type_is_checked_writer_by_writer() -> None:
    v1 = _s({"name": "id", "type": "long"}, {"name": "c", "type": "string", "default": ""})
    v2 = _s({"name": "id", "type": "long"})
    v3 = _s({"name": "id", "type": "long"}, {"name": "c", "type": "int", "default": 0})
    assert incompatibilities(v1, v2) == [] and incompatibilities(v2, v3) == []
    assert unreadable(v1, v3) == ["field 'c' changed from string to int (not a widening)"]
    assert unreadable(v2, v3) == []
    # a reader that drops a field reads its writer's records (only the chain refuses that)
    assert unreadable(_s(*BASE), _s(BASE[0])) == []


def test_field_defaults_are_the_values_an_older_writers_record_gets() -> None:
    reader = _s({"name": "id", "type": "long"},
                {"name": "ch", "type": "string", "default": "web"},
                {"name": "n", "type": "long", "default": 7},
                {"name": "note", "type": ["null", "string"], "default": None},
                {"name": "tags", "type": {"type": "array", "items": "string"},
                 "default": ["a"]})
    cols = {"ch": "string", "n": "long", "note": "string", "tags": "json"}
    assert field_defaults({"t": (1, reader)}, cols) == {"ch": "web", "n": 7,
                                                        "tags": '["a"]'}
    other = _s({"name": "id", "type": "long"}, {"name": "ch", "type": "string",
                                                "default": "app"})
    # topics whose readers disagree (or lack the field): NULL, not one topic's default
    assert field_defaults({"t": (1, reader), "u": (2, other)}, cols) == {}
