"""Parsing of a pipeline config: every error names the file and the dotted field, so a
broken config is fixed in one go. Pure: no file is read here (config.load_pipeline does).
`${VAR}` / `${VAR:-default}` are resolved from the given environment so secrets stay out of
the YAML. The whole document and its sections are parsed here, on the field reader of
`config_fields`; a Kafka sink's section by `sink_kafka_config`, an Iceberg sink's by
`sink_iceberg_config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from offsetflow.config.fields import (
    FieldReader,
    did_you_mean,
    validate_identifier,
    validate_table_name,
)
from offsetflow.config.iceberg_sink import column_kind, parse_iceberg
from offsetflow.config.kafka_sink import KAFKA_REFUSED, parse_kafka_sink
from offsetflow.config.schema import (
    AVRO_FIELD_TYPES,
    DECIMAL_RE,
    DEFAULT_MAX_OFFSETS_PER_TASK,
    DOTTED_RE,
    FIELD_TYPES,
    FORBIDDEN_CLIENT_KEYS,
    IDENT_RE,
    NAME_RE,
    REGISTRY_FORMATS,
    RESERVED_COLUMNS,
    TOMBSTONE_POLICIES,
    TOPIC_RE,
    TYPED_FORMATS,
    KafkaConfig,
    PipelineConfig,
    RateConfig,
    SchemaRegistryConfig,
    SinkConfig,
    SparkConfig,
    StartingPolicy,
    connect_address,
    default_tombstones,
)
from offsetflow.config.tables import FIELDS, choices, section_fields
from offsetflow.errors import ConfigError

TOPIC_HINT = " (letters, digits, '.', '_', '-'; at most 249 characters)"


@dataclass(frozen=True)
class Checked:
    """What checking a pipeline document found: the config when there is no error; the
    errors and warnings (an unset `${VAR}` when not `strict_env`) in the parser's order."""

    config: PipelineConfig | None
    errors: tuple[ConfigError, ...]
    warnings: tuple[ConfigError, ...]


def parse_pipeline(raw: Any, source: str, env: Mapping[str, str] | None = None) -> PipelineConfig:
    """Validate a parsed YAML document; `source` names the file in every error. Raises one
    ConfigError carrying every error found (`errors`), the first's field and message its own."""
    checked = check_pipeline(raw, source, env)
    if checked.config is None:
        raise ConfigError.of(checked.errors)
    return checked.config


def check_pipeline(raw: Any, source: str, env: Mapping[str, str] | None = None,
                   strict_env: bool = True) -> Checked:
    """Every error of a parsed YAML document, without raising. `strict_env=False`: an unset
    `${VAR}` without a default is a warning, not an error (the file is checked away from the
    environment it runs in)."""
    env = os.environ if env is None else env
    if not isinstance(raw, Mapping):
        what = "the file is empty" if raw is None else f"got a {_kind(raw)}"
        return Checked(None, (ConfigError(source, "<root>", f"a pipeline config must be a YAML "
                                                            f"mapping; {what}"),), ())
    r = FieldReader(raw, source, env, strict_env)
    cfg = _parse(r, raw)
    return Checked(None if r.errors else cfg, tuple(r.errors), tuple(r.warnings))


def _kind(v: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number",
            bool: "boolean"}.get(type(v), type(v).__name__)


