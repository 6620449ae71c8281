"""Avro keys (`format.key: {type: avro}`) and the json_schema format, without services: a
key's fields fill the columns over the value's, a poison key is a dead letter naming the key
and its schema id, and the config's checks of both."""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import pytest

from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError
from offsetflow.source import AvroDecoder, JsonSchemaIds, deserialize_avro, deserialize_json_schema
from offsetflow.source.registry import RegisteredSchema

KEY = {"type": "record", "name": "K", "fields": [{"name": "id", "type": "long"}]}
VALUE = {"type": "record", "name": "V", "fields": [{"name": "id", "type": "long"},
                                                    {"name": "note", "type": "string"}]}
COLUMNS = {"id": "long", "note": "string"}


class FakeRegistry:
    shown = "http://registry"
    schemas = {1: RegisteredSchema(1, "AVRO", json.dumps(KEY)),
               2: RegisteredSchema(2, "AVRO", json.dumps(VALUE)),
               3: RegisteredSchema(3, "JSON", json.dumps({"type": "object"}))}

    def schema_by_id(self, schema_id: int, serialized: bool = False
                     ) -> RegisteredSchema | None:
        return self.schemas.get(schema_id)

    def subject_version(self, subject: str, version: int | None) -> None:
        return None


def _wire(schema: dict[str, Any], rec: dict[str, Any], schema_id: int) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), rec)
    return b"\x00" + schema_id.to_bytes(4, "big") + buf.getvalue()


def _decoder() -> AvroDecoder:
    return AvroDecoder(FakeRegistry(), {"t": None})  # type: ignore[arg-type]


def test_avro_key_fields_fill_columns_and_poison_keys_are_dead_letters() -> None:
    k5 = _wire(KEY, {"id": 5}, 1)
    values = [_wire(VALUE, {"id": 99, "note": "a"}, 2), None, _wire(VALUE, {"id": 1,
              "note": "b"}, 2), _wire(VALUE, {"id": 1, "note": "c"}, 2), None]
    keys = [k5, k5, b"plain", b"\x00\x00\x00\x00\x09" + k5[5:], k5[:5]]
    table, bad, good = deserialize_avro(values, ["t"] * 5, COLUMNS, _decoder(), keys,
                                        _decoder())
    assert good == [0, 1]
    assert table.to_pylist() == [{"id": 5, "note": "a"},  # the key's id wins
                                 {"id": 5, "note": None}]  # a tombstone keyed by the key
    reasons = {b.index: b.reason for b in bad}
    assert reasons[2].startswith("key: not in the Confluent wire format")
    assert reasons[3].startswith("key: schema id 9: unknown schema id 9")
    assert reasons[4].startswith("key: schema id 1: payload does not decode")


def test_json_schema_values_are_json_after_the_header_with_ids_checked() -> None:
    ids = JsonSchemaIds(FakeRegistry())  # type: ignore[arg-type]
    values = [b"\x00\x00\x00\x00\x03" + b'{"id": 1, "note": "x"}', b'{"id": 2}',
              b"\x00\x00\x00\x00\x08{}", b"\x00\x00\x00\x00\x02{}",
              b"\x00\x00\x00\x00\x03" + b'{"id": "no"}', None]
    table, bad, good = deserialize_json_schema(values, ["t"] * 6, COLUMNS, ids,
                                               [None] * 5 + [b'{"id": 4}'])
    assert good == [0, 5] and table.to_pylist() == [{"id": 1, "note": "x"},
                                                    {"id": 4, "note": None}]
    reasons = {b.index: b.reason for b in bad}
    assert reasons[1].startswith("not in the Confluent wire format")
    assert reasons[2].startswith("schema id 8: unknown schema id 8")
    assert reasons[3] == "schema id 2: schema id 2 is a AVRO schema, not JSON Schema"
    assert reasons[4].startswith("schema id 3: field 'id'")
    # with an Avro key, the key's fields fill the columns
    table, bad, good = deserialize_json_schema(
        [values[0], None], ["t"] * 2, COLUMNS, ids, [_wire(KEY, {"id": 7}, 1), b"junk"],
        _decoder())
    assert good == [0] and table.to_pylist() == [{"id": 7, "note": "x"}]
    assert bad[0].index == 1 and bad[0].reason.startswith("key: not in the Confluent")


def _cfg(fmt: dict[str, Any]) -> Any:
    return parse_pipeline({"name": "p", "kafka": {}, "source": {"topics": ["t"]},
                           "format": fmt, "sink": {"table": "t"}}, "p.yaml",
                          {"OFFSETFLOW_PG_DSN": "postgresql://x@y/z"})


