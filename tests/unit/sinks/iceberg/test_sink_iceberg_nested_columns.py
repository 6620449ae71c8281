"""Which columns of a run get the Avro reader's nested types in a table the Iceberg sink
creates (`sink_iceberg_nested`): the fused path's jsonb ones, a transform's string column
under a `json` field's name (never a struct the transform made), never a sink.key column."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from offsetflow.config import parse_pipeline
from offsetflow.sinks.iceberg.pipeline import IcebergPipelineSink
from offsetflow.sinks.iceberg.stage import arrow_schema

READER = json.dumps({"type": "record", "name": "R", "fields": [
    {"name": "id", "type": {"type": "record", "name": "Id", "fields": [
        {"name": "n", "type": "long"}]}},
    {"name": "address", "type": {"type": "record", "name": "A", "fields": [
        {"name": "street", "type": "string"}]}},
    {"name": "tags", "type": {"type": "array", "items": "string"}}]})
READERS = {"t": (1, READER)}
ADDRESS = pa.struct([pa.field("street", pa.string(), nullable=False)])
TAGS = pa.list_(pa.field("element", pa.string(), nullable=False))


def _sink(**extra: Any) -> IcebergPipelineSink:
    sink = extra.pop("sink", {})
    raw = {"name": "p", "kafka": {"bootstrap_servers": "k:9092"},
           "source": {"topics": ["t"]},
           "format": {"type": "avro", "schema_registry": {"url": "http://r:8081"},
                      "schema": {"id": "json", "address": "json", "tags": "json"}},
           "sink": {"type": "iceberg", "connection": "postgresql://u:pw@h:5432/db",
                    "table": "lake.t", "catalog": {"warehouse": "file:///w"}, **sink},
           "dead_letter_table": "dl", **extra}
    return IcebergPipelineSink(parse_pipeline(raw, "f.yaml", {}))


def test_the_fused_path_types_its_jsonb_columns_and_never_the_key() -> None:
    cols = [("offset", "bigint"), ("id", "jsonb"), ("address", "jsonb"), ("tags", "jsonb")]
    assert _sink().nested_types(cols, READERS) == {
        "id": pa.struct([pa.field("n", pa.int64(), nullable=False)]), "address": ADDRESS,
        "tags": TAGS}
    upsert = _sink(sink={"mode": "upsert", "key": ["id"]})
    assert upsert.nested_types(cols, READERS) == {"address": ADDRESS, "tags": TAGS}


def test_a_transforms_string_column_of_a_json_field_is_typed_its_own_struct_not() -> None:
    sink = _sink(transform="m.f")
    # address passed on as its text; tags made a Spark array by the transform (jsonb in
    # the stage: its own type, not the reader's); `extra`, no json field of that name
    cols = [("offset", "bigint"), ("address", "text"), ("tags", "jsonb"), ("extra", "text")]
    assert sink.nested_types(cols, READERS) == {"address": ADDRESS}
    schema = arrow_schema(cols, sink.nested_types(cols, READERS))
    assert schema.field("address").type == ADDRESS
    assert schema.field("tags").type == pa.string()
    assert schema.field("extra").type == pa.string()