def _parse(r: FieldReader, raw: Mapping[str, Any]) -> PipelineConfig:
    """The whole document, section by section; the result is meaningful only without
    errors (a bad value reads on as its default)."""
    source = r.source
    r.unknown(raw, "", section_fields(""))
    stem = Path(source).stem
    name = r.string(raw, "name", "", default=stem) or stem
    if r.ok("name") and not NAME_RE.match(name):
        r.fail("name", f"{name!r} must match {NAME_RE.pattern} (it names DAGs and ledger rows)")

    bootstrap, isolation, kafka_conn = "", "read_committed", None
    client: dict[str, str] = {}
    with r.guard():
        bootstrap, isolation, client, kafka_conn = _kafka(r)

    topics: tuple[str, ...] = ()
    pattern: str | None = None
    starting = StartingPolicy(kind="earliest")
    per_partition, per_batch, data_loss = 100_000, None, "fail"
    rate = RateConfig()
    with r.guard():
        src = r.section("source")
        r.unknown(src, "source.", section_fields("source"))
        topics_raw = src.get("topics")
        pattern = r.string(src, "topic_pattern", "source.")
        if (topics_raw is None) == (src.get("topic_pattern") is None):
            r.fail("source.topics", "give exactly one of source.topics or source.topic_pattern")
        if isinstance(topics_raw, str):
            topics_raw = [topics_raw]
        if topics_raw is not None and (not isinstance(topics_raw, list) or not topics_raw):
            r.fail("source.topics", "must be a non-empty list of topic names")
        elif topics_raw is not None:
            for i, t in enumerate(topics_raw):
                if not isinstance(t, str) or not TOPIC_RE.match(t):
                    r.fail(f"source.topics[{i}]", f"{t!r} is not a valid Kafka topic name"
                                                  f"{TOPIC_HINT}")
            topics = tuple(dict.fromkeys(str(t) for t in topics_raw))
        if pattern is not None and r.ok("source.topic_pattern"):
            try:
                re.compile(pattern)
            except re.error as e:
                r.fail("source.topic_pattern", f"invalid regular expression: {e}")
        starting = r.attempt(_parse_starting, r, src.get("starting", "earliest")) or starting
        per_partition = r.positive_int(src, "max_records_per_partition", "source.",
                                       100_000) or 100_000
        per_batch = r.positive_int(src, "max_records_per_batch", "source.", None)
        data_loss = r.string(src, "data_loss", "source.", "fail",
                             choices("source.data_loss")) or "fail"
        rate = r.attempt(_rate, r, src.get("rate"), raw.get("schedule")) or rate

    format_type = "json"
    schema: dict[str, str] = {}
    registry: SchemaRegistryConfig | None = None
    key_format: str | None = None
    schema_known = False  # format.schema is as written: columns are checked against it
    with r.guard():
        format_type, schema, registry, key_format = _format(r)
        schema_known = r.ok("format.type")

    transform = r.string(raw, "transform", "")
    if transform is not None and r.ok("transform") and not DOTTED_RE.match(transform):
        r.fail("transform", f"{transform!r} must be a dotted path 'package.module.function'")

    sink_type, connection, sink_conn = "postgres", "", None
    table, mode = "", "append"
    key: tuple[str, ...] = ()
    mode_known = False  # sink.mode is as written: what depends on it is checked
    kafka_sink = None
    iceberg = None
    with r.guard():
        sink_raw = r.section("sink")
        sink_type = r.string(sink_raw, "type", "sink.", "postgres",
                             choices("sink.type")) or "postgres"
        type_known = r.ok("sink.type")
        mine = section_fields("sink", sink_type if type_known else None)
        others = {k: f"for sink.type {sink_type}; it is a field of sink.type "
                     + ", ".join(FIELDS[f"sink.{k}"].sinks) for k in section_fields("sink") - mine}
        r.unknown(sink_raw, "sink.", mine | (KAFKA_REFUSED if sink_type == "kafka" else set()),
                  others)
        sink_conn = r.conn_id(sink_raw, "sink.", "connection")
        given = "connection" in sink_raw
        connection = r.string(
            sink_raw, "connection", "sink.",
            None if sink_raw.get("conn_id") is not None else "${OFFSETFLOW_PG_DSN}",
            hint="" if given else " (give sink.connection, or sink.conn_id naming an Airflow "
                                  "postgres connection)") or ""
        if r.ok("sink.connection") and not connection.strip() \
                and sink_raw.get("conn_id") is None:
            r.fail("sink.connection", "must not be empty (or give sink.conn_id, an Airflow "
                                      "postgres connection)")
        if type_known and sink_type == "kafka":
            kafka_sink = parse_kafka_sink(r, sink_raw, schema, format_type, transform,
                                          columns_known=schema_known,
                                          has_registry=registry is not None)
            # batches record where they write; a Kafka sink's "table" is its topic
            table = f"kafka:{kafka_sink.topic}"
            mode_known = True
        elif type_known:  # a table: PostgreSQL or Iceberg
            table, mode, key = _table_sink(r, sink_raw, schema if schema_known else None,
                                           format_type, transform)
            mode_known = r.ok("sink.mode")
            if sink_type == "iceberg":
                iceberg = parse_iceberg(
                    r, sink_raw, table, mode,
                    None if transform or not schema_known
                    else _table_columns(format_type, schema))

    evolution = _schema_evolution(r, raw, format_type if schema_known else None,
                                  sink_type, transform)
    bad_records = r.string(raw, "bad_records", "", "fail", choices("bad_records")) or "fail"
    tombstones = r.string(raw, "tombstones", "") or ""
    allowed = TOMBSTONE_POLICIES[mode]
    if tombstones and r.ok("tombstones") and mode_known and sink_type != "kafka" \
            and tombstones not in allowed:
        r.fail("tombstones", f"{tombstones!r} is not a tombstone policy of sink.mode {mode}; "
                             f"use one of {list(allowed)} (default "
                             f"{default_tombstones(mode, format_type)})"
                             f"{did_you_mean(tombstones, allowed)}")
    dlt = r.attempt(validate_table_name, source, "dead_letter_table",
                    raw.get("dead_letter_table", "offsetflow_dead_letter")) \
        or "offsetflow_dead_letter"

    spark = SparkConfig()
    with r.guard():
        spark = _spark(r)

    suite, q_policy = None, "fail"
    with r.guard():
        quality = r.section("quality", required=False)
        r.unknown(quality, "quality.", section_fields("quality"))
        suite = r.string(quality, "suite", "quality.")
        q_policy = r.string(quality, "on_failure", "quality.", "fail",
                            choices("quality.on_failure")) or "fail"
    if sink_type == "kafka" and q_policy == "dead_letter":
        r.fail("quality.on_failure", "a Kafka sink writes every staged row to its topic; "
                                     "rows that break the suite cannot be held back. Use "
                                     "on_failure: fail (the batch is not committed)")
    if sink_type == "kafka" and tombstones:
        r.fail("tombstones", "a Kafka sink forwards a tombstone (null value) as a "
                             "tombstone with its key; remove this field")

    schedule = raw.get("schedule")
    if schedule is not None and not isinstance(schedule, str):
        r.fail("schedule", "must be a cron expression, a preset like '@hourly', or null")
        schedule = None
    retries = r.positive_int(raw, "retries", "", 2, minimum=0)
    pool = r.string(raw, "pool", "")
    desc = raw.get("description", "")

    return PipelineConfig(
        name=name, source_file=source, bootstrap_servers=bootstrap,
        isolation_level=isolation, client=client, topics=topics,
        topic_pattern=pattern, starting=starting, max_records_per_partition=per_partition,
        max_records_per_batch=per_batch, data_loss=data_loss,
        format_type=format_type, schema=schema, transform=transform,
        sink=SinkConfig(type=sink_type, connection=connection,
                        table=table, mode=mode, key=key, conn_id=sink_conn,
                        kafka=kafka_sink, iceberg=iceberg),
        bad_records=bad_records, dead_letter_table=dlt, spark=spark,
        schedule=schedule, retries=retries if retries is not None else 2, pool=pool,
        quality_suite=suite, quality_policy=q_policy, description=str(desc or ""),
        tombstones=tombstones, kafka=KafkaConfig(conn_id=kafka_conn), registry=registry,
        key_format=key_format, schema_evolution=evolution, rate=rate,
    )


