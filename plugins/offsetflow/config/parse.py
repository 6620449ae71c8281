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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from offsetflow.config.fields import (
    FieldReader,
    resolve_env,
    validate_identifier,
    validate_table_name,
)
from offsetflow.config.iceberg_sink import parse_iceberg
from offsetflow.config.kafka_sink import KAFKA_SINK_FIELDS, parse_kafka_sink
from offsetflow.config.schema import (
    DECIMAL_RE,
    DEFAULT_MAX_OFFSETS_PER_TASK,
    DOTTED_RE,
    FIELD_TYPES,
    FORBIDDEN_CLIENT_KEYS,
    ISOLATION_LEVELS,
    NAME_RE,
    RESERVED_COLUMNS,
    TOMBSTONE_POLICIES,
    TOPIC_RE,
    KafkaConfig,
    PipelineConfig,
    SinkConfig,
    SparkConfig,
    StartingPolicy,
    connect_address,
    default_tombstones,
)
from offsetflow.errors import ConfigError

ICEBERG_FIELDS = ("catalog", "partition_by", "sort_by", "target_file_mb")


def parse_pipeline(raw: Any, source: str, env: Mapping[str, str] | None = None) -> PipelineConfig:
    """Validate a parsed YAML document; `source` names the file in every error."""
    env = os.environ if env is None else env
    if not isinstance(raw, Mapping):
        raise ConfigError(source, "<root>", "a pipeline config must be a YAML mapping")
    r = FieldReader(raw, source, env)
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
        kafka_sink = parse_kafka_sink(r, sink_raw, schema, format_type or "json", transform)
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
