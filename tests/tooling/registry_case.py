"""Shared pieces of the schema-registry format tests: the stack's registry URL, a topic of
their own, and records encoded by confluent-kafka's real serializers (Avro, JSON Schema),
which register their schemas in that registry under `<topic>-value` / `<topic>-key`."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic


def registry_url() -> str:
    url = os.environ.get("OFFSETFLOW_SCHEMA_REGISTRY_URL")
    if not url:
        pytest.fail("OFFSETFLOW_SCHEMA_REGISTRY_URL is not set: start the stack's schema "
                    "registry (make up, or include/stack/stack.sh registry-start)")
    return url


def new_topic(bootstrap: str, prefix: str, partitions: int = 2) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(timeout=30)
    return name


def avro_serializer(url: str, schema: dict[str, Any]) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer

    return AvroSerializer(SchemaRegistryClient({"url": url}), json.dumps(schema),
                          conf={"auto.register.schemas": True})


def json_serializer(url: str, schema: dict[str, Any]) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.json_schema import JSONSerializer

    return JSONSerializer(json.dumps(schema), SchemaRegistryClient({"url": url}),
                          conf={"auto.register.schemas": True})


def encode(ser: Any, topic: str, record: Any, key: bool = False) -> bytes:
    """`record` as the serializer writes it for the topic's value (or key)."""
    from confluent_kafka.serialization import MessageField, SerializationContext

    field = MessageField.KEY if key else MessageField.VALUE
    return ser(record, SerializationContext(topic, field))  # type: ignore[no-any-return]


def protobuf_serializer(url: str, message_class: Any) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

    return ProtobufSerializer(message_class, SchemaRegistryClient({"url": url}),
                              conf={"auto.register.schemas": True,
                                    "use.deprecated.format": False})


def dynamic_message_classes(file_proto: Any) -> dict[str, Any]:
    """Message classes (by name) of a FileDescriptorProto built at run time: no generated
    code, no protoc; Google's well-known types it imports come from the installed package."""
    from google.protobuf import descriptor_pb2, descriptor_pool, timestamp_pb2
    from google.protobuf.message_factory import GetMessageClass

    pool = descriptor_pool.DescriptorPool()
    for dep in file_proto.dependency:
        assert dep == "google/protobuf/timestamp.proto", dep
        ts = descriptor_pb2.FileDescriptorProto()
        timestamp_pb2.DESCRIPTOR.CopyToProto(ts)
        pool.Add(ts)
    fd = pool.Add(file_proto)
    return {name: GetMessageClass(d) for name, d in fd.message_types_by_name.items()}