def _schema_evolution(r: FieldReader, raw: Mapping[str, Any], format_type: str | None,
                      sink_type: str, transform: str | None) -> str | None:
    """`format.schema_evolution`: add_columns | fail (None: format.schema's columns only,
    other fields of the records ignored). Avro, Protobuf or JSON Schema values into
    PostgreSQL or Iceberg (append or upsert) on the fused path: the reader schema
    (Protobuf, JSON Schema: the subject's latest) decides the added columns there, and the
    commit adds them with the rows (PostgreSQL: in its own transaction; Iceberg: in the
    snapshot's catalog commit)."""
    fmt = raw.get("format")
    fld = "format.schema_evolution"
    if not isinstance(fmt, Mapping) or fmt.get("schema_evolution") is None:
        return None
    value = r.string(fmt, "schema_evolution", "format.", None, choices(fld))
    if value is None or not r.ok(fld) or format_type is None:
        return None
    if format_type not in ("avro", "protobuf", "json_schema"):
        r.fail(fld, f"is for the schema-registry formats avro, protobuf and json_schema "
                    f"(the registry's schema decides the columns); format.type is "
                    f"{format_type}")
    elif sink_type not in ("postgres", "iceberg"):
        r.fail(fld, f"is built for sink.type postgres and iceberg only (their commit adds "
                    f"the columns with the rows); sink.type is {sink_type}")
    elif transform:
        r.fail(fld, "does not work with a transform yet (the transform decides the columns); "
                    "remove one of them")
    return value


