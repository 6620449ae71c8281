"""The Kafka sink's Avro value schema (`sink.value_format: avro`): registered (or found) in
the schema registry once per commit attempt on the driver, and pinned per batch in the
ledger (`offsetflow.output_schemas`, migration 0016) so every later attempt of the batch
writes the same schema id, whatever was registered under the subject in between.

Order, all before the transaction begins (a registry that does not answer fails the batch
with nothing produced, retriably): the pinned id, if any, is read and its schema fetched by
id; otherwise the schema (`sink.value_schema`, or derived from the columns) is registered
under the subject and the id pinned in its own committed transaction (one statement: two
attempts at once pin the same id).

A pin holds only for the registry, subject and schema it was registered for (`offered`,
migration 0017): an attempt whose config or columns make another schema (an accepted
config change, a transform's new column), or that uses another registry (its URL is no
part of the config's fingerprint; the same id there may be another subject's schema),
pins its own. Safe: `write` runs only when the batch's Kafka
transaction is not committed (`find`), so no record of the batch is visible with the old
id, and a zombie attempt still writing the old one is fenced by this attempt's producer.
Writing the old schema instead would drop the new columns and null the renamed ones.
"""

from __future__ import annotations

import hashlib
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


def value_schema(sink: KafkaSinkConfig, topic: str, columns: Mapping[str, str],
                 source_file: str = "") -> dict[str, object]:
    """The explicit `sink.value_schema`, else one derived from the value's columns. An
    explicit schema's fields must be value columns (a field filled from no column would be
    null in every record, or every record a dead letter)."""
    fields = list(sink.value_columns) or payload_columns(list(columns))
    if not sink.value_schema:
        return derive_schema(topic, columns, fields)
    schema = dict(json.loads(sink.value_schema))
    names = [str(f.get("name")) for f in schema.get("fields") or [] if isinstance(f, dict)]
    missing = [n for n in names if n not in fields]
    if missing:
        raise KafkaSinkError(
            f"sink.value_schema in {source_file or 'the pipeline config'}: field(s) "
            f"{missing} are no value column (the value's columns: {fields}); fields are "
            f"filled by name and nothing was produced. Rename the fields to columns, or add "
            f"the columns to sink.value_columns (or with a transform)")
    return schema


def offered_digest(registry: str, subject: str, text: str) -> str:
    """What a pin was registered for: the registry (its URL without credentials: an id
    means nothing in another registry, where it may be another subject's schema), the
    subject and the schema text offered."""
    return hashlib.sha256(f"{registry}\n{subject}\n{text}".encode()).hexdigest()


def pinned_encoder(dsn: str, cur: psycopg2.extensions.cursor, cfg: PipelineConfig,
                   batch: Batch, topic: str, columns: Mapping[str, str]) -> AvroValueEncoder:
    """The encoder of the batch's pinned schema id (pinning it on the first attempt)."""
    sink = cfg.sink.kafka
    assert sink is not None
    reg = sink_registry(cfg)
    client = RegistryClient(reg.url, reg.username, reg.password, float(reg.timeout_s))
    subject = output_subject(sink, topic)
    schema = value_schema(sink, topic, columns, cfg.source_file)
    text = json.dumps(schema, separators=(",", ":"))
    offered = offered_digest(client.shown, subject, text)
    cur.execute("SELECT schema_id, subject, offered FROM offsetflow.output_schemas "
                "WHERE batch_id = %s", (batch.batch_id,))
    row = cur.fetchone()
    if row is not None and row[2] is not None and row[2] != offered:
        log.warning("batch %d: its pinned value schema id %s (subject %s) was registered for "
                    "another registry, subject or schema than this attempt's (the config or "
                    "the columns changed); nothing of the batch is in Kafka: registering and "
                    "pinning this attempt's", batch.batch_id, row[0], row[1])
        row = None
    if row is None:
        sid = client.register(subject, text)
        if sid is None:
            latest = client.subject_version(subject, None)
            raise OutputSchemaIncompatibleError(
                client.shown, subject,
                "unknown" if latest is None else
                f"version {latest.version}, schema id {latest.schema_id}: {latest.schema}",
                text)
        pinned = pin_schema(dsn, batch.batch_id, subject, sid, offered)
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


def pin_schema(dsn: str, batch_id: int, subject: str, schema_id: int, offered: str) -> int:
    """The batch's pinned schema id: `schema_id` unless another attempt pinned one for the
    same schema first (a pin for another is replaced); committed at once, in a connection
    of its own (see the module's docstring). Never another schema's id: two attempts that
    offer different schemas at once (a zombie of the old config) each write their own."""
    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as c:
            c.execute("""INSERT INTO offsetflow.output_schemas
                                (batch_id, subject, schema_id, offered)
                         VALUES (%s, %s, %s, %s)
                         ON CONFLICT (batch_id) DO UPDATE
                         SET subject = EXCLUDED.subject, schema_id = EXCLUDED.schema_id,
                             offered = EXCLUDED.offered, pinned_at = now()
                         WHERE output_schemas.offered IS DISTINCT FROM EXCLUDED.offered
                         RETURNING schema_id""", (batch_id, subject, schema_id, offered))
            if c.fetchone() is not None:  # ours: inserted, or another schema's replaced
                return schema_id
            c.execute("SELECT schema_id FROM offsetflow.output_schemas "
                      "WHERE batch_id = %s AND offered = %s", (batch_id, offered))
            found = c.fetchone()  # the same schema's, pinned first
    finally:
        conn.close()
    return int(found[0]) if found else schema_id
