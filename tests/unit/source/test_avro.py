"""The Avro decoder and its config, without services: the wire format, the registry's answers
as a record's fate (a fake client), and `format.schema_registry`'s checks."""

from __future__ import annotations

import io
import json
from decimal import Decimal
from typing import Any

import fastavro
import pytest

from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError
from offsetflow.source import AvroDecoder, deserialize_avro
from offsetflow.source.avro import json_text
from offsetflow.source.registry import RegisteredSchema

SCHEMA = {"type": "record", "name": "R", "fields": [
    {"name": "id", "type": "long"},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 6,
                                "scale": 2}},
    {"name": "nested", "type": {"type": "map", "values": "bytes"}}]}
COLUMNS = {"id": "int", "amount": "decimal(6,2)", "nested": "json"}


class FakeRegistry:
    shown = "http://registry"

    def schema_by_id(self, schema_id: int) -> RegisteredSchema | None:
        return RegisteredSchema(7, "AVRO", json.dumps(SCHEMA)) if schema_id == 7 else None

    def subject_version(self, subject: str, version: int | None) -> None:
        return None


def _wire(rec: dict[str, Any], schema_id: int = 7) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(SCHEMA), rec)
    return b"\x00" + schema_id.to_bytes(4, "big") + buf.getvalue()


def test_each_record_is_a_row_or_a_dead_letter_naming_its_schema_id() -> None:
    good = _wire({"id": 1, "amount": Decimal("12.34"), "nested": {"b": b"\x00\x01"}})
    values = [good, b"{}", _wire({"id": 2, "amount": Decimal(1), "nested": {}}, 8),
              good[:-2], good + b"x", _wire({"id": 2**40, "amount": Decimal(1), "nested": {}}),
              None]
    decoder = AvroDecoder(FakeRegistry(), {"t": None})  # type: ignore[arg-type]
    table, bad, good_rows = deserialize_avro(values, ["t"] * len(values), COLUMNS, decoder)
    assert good_rows == [0, 6]  # the tombstone is a row of nulls
    assert table.to_pylist()[0] == {"id": 1, "amount": Decimal("12.34"),
                                    "nested": '{"b":"AAE="}'}
    reasons = {b.index: b.reason for b in bad}
    assert "magic byte" in reasons[1]
    assert reasons[2].startswith("schema id 8: unknown schema id 8")
    assert reasons[3].startswith("schema id 7: payload does not decode")
    assert " at 0x" not in reasons[3]  # the same reason on every run
    assert reasons[4] == ("schema id 7: 1 bytes left after the record (not written with the "
                          "schema its id names?)")
    assert reasons[5] == "schema id 7: field 'id': 1099511627776 does not fit in int"


def test_json_columns_keep_decimals_exact_and_refuse_nul() -> None:
    assert json_text({"a": [Decimal("0.10"), Decimal("-12345678901234567890.5")]}) == \
        '{"a":[0.10,-12345678901234567890.5]}'
    with pytest.raises(ValueError, match="NUL"):
        json_text({"a": "x\x00"})


def _cfg(fmt: dict[str, Any]) -> Any:
    return parse_pipeline({"name": "p", "kafka": {}, "source": {"topics": ["t"]},
                           "format": fmt, "sink": {"table": "t"}}, "p.yaml",
                          {"OFFSETFLOW_PG_DSN": "postgresql://x@y/z", "SR_PASSWORD": "s3cret"})


def test_avro_config_needs_a_registry_and_keeps_its_password_secret() -> None:
    with pytest.raises(ConfigError, match="format.schema_registry: avro format needs"):
        _cfg({"type": "avro", "schema": {"id": "long"}})
    with pytest.raises(ConfigError, match="is for format.type avro"):
        _cfg({"type": "json", "schema": {"id": "long"}, "schema_registry": {"url": "http://r"}})
    with pytest.raises(ConfigError, match="'uuid' is for format.type avro only"):
        _cfg({"type": "json", "schema": {"doc": "uuid"}})
    assert _cfg({"type": "json", "schema": {"doc": "json"}}).schema == {"doc": "json"}
    with pytest.raises(ConfigError, match="basic auth needs both"):
        _cfg({"type": "avro", "schema": {"id": "long"},
              "schema_registry": {"url": "http://r", "username": "u"}})
    cfg = _cfg({"type": "avro", "schema": {"id": "long", "doc": "json", "u": "uuid"},
                "schema_registry": {"url": "http://r:8081/", "username": "u",
                                    "password": "${SR_PASSWORD}", "reader_version": 2}})
    assert cfg.registry.url == "http://r:8081" and cfg.registry.password == "s3cret"
    assert "s3cret" not in json.dumps(cfg.redacted())
    pinned = _cfg({"type": "avro", "schema": {"id": "long", "doc": "json", "u": "uuid"},
                   "schema_registry": {"url": "http://r:8081/", "username": "u",
                                       "password": "${SR_PASSWORD}", "reader_version": 3}})
    assert pinned.fingerprint() != cfg.fingerprint()  # the reader schema decides the output