def schedule_interval_s(schedule: Any) -> float | None:
    """The interval of a cron expression or preset, in seconds (the shortest gap between
    its next ticks after a fixed instant, so it does not depend on when it is asked); None
    for no schedule, `@once`, `@continuous` or what croniter cannot read."""
    if not isinstance(schedule, str) or schedule.strip() in ("@once", "@continuous"):
        return None
    from croniter import croniter

    try:
        it = croniter(schedule.strip(), datetime(2024, 1, 1, tzinfo=UTC))
        ticks = [it.get_next(float) for _ in range(8)]
    except (ValueError, KeyError, TypeError):
        return None
    return min(b - a for a, b in zip(ticks, ticks[1:], strict=False))


def _rate(r: FieldReader, raw: Any, schedule: Any) -> RateConfig:
    """`source.rate`; `adaptive: pid` needs an interval: `interval_s`, or the schedule's."""
    if raw is None:
        return RateConfig()
    fld = "source.rate"
    if not isinstance(raw, Mapping):
        raise r.err(fld, f"must be a mapping like {{adaptive: pid}}, got {type(raw).__name__}")
    r.unknown(raw, f"{fld}.", section_fields(fld))
    d = RateConfig()
    adaptive = r.string(raw, "adaptive", f"{fld}.", None, choices(f"{fld}.adaptive"))
    gains = {k: r.number(raw, k, f"{fld}.", getattr(d, k), exclusive=k == "min_rate")
             for k in ("proportional", "integral", "derived", "min_rate")}
    interval = r.number(raw, "interval_s", f"{fld}.", None, exclusive=True)
    if adaptive is None and r.ok(f"{fld}.adaptive") and set(raw) - {"adaptive"}:
        r.fail(f"{fld}.adaptive", "is required when source.rate is given (adaptive: pid)")
    if adaptive == "pid" and interval is None and r.ok(f"{fld}.interval_s"):
        interval = schedule_interval_s(schedule)
        if interval is None:
            r.fail(f"{fld}.adaptive", f"pid sizes a batch for the schedule's interval, but "
                                      f"schedule {schedule!r} has none; give a cron schedule "
                                      f"or source.rate.interval_s (seconds between batches)")
    return RateConfig(adaptive=adaptive, interval_s=interval,
                      **{k: v if v is not None else getattr(d, k) for k, v in gains.items()})


