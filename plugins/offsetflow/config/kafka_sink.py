"""The `sink:` section of a pipeline whose sink is a Kafka topic (`sink.type: kafka`): the
output and replay topics, how a staged row becomes a record (key, value format and
columns, headers, partitioning) and the producer settings OffsetFlow leaves to the user.
Pure, like `config_parse`, which calls it; the sink itself is `offsetflow.sinks.kafka.sink`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from offsetflow.config.fields import FieldReader, did_you_mean, validate_identifier
from offsetflow.config.schema import (
    RESERVED_COLUMNS,
    TOPIC_RE,
    KafkaSinkConfig,
    SchemaRegistryConfig,
)
from offsetflow.config.tables import choices, section_fields

# a table's sink fields: refused with their own message (the sink's topic is sink.topic)
KAFKA_REFUSED = {"table", "mode", "key"}
# what the sink sets itself (offsetflow.sinks.kafka.sink): the transaction and its fencing
FORBIDDEN_PRODUCER_KEYS = {"transactional.id", "enable.idempotence", "bootstrap.servers"}


def parse_kafka_sink(r: FieldReader, sec: Mapping[str, Any], schema: Mapping[str, str],
                     format_type: str, transform: str | None,
                     columns_known: bool = True, has_registry: bool = False
                     ) -> KafkaSinkConfig:
    """`sink.type: kafka`. Columns are checked against format.schema when the config alone
    decides them (json format, no transform, `columns_known`: format.schema has no error);
    a transform's columns are checked at run time."""
    for fld in ("table", "mode", "key"):
        if sec.get(fld) is not None:
            r.fail(f"sink.{fld}", "is for sink.type: postgres; a Kafka sink writes "
                                  "sink.topic (record key: sink.key_column)", at_key=True)
    topics = {}
    for fld in ("topic", "replay_topic"):
        t = r.string(sec, fld, "sink.")
        if t is not None and r.ok(f"sink.{fld}") and not TOPIC_RE.match(t):
            r.fail(f"sink.{fld}", f"{t!r} is not a valid Kafka topic name")
        topics[fld] = t
    if sec.get("topic") is None:
        r.fail("sink.topic", "is required with sink.type: kafka (the output topic)")
    elif topics["replay_topic"] == topics["topic"]:
        r.fail("sink.replay_topic", "must differ from sink.topic: a replay into the live "
                                    "output topic would write its records a second time")
    known = None if transform or not columns_known else set(schema) | RESERVED_COLUMNS

    def column(fld: str, name: Any) -> str:
        col = r.attempt(validate_identifier, r.source, fld, name)
        if col is not None and known is not None and col not in known:
            r.fail(fld, f"{col!r} is not a column (format.schema or a source column "
                        f"{sorted(RESERVED_COLUMNS)}){did_you_mean(col, known)}")
        return str(name)

    key_col = sec.get("key_column")
    value_format = r.string(sec, "value_format", "sink.", "json",
                            choices("sink.value_format")) or "json"
    cols_raw = sec.get("value_columns") or []
    if isinstance(cols_raw, str):
        cols_raw = [cols_raw]
    if not isinstance(cols_raw, list):
        r.fail("sink.value_columns", "must be a list of column names")
        cols_raw = []
    value_cols = tuple(column(f"sink.value_columns[{i}]", c) for i, c in enumerate(cols_raw))
    format_known = r.ok("sink.value_format")
    if format_known and value_cols and value_format == "raw":
        r.fail("sink.value_columns", "is for value_format: json or avro (raw takes "
                                     "value_column)")
    if format_known and sec.get("value_column") is not None and value_format != "raw":
        r.fail("sink.value_column", "is for value_format: raw (json takes value_columns)")
    if format_known and value_format in ("json", "avro") and not value_cols \
            and not transform and not schema and columns_known:
        r.fail("sink.value_columns", f"raw format has no typed columns to write as "
                                     f"{value_format}: use value_format: raw, or list "
                                     f"value_columns")
    registry = _avro_settings(r, sec, value_format if format_known else None, has_registry)
    producer_raw = sec.get("producer") or {}
    if not isinstance(producer_raw, Mapping):
        r.fail("sink.producer", "must be a mapping of librdkafka producer settings")
        producer_raw = {}
    producer: dict[str, str] = {}
    for k, v in producer_raw.items():
        if k in FORBIDDEN_PRODUCER_KEYS:
            r.fail(f"sink.producer.{k}", "is set by OffsetFlow (the batch's transaction "
                                         "and its fencing depend on it) and may not be set",
                   at_key=True)
        elif isinstance(v, (Mapping, list)):
            r.fail(f"sink.producer.{k}", "must be a scalar")
        else:
            producer[str(k)] = r.resolve(str(v).lower() if isinstance(v, bool) else str(v),
                                         f"sink.producer.{k}")
    task_files = _task_files(r, sec)
    task_files_auto = task_files in (None, "auto")
    if task_files in (None, "auto", "off"):
        task_files = None
    elif r.ok("sink.task_files"):
        why = task_files_problem(task_files)
        if why:
            r.fail("sink.task_files", why)
    return KafkaSinkConfig(
        topic=topics["topic"] or "", replay_topic=topics["replay_topic"],
        key_column=None if key_col is None else column("sink.key_column", key_col),
        value_format=value_format, value_columns=value_cols,
        value_column=column("sink.value_column", sec.get("value_column", "value")),
        headers=r.string(sec, "headers", "sink.", "carry", choices("sink.headers")) or "carry",
        partitioning=r.string(sec, "partitioning", "sink.", "key",
                              choices("sink.partitioning")) or "key",
        producer=producer, value_subject=r.string(sec, "value_subject", "sink."),
        value_schema=r.string(sec, "value_schema", "sink."), registry=registry,
        task_files=task_files, task_files_auto=task_files_auto,
        task_files_mode=_task_files_mode(r, sec))


