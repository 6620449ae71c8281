"""Kafka as a source: metadata in batched admin calls, reading exactly one OffsetRange
(or a packed task's ranges) with an assigned consumer, and decoding records to Arrow.
Spark tasks import this package: its face stays light.
"""

from __future__ import annotations

from offsetflow.source.avro import (
    AvroDecoder,
    deserialize_avro,
    field_defaults,
    reader_schemas,
    subject_of,
)
from offsetflow.source.deserialize import arrow_schema, deserialize_json
from offsetflow.source.evolution import (
    evolved_columns,
    incompatibilities,
    schema_fields,
    unreadable,
)
from offsetflow.source.json_fast import BadRecord
from offsetflow.source.json_schema import JsonSchemaIds, deserialize_json_schema
from offsetflow.source.lag import publish_positions
from offsetflow.source.meta import KafkaMetadata
from offsetflow.source.nested import avro_nested_types, common_nested_types
from offsetflow.source.nested_formats import nested_types
from offsetflow.source.packed import read_ranges
from offsetflow.source.protobuf import ProtobufDecoder, deserialize_protobuf, protobuf_builds
from offsetflow.source.reader import (
    MAX_CHUNK_BYTES,
    MAX_CHUNK_ROWS,
    SHARED_MAX_SPAN,
    range_consumer,
    read_range,
)
from offsetflow.source.registry import (
    SCHEMA_TYPES,
    RegistryClient,
    registry_settings,
    value_schemas,
)
from offsetflow.source.retry import RetryPolicy

__all__ = [
    "AvroDecoder",
    "BadRecord",
    "JsonSchemaIds",
    "KafkaMetadata",
    "MAX_CHUNK_BYTES",
    "MAX_CHUNK_ROWS",
    "ProtobufDecoder",
    "RegistryClient",
    "RetryPolicy",
    "SCHEMA_TYPES",
    "SHARED_MAX_SPAN",
    "arrow_schema",
    "avro_nested_types",
    "common_nested_types",
    "deserialize_avro",
    "deserialize_json",
    "deserialize_json_schema",
    "deserialize_protobuf",
    "evolved_columns",
    "field_defaults",
    "incompatibilities",
    "nested_types",
    "protobuf_builds",
    "publish_positions",
    "range_consumer",
    "read_range",
    "read_ranges",
    "reader_schemas",
    "registry_settings",
    "schema_fields",
    "subject_of",
    "unreadable",
    "value_schemas",
]