def _kafka(r: FieldReader) -> tuple[str, str, dict[str, str], str | None]:
    """The `kafka` section: brokers (or a connection id), isolation level, client settings."""
    kafka = r.section("kafka")
    r.unknown(kafka, "kafka.", section_fields("kafka"))
    kafka_conn = r.conn_id(kafka, "kafka.", "bootstrap_servers")
    by_conn = kafka.get("conn_id") is not None
    bootstrap = r.string(kafka, "bootstrap_servers", "kafka.", default=None if by_conn
                         else "${OFFSETFLOW_KAFKA_BOOTSTRAP:-127.0.0.1:19092}") or ""
    if r.ok("kafka.bootstrap_servers") and not bootstrap.strip() and not by_conn:
        r.fail("kafka.bootstrap_servers", "must not be empty (or give kafka.conn_id, an "
                                          "Airflow kafka connection)")
    isolation = r.string(kafka, "isolation_level", "kafka.", default="read_committed",
                         choices=choices("kafka.isolation_level")) or "read_committed"
    client_raw = kafka.get("client") or {}
    if not isinstance(client_raw, Mapping):
        raise r.err("kafka.client", "must be a mapping of librdkafka settings")
    client: dict[str, str] = {}
    for k, v in client_raw.items():
        fld = f"kafka.client.{k}"
        if k in FORBIDDEN_CLIENT_KEYS:
            r.fail(fld, "is managed by OffsetFlow (offsets live in the ledger; the reader "
                        "assigns and seeks) and may not be set", at_key=True)
        elif isinstance(v, (Mapping, list)):
            r.fail(fld, "must be a scalar")
        else:
            client[str(k)] = r.resolve(str(v).lower() if isinstance(v, bool) else str(v), fld)
    return bootstrap, isolation, client, kafka_conn


def _format(r: FieldReader
            ) -> tuple[str, dict[str, str], SchemaRegistryConfig | None, str | None]:
    """The `format` section: json, avro, json_schema or protobuf with its schema (every column
    written is kept, so the sink's checks of column names do not repeat an error of this
    section), the registry formats with their registry and optionally an Avro key, or raw."""
    fmt = r.section("format", required=False)
    r.unknown(fmt, "format.", section_fields("format"))
    format_type = r.string(fmt, "type", "format.", "json", choices("format.type")) or "json"
    schema: dict[str, str] = {}
    registry = _registry(r, fmt, format_type if r.ok("format.type") else None)
    key_format = _key(r, fmt, format_type if r.ok("format.type") else None)
    if not r.ok("format.type"):
        return format_type, schema, registry, key_format
    if format_type in TYPED_FORMATS:
        # `json` (any JSON value as jsonb) for every typed format; `uuid` for the binary ones
        types = AVRO_FIELD_TYPES if format_type in ("avro", "protobuf") \
            else FIELD_TYPES | {"json"}
        schema_raw = fmt.get("schema")
        if not isinstance(schema_raw, Mapping) or not schema_raw:
            raise r.err("format.schema", f"{format_type} format needs a schema: a mapping "
                                         f"field -> type (the target's columns)")
        for col, typ in schema_raw.items():
            fld = f"format.schema.{col}"
            t = str(typ).strip().lower()
            if not isinstance(col, str) or not IDENT_RE.match(col):
                r.fail(fld, f"{col!r} is not a valid column name (letters, digits and _, at "
                            f"most 63 characters)", at_key=True)
            elif col in RESERVED_COLUMNS:
                r.fail(fld, f"{col!r} is a reserved source column "
                            f"({sorted(RESERVED_COLUMNS)})", at_key=True)
            elif t in AVRO_FIELD_TYPES - FIELD_TYPES - {"json"} \
                    and format_type not in ("avro", "protobuf"):
                r.fail(fld, f"type {t!r} is for format.type avro only, or protobuf (the "
                            f"{format_type} format reads flat fields); use string")
            elif t not in types and not DECIMAL_RE.match(t):
                r.fail(fld, f"unknown type {typ!r}; use one of {sorted(types)} or "
                            f"decimal(p,s){did_you_mean(t, types)}")
            schema[str(col)] = t
    elif fmt.get("schema"):
        r.fail("format.schema", "raw format takes no schema")
    return format_type, schema, registry, key_format


