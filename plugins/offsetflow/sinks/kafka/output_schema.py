"""The Kafka sink's Avro value schema (`sink.value_format: avro`): registered (or found) in
the schema registry once per commit attempt on the driver, and pinned per batch in the
ledger (`offsetflow.output_schemas`, migration 0016) so every later attempt of the batch
writes the same schema id, whatever was registered under the subject in between.

Order, all before the transaction begins (a registry that does not answer fails the batch
with nothing produced, retriably): the pinned id, if any, is read and its schema fetched by
id; otherwise the schema (`sink.value_schema`, or derived from the columns) is registered
under the subject and the id pinned in its own committed transaction (one statement: two
attempts at once pin the same id).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import psycopg2
import psycopg2.extensions

from offsetflow.config import KafkaSinkConfig, PipelineConfig, SchemaRegistryConfig
from offsetflow.errors import KafkaSinkError, OutputSchemaIncompatibleError, SchemaRegistryError
from offsetflow.ledger import Batch
from offsetflow.sinks.kafka.avro_value import AvroValueEncoder, derive_schema
from offsetflow.sinks.kafka.form import payload_columns
from offsetflow.source import RegistryClient

log = logging.getLogger(__name__)


def output_subject(sink: KafkaSinkConfig, topic: str) -> str:
    """`sink.value_subject`, else `<output topic>-value` (Confluent's TopicNameStrategy)."""
    return sink.value_subject or f"{topic}-value"


def sink_registry(cfg: PipelineConfig) -> SchemaRegistryConfig:
    """`sink.schema_registry`, else the source's `format.schema_registry`."""
    assert cfg.sink.kafka is not None
    reg = cfg.sink.kafka.registry or cfg.registry
    if reg is None:  # the config parser refuses this
        raise KafkaSinkError(f"pipeline {cfg.name}: sink.value_format: avro needs "
                             f"sink.schema_registry in {cfg.source_file}")
    return reg


def value_schema(sink: KafkaSinkConfig, topic: str, columns: Mapping[str, str]
                 ) -> dict[str, object]:
    """The explicit `sink.value_schema`, else one derived from the value's columns."""
    if sink.value_schema:
        return dict(json.loads(sink.value_schema))
    fields = list(sink.value_columns) or payload_columns(list(columns))
    return derive_schema(topic, columns, fields)


def pinned_encoder(dsn: str, cur: psycopg2.extensions.cursor, cfg: PipelineConfig,
                   batch: Batch, topic: str, columns: Mapping[str, str]) -> AvroValueEncoder:
    """The encoder of the batch's pinned schema id (pinning it on the first attempt)."""
    sink = cfg.sink.kafka
    assert sink is not None
    reg = sink_registry(cfg)
    client = RegistryClient(reg.url, reg.username, reg.password, float(reg.timeout_s))
    subject = output_subject(sink, topic)
    cur.execute("SELECT schema_id, subject FROM offsetflow.output_schemas WHERE batch_id = %s",
                (batch.batch_id,))
    row = cur.fetchone()
    if row is None:
        schema = value_schema(sink, topic, columns)
        text = json.dumps(schema, separators=(",", ":"))
        sid = client.register(subject, text)
        if sid is None:
            latest = client.subject_version(subject, None)
            raise OutputSchemaIncompatibleError(
                client.shown, subject,
                "unknown" if latest is None else
                f"version {latest.version}, schema id {latest.schema_id}: {latest.schema}",
                text)
        pinned = _pin(dsn, batch.batch_id, subject, sid)
        if pinned == sid:
            log.info("batch %d: value schema id %d of subject %s pinned", batch.batch_id,
                     sid, subject)
            return AvroValueEncoder(schema, sid)
        row = (pinned, subject)  # another attempt pinned first: write its id
    sid, pinned_subject = int(row[0]), str(row[1])
    found = client.schema_by_id(sid)
    if found is None or found.schema_type != "AVRO":
        raise SchemaRegistryError(client.shown, f"schema id {sid}",
                                  f"the batch's pinned Avro value schema (subject "
                                  f"{pinned_subject!r}) is not in the registry; restore it "
                                  f"there (the batch must write the id it pinned)",
                                  retriable=False)
    log.info("batch %d: writing its pinned value schema id %d (subject %s)", batch.batch_id,
             sid, pinned_subject)
    return AvroValueEncoder(json.loads(found.schema), sid)


def _pin(dsn: str, batch_id: int, subject: str, schema_id: int) -> int:
    """The batch's pinned schema id: `schema_id` unless another attempt pinned one first;
    committed at once, in a connection of its own (see the module's docstring)."""
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as c:
            c.execute("""INSERT INTO offsetflow.output_schemas (batch_id, subject, schema_id)
                         VALUES (%s, %s, %s) ON CONFLICT (batch_id) DO NOTHING""",
                      (batch_id, subject, schema_id))
            c.execute("SELECT schema_id FROM offsetflow.output_schemas WHERE batch_id = %s",
                      (batch_id,))
            found = c.fetchone()
    finally:
        conn.close()
    return int(found[0]) if found else schema_id