def _task_files(r: FieldReader, sec: Mapping[str, Any]) -> str | None:
    """`sink.task_files`: `auto`, `off` or a directory. Unquoted, YAML 1.1 reads `off` (and
    `no`, `false`) as the boolean false: that is `off`, as written; its true (`on`, `yes`)
    names no choice and is refused naming the three."""
    raw = sec.get("task_files")
    if raw is False:
        return "off"
    if raw is True:
        r.fail("sink.task_files", "YAML read the unquoted value as true: write auto (the "
                                  "default), off, or an absolute directory")
        return None
    return r.string(sec, "task_files", "sink.")


def _task_files_mode(r: FieldReader, sec: Mapping[str, Any]) -> int:
    """`sink.task_files_mode`, a quoted octal string. Unquoted, YAML reads 0644 as the
    number 420 (octal) and 644 as 644: refused naming the quoted form, not "got 420"."""
    raw = sec.get("task_files_mode")
    if isinstance(raw, int) and not isinstance(raw, bool):
        quoted = [f"'{c}'" for c in choices("sink.task_files_mode") or ()
                  if int(c, 8) == raw or c == f"0{raw}"]
        r.fail("sink.task_files_mode",
               f"must be a quoted octal string (YAML read the unquoted value as the number "
               f"{raw})" + (f": write {quoted[0]}" if quoted else ""))
        return 0o640
    return int(r.string(sec, "task_files_mode", "sink.", "0640",
                        choices("sink.task_files_mode")) or "0640", 8)


def task_files_problem(directory: str) -> str:
    """Why `sink.task_files` cannot name the task files' directory ("" if it can): an
    absolute path (the executors resolve it, not the driver's working directory). Whether
    it exists and is writable is checked by the driver before each batch's read, not here:
    the config also loads on hosts without the executors' mount (the DAG processor, the CLI
    of `offsetflow abandon` or `complete`)."""
    if not os.path.isabs(directory):
        return (f"{directory!r} is not an absolute path: give a directory the driver and "
                f"every executor reach under the same path (or auto, the default, or off)")
    return ""


def _avro_settings(r: FieldReader, sec: Mapping[str, Any], value_format: str | None,
                   has_registry: bool) -> SchemaRegistryConfig | None:
    """`sink.value_subject`, `sink.value_schema` (an Avro schema's JSON text) and
    `sink.schema_registry` (url or conn_id, username, password, timeout_s): only for value_format:
    avro, which needs a registry, its own or format.schema_registry's."""
    fld = "sink.schema_registry"
    reg = sec.get("schema_registry")
    if isinstance(reg, Mapping):  # a misspelt key is named as such first
        r.unknown(reg, f"{fld}.", section_fields(fld))
    if value_format is not None and value_format != "avro":
        for name in ("value_subject", "value_schema", "schema_registry"):
            if sec.get(name) is not None:
                r.fail(f"sink.{name}", f"is for value_format: avro (it is {value_format})",
                       at_key=True)
        return None
    schema_text = sec.get("value_schema")
    if isinstance(schema_text, str):
        try:
            doc = json.loads(schema_text)
            if not isinstance(doc, dict) or doc.get("type") != "record":
                raise ValueError("not a record schema")
        except ValueError as e:
            r.fail("sink.value_schema", f"must be an Avro record schema as JSON text ({e})")
    if reg is None:
        if value_format == "avro" and not has_registry:
            r.fail(fld, "value_format: avro registers its schema in a schema registry: give "
                        "sink.schema_registry {url: http://host:8081} (or "
                        "format.schema_registry)")
        return None
    if not isinstance(reg, Mapping):
        r.fail(fld, f"must be a mapping (url, username, password, timeout_s), got "
                    f"{type(reg).__name__}")
        return None
    return r.registry(reg, fld)