def _key(r: FieldReader, fmt: Mapping[str, Any], format_type: str | None) -> str | None:
    """`format.key`: `{type: avro}` decodes each Kafka key (Confluent wire format, subject
    `<topic>-key`) and fills format.schema's columns from its fields (upsert keys, the key
    of a tombstone's delete). It reads through format.schema_registry."""
    fld = "format.key"
    sec = fmt.get("key")
    if sec is None:
        return None
    if not isinstance(sec, Mapping):
        r.fail(fld, f"must be a mapping {{type: avro}}, got {type(sec).__name__}")
        return None
    r.unknown(sec, f"{fld}.", section_fields(fld))
    key_type = r.string(sec, "type", f"{fld}.", None, choices(f"{fld}.type"))
    if key_type is None:
        if r.ok(f"{fld}.type"):
            r.fail(f"{fld}.type", "is required: avro (a Confluent wire-format Avro key)")
        return None
    if format_type is not None and format_type not in REGISTRY_FORMATS:
        r.fail(fld, f"an {key_type} key is read through a schema registry: it needs "
                    f"format.type avro, json_schema or protobuf with format.schema_registry "
                    f"(format.type is {format_type})", at_key=True)
        return None
    return key_type


def _registry(r: FieldReader, fmt: Mapping[str, Any], format_type: str | None
              ) -> SchemaRegistryConfig | None:
    """`format.schema_registry`: required by avro, refused by the other formats (its own
    keys are checked first, so a misspelt one is named as such)."""
    fld = "format.schema_registry"
    sec = fmt.get("schema_registry")
    if sec is not None and not isinstance(sec, Mapping):
        r.fail(fld, f"must be a mapping (url, username, password, reader_version), got "
                    f"{type(sec).__name__}")
        return None
    sec = sec or {}
    r.unknown(sec, f"{fld}.", section_fields(fld))
    if format_type is None:
        return None
    if format_type not in REGISTRY_FORMATS:
        if sec:
            r.fail(fld, f"is for format.type avro, json_schema or protobuf; {format_type} "
                        f"reads no registry", at_key=True)
        return None
    if not sec:
        r.fail(fld, f"{format_type} format needs a schema registry: {{url: http://host:8081}}"
                    f" (writer schemas are looked up by the id in each record)")
        return None
    reg = r.registry(sec, fld)
    version = r.positive_int(sec, "reader_version", f"{fld}.", None)
    if version is not None and format_type != "avro":
        r.fail(f"{fld}.reader_version", f"pins an Avro reader schema; {format_type} records "
                                        f"are read as written (remove it)")
    return replace(reg, reader_version=version)


def _table_sink(r: FieldReader, sec: Mapping[str, Any], schema: Mapping[str, str] | None,
                format_type: str, transform: str | None) -> tuple[str, str, tuple[str, ...]]:
    """A table's sink (PostgreSQL, Iceberg): table, mode and upsert key. `schema`: None when
    format.schema has errors (its columns are not checked against)."""
    source = r.source
    table = ""
    if sec.get("table") is None:
        r.fail("sink.table", "is required: a table name like 'orders' or 'raw.orders'")
    else:
        table = r.attempt(validate_table_name, source, "sink.table", sec["table"]) or ""
    mode = r.string(sec, "mode", "sink.", "append", choices("sink.mode")) or "append"
    key_raw = sec.get("key") or []
    if isinstance(key_raw, str):
        key_raw = [key_raw]
    if not isinstance(key_raw, list):
        r.fail("sink.key", "must be a column name or a list of them")
        key_raw = []
    key = tuple(k for i, k in enumerate(key_raw)
                if r.attempt(validate_identifier, source, f"sink.key[{i}]", k) is not None)
    if not r.ok("sink.mode"):
        return table, mode, key
    if mode == "upsert":
        if not key_raw:
            r.fail("sink.key", "upsert mode needs a key (one or more columns)")
        known = set(schema or ()) | RESERVED_COLUMNS
        for i, k in enumerate(key_raw):
            if format_type in TYPED_FORMATS and transform is None and schema is not None \
                    and r.ok(f"sink.key[{i}]") and k not in known:
                r.fail(f"sink.key[{i}]", f"{k!r} is not a column of format.schema"
                                         f"{did_you_mean(k, known)}")
    elif key_raw:
        r.fail("sink.key", "a key is only used with mode: upsert")
    return table, mode, key