def test_key_and_json_schema_config() -> None:
    reg = {"url": "http://r"}
    cfg = _cfg({"type": "avro", "key": {"type": "avro"}, "schema": {"id": "long"},
                "schema_registry": reg})
    assert cfg.key_format == "avro"
    assert cfg.fingerprint() != _cfg({"type": "avro", "schema": {"id": "long"},
                                      "schema_registry": reg}).fingerprint()
    with pytest.raises(ConfigError, match="format.key: an avro key is read through a schema "
                                          "registry"):
        _cfg({"type": "json", "key": {"type": "avro"}, "schema": {"id": "long"}})
    with pytest.raises(ConfigError, match="format.key.type: 'protobuf' is not one of"):
        _cfg({"type": "avro", "key": {"type": "protobuf"}, "schema": {"id": "long"},
              "schema_registry": reg})
    js = _cfg({"type": "json_schema", "key": {"type": "avro"}, "schema": {"id": "long"},
               "schema_registry": reg})
    assert (js.format_type, js.key_format, js.registry.url) == ("json_schema", "avro", reg["url"])
    with pytest.raises(ConfigError, match="json_schema format needs a schema registry"):
        _cfg({"type": "json_schema", "schema": {"id": "long"}})
    with pytest.raises(ConfigError, match="reader_version: pins an Avro reader schema"):
        _cfg({"type": "json_schema", "schema": {"id": "long"},
              "schema_registry": {**reg, "reader_version": 2}})
    with pytest.raises(ConfigError, match="'uuid' is for format.type avro only"):
        _cfg({"type": "json_schema", "schema": {"doc": "uuid"}, "schema_registry": reg})


def test_protobuf_message_indexes_and_config() -> None:
    from offsetflow.source.protobuf import ProtobufDecoder, read_varint

    assert read_varint(b"\x00", 0) == (0, 1) and read_varint(b"\x02", 0) == (1, 1)
    assert read_varint(b"\x01", 0) == (-1, 1) and read_varint(b"\xac\x02", 0) == (150, 2)
    with pytest.raises(ValueError, match="cut short"):
        read_varint(b"\x80", 0)
    dec = ProtobufDecoder(FakeRegistry())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schema id 1 is a AVRO schema, not Protobuf"):
        dec.decode(b"\x00\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="unknown schema id 9"):
        dec.decode(b"\x00\x00\x00\x00\x09\x00")
    pb = _cfg({"type": "protobuf", "schema": {"id": "long", "doc": "json"},
               "schema_registry": {"url": "http://r"}})
    assert pb.format_type == "protobuf" and pb.schema["doc"] == "json"
    with pytest.raises(ConfigError, match="reader_version: pins an Avro reader schema"):
        _cfg({"type": "protobuf", "schema": {"id": "long"},
              "schema_registry": {"url": "http://r", "reader_version": 1}})


class DownRegistry(FakeRegistry):
    def schema_by_id(self, schema_id: int, serialized: bool = False) -> None:
        from offsetflow.errors import SchemaRegistryError

        raise SchemaRegistryError(self.shown, f"schema id {schema_id}", "no answer")


def test_a_registry_outage_fails_the_chunk_never_makes_dead_letters() -> None:
    from offsetflow.errors import SchemaRegistryError
    from offsetflow.source import ProtobufDecoder, deserialize_protobuf

    down = DownRegistry()
    value = b"\x00\x00\x00\x00\x03{}"
    with pytest.raises(SchemaRegistryError):
        deserialize_json_schema([value], ["t"], COLUMNS, JsonSchemaIds(down))  # type: ignore[arg-type]
    with pytest.raises(SchemaRegistryError):
        deserialize_protobuf([b"\x00\x00\x00\x00\x03\x00"], ["t"], COLUMNS,
                             ProtobufDecoder(down))  # type: ignore[arg-type]
    with pytest.raises(SchemaRegistryError):  # a key's writer schema is fetched the same way
        deserialize_avro([None], ["t"], COLUMNS, _decoder(), [b"\x00\x00\x00\x00\x01\x00"],
                         AvroDecoder(down, {"t": None}))  # type: ignore[arg-type]


class OtherTypeSubject:
    """A registry whose `<topic>-value` subject holds an Avro schema."""
    shown = "http://registry"

    def subject_version(self, subject: str, version: int | None,
                        serialized: bool = False) -> RegisteredSchema | None:
        return RegisteredSchema(7, "AVRO", json.dumps(VALUE))


def test_a_subject_of_another_type_is_no_reader_unless_evolution_needs_it() -> None:
    """With a `json` column only (nested types, no evolution) a pipeline that ran without a
    reader still runs; under schema_evolution the subject is the config's error."""
    from offsetflow.errors import SchemaRegistryError
    from offsetflow.source import value_schemas

    client: Any = OtherTypeSubject()
    assert value_schemas(client, ["t"], "PROTOBUF", strict=False) == {"t": None}
    with pytest.raises(SchemaRegistryError, match="holds a AVRO schema, not PROTOBUF"):
        value_schemas(client, ["t"], "PROTOBUF")
