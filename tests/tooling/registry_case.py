"""Shared pieces of the record-format tests (json, and the schema-registry formats): the
stack's registry URL, a topic of their own, records encoded by confluent-kafka's real
serializers (Avro, JSON Schema, Protobuf), which register their schemas in that registry
under `<topic>-value` / `<topic>-key`, produced to the topic; the pipeline that reads it
into a PostgreSQL table of its own, and its first batch planned and run."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import PipelineConfig, parse_pipeline


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


def produce(bootstrap: str, topic: str, values: list[bytes | tuple[bytes, bytes | None, int]]
            ) -> None:
    """Each value (or `(value, key, partition)`) to `topic`, flushed; values alone go to
    partition 0 in order, so their offsets are their list positions."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for v in values:
        value, key, partition = v if isinstance(v, tuple) else (v, None, 0)
        p.produce(topic, value, key=key, partition=partition)
    assert p.flush(30) == 0


def record_pipeline(name: str, topic: str, fmt: str, columns: dict[str, str], dsn: str,
                    bootstrap: str, **fmt_extra: Any) -> PipelineConfig:
    """The pipeline these tests read `topic` with: `format.type` `fmt` with `columns`
    (and the stack's registry for the registry formats), from the earliest offset, into
    PostgreSQL table `name`, bad records to `dl_<name>`, Spark local[2]. `fmt_extra`:
    more `format.` settings (schema_evolution, key, ...)."""
    fmt_doc: dict[str, Any] = {"type": fmt, "schema": dict(columns), **fmt_extra}
    if fmt in ("avro", "protobuf", "json_schema"):
        fmt_doc.setdefault("schema_registry", {"url": registry_url()})
    return parse_pipeline({
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest"}, "format": fmt_doc,
        "sink": {"connection": dsn, "table": name}, "bad_records": "dead_letter",
        "dead_letter_table": f"dl_{name}", "spark": {"master": "local[2]"}},
        f"<test {name}>", {})


def plan_batch(cfg: PipelineConfig, dsn: str) -> int:
    """Plan the pipeline's next batch (there must be one): its id."""
    from offsetflow.ops import plan_only

    planned = plan_only(cfg, dsn, started_by="test")
    assert planned.batch is not None, "nothing to plan"
    return planned.batch.batch_id


def plan_and_run(spark: Any, cfg: PipelineConfig, dsn: str) -> tuple[int, Any]:
    """Plan the pipeline's next batch and run it: (its id, the run's report)."""
    from offsetflow.job import run_batch

    bid = plan_batch(cfg, dsn)
    return bid, run_batch(spark, cfg, bid, dsn)