def _spark(r: FieldReader) -> SparkConfig:
    spark_raw = r.section("spark", required=False)
    r.unknown(spark_raw, "spark.", section_fields("spark"))
    spark_conf = spark_raw.get("conf") or {}
    if not isinstance(spark_conf, Mapping):
        r.fail("spark.conf", "must be a mapping of Spark settings")
        spark_conf = {}
    connect_url = r.string(spark_raw, "connect_url", "spark.", "sc://127.0.0.1:15002") \
        or "sc://127.0.0.1:15002"
    if r.ok("spark.connect_url"):
        try:
            connect_address(connect_url)
        except ValueError as e:
            r.fail("spark.connect_url", str(e))
    return SparkConfig(
        master=r.string(spark_raw, "master", "spark.", "local[2]") or "local[2]",
        max_offsets_per_task=r.positive_int(spark_raw, "max_offsets_per_task", "spark.",
                                            DEFAULT_MAX_OFFSETS_PER_TASK)
        or DEFAULT_MAX_OFFSETS_PER_TASK,
        conf={str(k): str(v) for k, v in spark_conf.items()},
        launch=r.string(spark_raw, "launch", "spark.", "submit", choices("spark.launch"))
        or "submit",
        connect_url=connect_url,
    )


def _table_columns(format_type: str | None, schema: Mapping[str, str]) -> dict[str, str]:
    """The target's columns without a transform and their Iceberg types: the source
    columns, then the schema's."""
    source = {"topic": "string", "partition": "int", "offset": "long",
              "timestamp": "timestamptz", "timestamp_type": "int", "key": "binary",
              "value": "binary", "headers": "string"}  # headers: JSON text
    return {**source, **({c: column_kind(t) for c, t in schema.items()}
                         if format_type in TYPED_FORMATS else {})}


def _utc_ms(dt: datetime) -> int:
    """Epoch ms of a start time; a time without a zone is UTC, never the machine's zone
    (YAML gives an unquoted one as a naive datetime, a quoted one as a string: same rule)."""
    return int((dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp() * 1000)


def _parse_starting(r: FieldReader, v: Any) -> StartingPolicy:
    fld = "source.starting"
    if v in ("earliest", "latest"):
        return StartingPolicy(kind=v)
    if isinstance(v, Mapping) and len(v) == 1 and "timestamp" in v:
        ts = v["timestamp"]
        if isinstance(ts, datetime):  # unquoted in YAML
            return StartingPolicy("timestamp", timestamp_ms=_utc_ms(ts))
        if isinstance(ts, int) and not isinstance(ts, bool) and ts >= 0:
            return StartingPolicy("timestamp", timestamp_ms=ts)
        if isinstance(ts, str):
            try:
                dt = datetime.fromisoformat(ts.strip().replace("Z", "+00:00"))
            except ValueError as e:
                raise r.err(f"{fld}.timestamp", f"{ts!r} is not an ISO-8601 time") from e
            return StartingPolicy("timestamp", timestamp_ms=_utc_ms(dt))
        raise r.err(f"{fld}.timestamp", "must be epoch milliseconds or an ISO-8601 time")
    if isinstance(v, Mapping) and len(v) == 1 and "offsets" in v:
        offs = v["offsets"]
        if not isinstance(offs, Mapping):
            raise r.err(f"{fld}.offsets", "must map topic -> {partition: offset}")
        parsed: dict[str, dict[int, int]] = {}
        for topic, parts in offs.items():
            if not isinstance(parts, Mapping):
                raise r.err(f"{fld}.offsets.{topic}", "must map partition -> offset")
            parsed[str(topic)] = {}
            for p, o in parts.items():
                try:
                    pi, oi = int(p), int(o)
                except (TypeError, ValueError) as e:
                    raise r.err(f"{fld}.offsets.{topic}.{p}", "partition and offset must be "
                                                              "integers") from e
                if pi < 0 or oi < 0:
                    raise r.err(f"{fld}.offsets.{topic}.{p}", "must not be negative")
                parsed[str(topic)][pi] = oi
        return StartingPolicy("offsets", offsets=parsed)
    raise r.err(fld, f"{v!r}: use earliest, latest, {{timestamp: ...}} or {{offsets: ...}}")
