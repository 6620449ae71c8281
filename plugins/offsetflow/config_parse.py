"""Parsing of a pipeline config: every error names the file and the dotted field, so a
broken config is fixed in one go. Pure: no file is read here (config.load_pipeline does).
`${VAR}` / `${VAR:-default}` are resolved from the given environment so secrets stay out of
the YAML.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from offsetflow.config_schema import (
    CONN_ID_RE,
    DECIMAL_RE,
    DEFAULT_MAX_OFFSETS_PER_TASK,
    DOTTED_RE,
    ENV_RE,
    FIELD_TYPES,
    FORBIDDEN_CLIENT_KEYS,
    IDENT_RE,
    ISOLATION_LEVELS,
    NAME_RE,
    RESERVED_COLUMNS,
    TOMBSTONE_POLICIES,
    TOPIC_RE,
    KafkaConfig,
    KafkaSinkConfig,
    PipelineConfig,
    SinkConfig,
    SparkConfig,
    StartingPolicy,
    connect_address,
    default_tombstones,
)
from offsetflow.errors import ConfigError
from offsetflow.sink_iceberg_config import parse_iceberg

ICEBERG_FIELDS = ("catalog", "partition_by", "sort_by", "target_file_mb")


def validate_table_name(source: str, fld: str, table: Any) -> str:
    if not isinstance(table, str) or not table:
        raise ConfigError(source, fld, "must be a table name like 'orders' or 'raw.orders'")
    parts = table.split(".")
    if len(parts) > 2 or not all(IDENT_RE.match(p) for p in parts):
        raise ConfigError(
            source, fld,
            f"{table!r} is not a valid table name (letters, digits and _, optionally "
            f"'schema.table', each part at most 63 characters)",
        )
    return table


def validate_identifier(source: str, fld: str, name: Any) -> str:
    if not isinstance(name, str) or not IDENT_RE.match(name):
        raise ConfigError(source, fld, f"{name!r} is not a valid column name "
                                       f"(letters, digits and _, at most 63 characters)")
    return name


def resolve_env(value: str, source: str, fld: str, env: Mapping[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        if var in env:
            return env[var]
        if default is not None:
            return default
        raise ConfigError(source, fld, f"environment variable {var} is not set")

    return ENV_RE.sub(sub, value)


class _Reader:
    """Walks the raw mapping and reports errors with their dotted path."""

    def __init__(self, raw: Mapping[str, Any], source: str, env: Mapping[str, str]) -> None:
        self.raw = raw
        self.source = source
        self.env = env

    def err(self, fld: str, msg: str) -> ConfigError:
        return ConfigError(self.source, fld, msg)

    def section(self, name: str, required: bool = True) -> Mapping[str, Any]:
        v = self.raw.get(name)
        if v is None:
            if required:
                raise self.err(name, "is required")
            return {}
        if not isinstance(v, Mapping):
            raise self.err(name, f"must be a mapping, got {type(v).__name__}")
        return v

    def unknown(self, sec: Mapping[str, Any], prefix: str, allowed: set[str]) -> None:
        extra = sorted(set(sec) - allowed)
        if extra:
            raise self.err(f"{prefix}{extra[0]}", f"unknown field; allowed: {sorted(allowed)}")

    def string(self, sec: Mapping[str, Any], key: str, prefix: str, default: str | None = None,
               choices: set[str] | None = None) -> str | None:
        v = sec.get(key, default)
        if v is None:
            return None
        if not isinstance(v, str):
            raise self.err(prefix + key, f"must be a string, got {v!r}")
        v = resolve_env(v, self.source, prefix + key, self.env)
        if choices is not None and v not in choices:
            raise self.err(prefix + key, f"{v!r} is not one of {sorted(choices)}")
        return v

    def conn_id(self, sec: Mapping[str, Any], prefix: str, literal: str) -> str | None:
        """An Airflow connection id, given instead of (never beside) the literal field."""
        v = self.string(sec, "conn_id", prefix)
        if v is not None and not CONN_ID_RE.match(v):
            raise self.err(prefix + "conn_id", f"{v!r} is not an Airflow connection id "
                                               f"(letters, digits, '_', '.', '-')")
        if v is not None and sec.get(literal) is not None:
            raise self.err(prefix + literal, f"give either {prefix}conn_id or "
                                             f"{prefix}{literal}, not both")
        return v

    def positive_int(self, sec: Mapping[str, Any], key: str, prefix: str,
                     default: int | None, minimum: int = 1) -> int | None:
        v = sec.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.err(prefix + key, f"must be an integer >= {minimum}, got {v!r}")
        return v


def parse_pipeline(raw: Any, source: str, env: Mapping[str, str] | None = None) -> PipelineConfig:
    """Validate a parsed YAML document; `source` names the file in every error."""
    env = os.environ if env is None else env
    if not isinstance(raw, Mapping):
        raise ConfigError(source, "<root>", "a pipeline config must be a YAML mapping")
    r = _Reader(raw, source, env)
    r.unknown(raw, "", {"name", "description", "schedule", "retries", "pool", "kafka", "source",
                        "format", "transform", "sink", "bad_records", "dead_letter_table",
                        "spark", "quality", "tombstones"})
    stem = Path(source).stem
    name = r.string(raw, "name", "", default=stem) or stem
    if not NAME_RE.match(name):
        raise r.err("name", f"{name!r} must match {NAME_RE.pattern} "
                            f"(it names DAGs and ledger rows)")

    kafka = r.section("kafka")
    r.unknown(kafka, "kafka.", {"bootstrap_servers", "isolation_level", "client", "conn_id"})
    kafka_conn = r.conn_id(kafka, "kafka.", "bootstrap_servers")
    bootstrap = r.string(kafka, "bootstrap_servers", "kafka.", default=None if kafka_conn
                         else "${OFFSETFLOW_KAFKA_BOOTSTRAP:-127.0.0.1:19092}") or ""
    if not bootstrap.strip() and not kafka_conn:
        raise r.err("kafka.bootstrap_servers", "must not be empty (or give kafka.conn_id, "
                                               "an Airflow kafka connection)")
    isolation = r.string(kafka, "isolation_level", "kafka.", default="read_committed",
                         choices=ISOLATION_LEVELS)
    client_raw = kafka.get("client") or {}
    if not isinstance(client_raw, Mapping):
        raise r.err("kafka.client", "must be a mapping of librdkafka settings")
    client: dict[str, str] = {}
    for k, v in client_raw.items():
        if k in FORBIDDEN_CLIENT_KEYS:
            raise r.err(f"kafka.client.{k}", "is managed by OffsetFlow (offsets live in the "
                                             "ledger; the reader assigns and seeks) and may "
                                             "not be set")
        if isinstance(v, (Mapping, list)):
            raise r.err(f"kafka.client.{k}", "must be a scalar")
        client[str(k)] = resolve_env(str(v).lower() if isinstance(v, bool) else str(v),
                                     source, f"kafka.client.{k}", env)

    src = r.section("source")
    r.unknown(src, "source.", {"topics", "topic_pattern", "starting", "max_records_per_partition",
                               "max_records_per_batch", "data_loss"})
    topics_raw = src.get("topics")
    pattern = r.string(src, "topic_pattern", "source.")
    if (topics_raw is None) == (pattern is None):
        raise r.err("source.topics", "give exactly one of source.topics or source.topic_pattern")
    topics: tuple[str, ...] = ()
    if topics_raw is not None:
        if isinstance(topics_raw, str):
            topics_raw = [topics_raw]
        if not isinstance(topics_raw, list) or not topics_raw:
            raise r.err("source.topics", "must be a non-empty list of topic names")
        for i, t in enumerate(topics_raw):
            if not isinstance(t, str) or not TOPIC_RE.match(t):
                raise r.err(f"source.topics[{i}]", f"{t!r} is not a valid Kafka topic name")
        topics = tuple(dict.fromkeys(topics_raw))
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as e:
            raise r.err("source.topic_pattern", f"invalid regular expression: {e}") from e
    starting = _parse_starting(r, src.get("starting", "earliest"))
    per_partition = r.positive_int(src, "max_records_per_partition", "source.", 100_000)
    assert per_partition is not None
    per_batch = r.positive_int(src, "max_records_per_batch", "source.", None)
    data_loss = r.string(src, "data_loss", "source.", "fail", {"fail", "continue"})

    fmt = r.section("format", required=False)
    r.unknown(fmt, "format.", {"type", "schema"})
    format_type = r.string(fmt, "type", "format.", "json", {"json", "raw"})
    schema: dict[str, str] = {}
    if format_type == "json":
        schema_raw = fmt.get("schema")
        if not isinstance(schema_raw, Mapping) or not schema_raw:
            raise r.err("format.schema", "json format needs a schema: a mapping field -> type")
        for col, typ in schema_raw.items():
            validate_identifier(source, f"format.schema.{col}", col)
            if col in RESERVED_COLUMNS:
                raise r.err(f"format.schema.{col}", f"{col!r} is a reserved source column "
                                                    f"({sorted(RESERVED_COLUMNS)})")
            t = str(typ).strip().lower()
            if t not in FIELD_TYPES and not DECIMAL_RE.match(t):
                raise r.err(f"format.schema.{col}",
                            f"unknown type {typ!r}; use one of {sorted(FIELD_TYPES)} or "
                            f"decimal(p,s)")
            schema[str(col)] = t
    elif fmt.get("schema"):
        raise r.err("format.schema", "raw format takes no schema")

    transform = r.string(raw, "transform", "")
    if transform is not None and not DOTTED_RE.match(transform):
        raise r.err("transform", f"{transform!r} must be a dotted path 'package.module.function'")

    sink_raw = r.section("sink")
    sink_type = r.string(sink_raw, "type", "sink.", "postgres", {"postgres", "kafka", "iceberg"})
    r.unknown(sink_raw, "sink.", {"type", "connection", "table", "mode", "key", "conn_id"}
              | (KAFKA_SINK_FIELDS if sink_type == "kafka" else set())
              | (set(ICEBERG_FIELDS) if sink_type == "iceberg" else set()))
    sink_conn = r.conn_id(sink_raw, "sink.", "connection")
    try:
        connection = r.string(sink_raw, "connection", "sink.",
                              None if sink_conn else "${OFFSETFLOW_PG_DSN}")
    except ConfigError as e:
        if "connection" in sink_raw:
            raise
        raise r.err("sink.connection", f"{e.message} (give sink.connection, or sink.conn_id "
                                       f"naming an Airflow postgres connection)") from e
    if not (connection or "").strip() and not sink_conn:
        raise r.err("sink.connection", "must not be empty (or give sink.conn_id, an Airflow "
                                       "postgres connection)")
    kafka_sink = None
    if sink_type == "kafka":
        kafka_sink = _parse_kafka_sink(r, sink_raw, schema, format_type or "json", transform)
        # batches record where they write; a Kafka sink's "table" is its topic
        table = f"kafka:{kafka_sink.topic}"
        mode: str | None = "append"
        key_raw: Any = []
    else:
        table = validate_table_name(source, "sink.table", sink_raw.get("table"))
        mode = r.string(sink_raw, "mode", "sink.", "append", {"append", "upsert"})
        key_raw = sink_raw.get("key") or []
    if isinstance(key_raw, str):
        key_raw = [key_raw]
    key = tuple(validate_identifier(source, f"sink.key[{i}]", k) for i, k in enumerate(key_raw))
    if mode == "upsert":
        if not key:
            raise r.err("sink.key", "upsert mode needs a key (one or more columns)")
        known = set(schema) | RESERVED_COLUMNS
        for i, k in enumerate(key):
            if format_type == "json" and transform is None and k not in known:
                raise r.err(f"sink.key[{i}]", f"{k!r} is not a column of format.schema")
    elif key:
        raise r.err("sink.key", "a key is only used with mode: upsert")

    iceberg = None
    if sink_type == "iceberg":
        iceberg = parse_iceberg(sink_raw, source, table, mode or "append",
                                None if transform else _table_columns(format_type, schema))

    bad_records = r.string(raw, "bad_records", "", "fail", {"fail", "dead_letter"})
    tombstones = r.string(raw, "tombstones", "") or ""
    allowed = TOMBSTONE_POLICIES[mode or "append"]
    if tombstones and tombstones not in allowed:
        raise r.err("tombstones", f"{tombstones!r} is not a tombstone policy of sink.mode "
                                  f"{mode}; use one of {list(allowed)} (default "
                                  f"{default_tombstones(mode or 'append', format_type or 'json')})")
    dlt = validate_table_name(source, "dead_letter_table",
                              raw.get("dead_letter_table", "offsetflow_dead_letter"))

    spark_raw = r.section("spark", required=False)
    r.unknown(spark_raw, "spark.", {"master", "max_offsets_per_task", "conf", "launch",
                                    "connect_url"})
    spark_conf = spark_raw.get("conf") or {}
    if not isinstance(spark_conf, Mapping):
        raise r.err("spark.conf", "must be a mapping of Spark settings")
    connect_url = r.string(spark_raw, "connect_url", "spark.", "sc://127.0.0.1:15002") \
        or "sc://127.0.0.1:15002"
    try:
        connect_address(connect_url)
    except ValueError as e:
        raise r.err("spark.connect_url", str(e)) from e
    spark = SparkConfig(
        master=r.string(spark_raw, "master", "spark.", "local[2]") or "local[2]",
        max_offsets_per_task=r.positive_int(spark_raw, "max_offsets_per_task", "spark.",
                                            DEFAULT_MAX_OFFSETS_PER_TASK)
        or DEFAULT_MAX_OFFSETS_PER_TASK,
        conf={str(k): str(v) for k, v in spark_conf.items()},
        launch=r.string(spark_raw, "launch", "spark.", "submit", {"submit", "connect"})
        or "submit",
        connect_url=connect_url,
    )

    quality = r.section("quality", required=False)
    r.unknown(quality, "quality.", {"suite", "on_failure"})
    suite = r.string(quality, "suite", "quality.")
    q_policy = r.string(quality, "on_failure", "quality.", "fail", {"fail", "dead_letter"})
    if sink_type == "kafka" and q_policy == "dead_letter":
        raise r.err("quality.on_failure", "a Kafka sink writes every staged row to its topic; "
                                          "rows that break the suite cannot be held back. Use "
                                          "on_failure: fail (the batch is not committed)")
    if sink_type == "kafka" and tombstones:
        raise r.err("tombstones", "a Kafka sink forwards a tombstone (null value) as a "
                                  "tombstone with its key; remove this field")

    schedule = raw.get("schedule")
    if schedule is not None and not isinstance(schedule, str):
        raise r.err("schedule", "must be a cron expression, a preset like '@hourly', or null")
    retries = r.positive_int(raw, "retries", "", 2, minimum=0)
    pool = r.string(raw, "pool", "")
    desc = raw.get("description", "")

    return PipelineConfig(
        name=name, source_file=source, bootstrap_servers=bootstrap,
        isolation_level=isolation or "read_committed", client=client, topics=topics,
        topic_pattern=pattern, starting=starting, max_records_per_partition=per_partition,
        max_records_per_batch=per_batch, data_loss=data_loss or "fail",
        format_type=format_type or "json", schema=schema, transform=transform,
        sink=SinkConfig(type=sink_type or "postgres", connection=connection or "",
                        table=table, mode=mode or "append", key=key, conn_id=sink_conn,
                        kafka=kafka_sink, iceberg=iceberg),
        bad_records=bad_records or "fail", dead_letter_table=dlt, spark=spark,
        schedule=schedule, retries=retries if retries is not None else 2, pool=pool,
        quality_suite=suite, quality_policy=q_policy or "fail", description=str(desc or ""),
        tombstones=tombstones, kafka=KafkaConfig(conn_id=kafka_conn),
    )


def _table_columns(format_type: str | None, schema: Mapping[str, str]) -> list[str]:
    """The target's columns without a transform: the source columns, then the schema's."""
    return ["topic", "partition", "offset", "timestamp", "timestamp_type", "key", "value",
            "headers", *(schema if format_type == "json" else ())]


def _utc_ms(dt: datetime) -> int:
    """Epoch ms of a start time; a time without a zone is UTC, never the machine's zone
    (YAML gives an unquoted one as a naive datetime, a quoted one as a string: same rule)."""
    return int((dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp() * 1000)


def _parse_starting(r: _Reader, v: Any) -> StartingPolicy:
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


KAFKA_SINK_FIELDS = {"topic", "replay_topic", "key_column", "value_format", "value_columns",
                     "value_column", "headers", "partitioning", "producer"}
# what the sink sets itself (offsetflow.sink_kafka): the transaction and its fencing
FORBIDDEN_PRODUCER_KEYS = {"transactional.id", "enable.idempotence", "bootstrap.servers"}


def _parse_kafka_sink(r: _Reader, sec: Mapping[str, Any], schema: Mapping[str, str],
                      format_type: str, transform: str | None) -> KafkaSinkConfig:
    """`sink.type: kafka`. Columns are checked against format.schema when the config alone
    decides them (json format, no transform); a transform's columns are checked at run time."""
    for fld in ("table", "mode", "key"):
        if sec.get(fld) is not None:
            raise r.err(f"sink.{fld}", "is for sink.type: postgres; a Kafka sink writes "
                                       "sink.topic (record key: sink.key_column)")
    topics = {}
    for fld in ("topic", "replay_topic"):
        t = r.string(sec, fld, "sink.")
        if t is not None and not TOPIC_RE.match(t):
            raise r.err(f"sink.{fld}", f"{t!r} is not a valid Kafka topic name")
        topics[fld] = t
    if topics["topic"] is None:
        raise r.err("sink.topic", "is required with sink.type: kafka (the output topic)")
    if topics["replay_topic"] == topics["topic"]:
        raise r.err("sink.replay_topic", "must differ from sink.topic: a replay into the live "
                                         "output topic would write its records a second time")
    known = None if transform else set(schema) | RESERVED_COLUMNS

    def column(fld: str, name: Any) -> str:
        col = validate_identifier(r.source, fld, name)
        if known is not None and col not in known:
            raise r.err(fld, f"{col!r} is not a column (format.schema or a source column "
                             f"{sorted(RESERVED_COLUMNS)})")
        return col

    key_col = sec.get("key_column")
    value_format = r.string(sec, "value_format", "sink.", "json", {"json", "raw"}) or "json"
    cols_raw = sec.get("value_columns") or []
    if isinstance(cols_raw, str):
        cols_raw = [cols_raw]
    if not isinstance(cols_raw, list):
        raise r.err("sink.value_columns", "must be a list of column names")
    value_cols = tuple(column(f"sink.value_columns[{i}]", c) for i, c in enumerate(cols_raw))
    if value_cols and value_format != "json":
        raise r.err("sink.value_columns", "is for value_format: json (raw takes value_column)")
    if sec.get("value_column") is not None and value_format != "raw":
        raise r.err("sink.value_column", "is for value_format: raw (json takes value_columns)")
    if value_format == "json" and not value_cols and not transform and not schema:
        raise r.err("sink.value_columns", "raw format has no typed columns to write as JSON: "
                                          "use value_format: raw, or list value_columns")
    producer_raw = sec.get("producer") or {}
    if not isinstance(producer_raw, Mapping):
        raise r.err("sink.producer", "must be a mapping of librdkafka producer settings")
    producer: dict[str, str] = {}
    for k, v in producer_raw.items():
        if k in FORBIDDEN_PRODUCER_KEYS:
            raise r.err(f"sink.producer.{k}", "is set by OffsetFlow (the batch's transaction "
                                              "and its fencing depend on it) and may not be set")
        if isinstance(v, (Mapping, list)):
            raise r.err(f"sink.producer.{k}", "must be a scalar")
        producer[str(k)] = resolve_env(str(v).lower() if isinstance(v, bool) else str(v),
                                       r.source, f"sink.producer.{k}", r.env)
    assert topics["topic"] is not None
    return KafkaSinkConfig(
        topic=topics["topic"], replay_topic=topics["replay_topic"],
        key_column=None if key_col is None else column("sink.key_column", key_col),
        value_format=value_format, value_columns=value_cols,
        value_column=column("sink.value_column", sec.get("value_column", "value")),
        headers=r.string(sec, "headers", "sink.", "carry", {"carry", "none"}) or "carry",
        partitioning=r.string(sec, "partitioning", "sink.", "key", {"key", "source"}) or "key",
        producer=producer)
