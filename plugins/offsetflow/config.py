"""Pipeline configs (`include/pipelines/<name>.yaml`), validated on load.

Every error names the file and the dotted field, so a broken config is fixed in one go.
Pure: parsing and validation only; `load_pipeline` is the one function that reads a file.
`${VAR}` / `${VAR:-default}` are resolved from the environment so secrets stay out of
the YAML; `redacted()` is what may be logged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from offsetflow.errors import ConfigError

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
DOTTED_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
DECIMAL_RE = re.compile(r"^decimal\((\d{1,2}),\s*(\d{1,2})\)$")

FIELD_TYPES = {"string", "long", "int", "double", "float", "boolean", "timestamp", "date"}
SECRET_HINTS = ("password", "secret", "token", "key", "credential", "sasl.jaas")
RESERVED_COLUMNS = {"topic", "partition", "offset", "timestamp", "timestamp_type", "key",
                    "value", "headers"}
ISOLATION_LEVELS = {"read_committed", "read_uncommitted"}
FORBIDDEN_CLIENT_KEYS = {
    # OffsetFlow owns offsets: the reader assigns and seeks, it never lets Kafka decide.
    "enable.auto.commit", "auto.offset.reset", "group.id", "enable.auto.offset.store",
    "isolation.level",
}


@dataclass(frozen=True)
class StartingPolicy:
    """Where a partition with no committed position starts (kept apart from resolving it)."""

    kind: str  # earliest | latest | timestamp | offsets
    timestamp_ms: int | None = None
    offsets: Mapping[str, Mapping[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class KafkaConfig:
    """`kafka.conn_id`: an Airflow `kafka` connection giving bootstrap.servers and librdkafka
    settings instead of `kafka.bootstrap_servers` (resolved by orchestration.connections)."""

    conn_id: str | None = None


@dataclass(frozen=True)
class SinkConfig:
    type: str
    connection: str  # empty until resolved when conn_id names an Airflow connection
    table: str
    mode: str  # append | upsert
    key: tuple[str, ...] = ()
    conn_id: str | None = None  # an Airflow `postgres` connection instead of `connection`

    @property
    def schema_and_table(self) -> tuple[str, str]:
        return split_table_name(self.table)


# what a record with a null value (a tombstone) does, by sink mode
TOMBSTONE_POLICIES = {"upsert": ("delete", "dead_letter"), "append": ("dead_letter", "null_row")}


def default_tombstones(mode: str, format_type: str) -> str:
    """upsert: delete. append: raw format keeps main's behaviour (a row whose value is NULL,
    so upgrading never silently stops writing those rows); JSON routes them to the
    dead-letter table (main made them bad records, which needed a dead-letter table too)."""
    if mode == "upsert":
        return "delete"
    return "null_row" if format_type == "raw" else "dead_letter"

# parts of ~100k records: with the part-wise commit only the last wave of parts is moved
# after the read, so smaller parts shorten that tail (1M on 2 cores: 250k -> 7.2 s,
# 100k -> 6.1 s, 60k -> 6.7 s as per-task costs take over)
DEFAULT_MAX_OFFSETS_PER_TASK = 100_000


@dataclass(frozen=True)
class SparkConfig:
    master: str = "local[2]"
    max_offsets_per_task: int = DEFAULT_MAX_OFFSETS_PER_TASK
    conf: Mapping[str, str] = field(default_factory=dict)
    launch: str = "submit"  # submit | connect (a warm Spark Connect server)
    connect_url: str = "sc://127.0.0.1:15002"


@dataclass(frozen=True)
class PipelineConfig:
    name: str
    source_file: str
    bootstrap_servers: str
    isolation_level: str
    client: Mapping[str, str]
    topics: tuple[str, ...]
    topic_pattern: str | None
    starting: StartingPolicy
    max_records_per_partition: int
    max_records_per_batch: int | None
    data_loss: str  # fail | continue
    format_type: str  # json | raw
    schema: Mapping[str, str]
    transform: str | None
    sink: SinkConfig
    bad_records: str  # fail | dead_letter
    dead_letter_table: str
    spark: SparkConfig
    schedule: str | None
    retries: int
    pool: str | None
    quality_suite: str | None = None
    quality_policy: str = "fail"
    description: str = ""
    tombstones: str = ""  # upsert: delete | dead_letter; append: dead_letter | null_row
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    @property
    def tombstone_policy(self) -> str:
        return self.tombstones or default_tombstones(self.sink.mode, self.format_type)

    def matches_topic(self, topic: str) -> bool:
        if self.topic_pattern is not None:
            return re.fullmatch(self.topic_pattern, topic) is not None
        return topic in self.topics

    def consumer_settings(self) -> dict[str, str]:
        """librdkafka settings for every OffsetFlow consumer: no group, no auto-commit."""
        conf = dict(self.client)
        conf.update({
            "bootstrap.servers": self.bootstrap_servers,
            "group.id": f"offsetflow-{self.name}",
            "enable.auto.commit": "false",
            "enable.auto.offset.store": "false",
            "auto.offset.reset": "error",
            "isolation.level": self.isolation_level,
            "enable.partition.eof": "true",
        })
        return conf

    def admin_settings(self) -> dict[str, str]:
        conf = {k: v for k, v in self.client.items() if not k.startswith(("fetch.", "queued."))}
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def _output_relevant(self) -> dict[str, Any]:
        return {
            "format": [self.format_type, dict(self.schema)],
            "transform": self.transform,
            "sink": [self.sink.table, self.sink.mode, list(self.sink.key)],
            "bad_records": [self.bad_records, self.dead_letter_table],
            "isolation_level": self.isolation_level,
            # only when not the default: fingerprints of batches planned before the option
            # existed stay the same
            **({"tombstones": self.tombstone_policy}
               if self.tombstone_policy != default_tombstones(self.sink.mode, self.format_type)
               else {}),
        }

    def fingerprint(self) -> str:
        """Hash of what decides a batch's output; a change between plan and run is caught.
        The split into Spark parts is not in it: it decides how a batch is staged, not what
        it writes, and is recorded beside it (`Batch.split_offsets`)."""
        return _hash(self._output_relevant())

    def fingerprint_v1(self, max_offsets_per_task: int) -> str:
        """The fingerprint as batches planned before ledger migration 0003 recorded it: the
        split hashed in with the rest, so a changed split looked like a changed output."""
        return _hash({**self._output_relevant(), "max_offsets_per_task": max_offsets_per_task})

    def redacted(self) -> dict[str, Any]:
        d = asdict(self)
        d["client"] = {k: redact_value(k, v) for k, v in self.client.items()}
        d["sink"]["connection"] = redact_dsn(self.sink.connection)
        return d


def redact_value(key: str, value: str) -> str:
    return "***" if any(h in key.lower() for h in SECRET_HINTS) else value


def redact_dsn(dsn: str) -> str:
    """Hide the password of a URI or key=value DSN."""
    dsn = re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", dsn)
    return re.sub(r"(password\s*=\s*)\S+", r"\1***", dsn)


def split_table_name(table: str) -> tuple[str, str]:
    parts = table.split(".")
    return ("public", parts[0]) if len(parts) == 1 else (parts[0], parts[1])


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
    kafka_conn_id = _conn_id(r, kafka, "kafka.", "bootstrap_servers")
    bootstrap = r.string(kafka, "bootstrap_servers", "kafka.",
                         default=None if kafka_conn_id
                         else "${OFFSETFLOW_KAFKA_BOOTSTRAP:-127.0.0.1:19092}") or ""
    if not kafka_conn_id and not bootstrap.strip():
        raise r.err("kafka.bootstrap_servers", "must not be empty")
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
    r.unknown(sink_raw, "sink.", {"type", "connection", "table", "mode", "key", "conn_id"})
    sink_type = r.string(sink_raw, "type", "sink.", "postgres", {"postgres"})
    sink_conn_id = _conn_id(r, sink_raw, "sink.", "connection")
    connection = r.string(sink_raw, "connection", "sink.",
                          None if sink_conn_id else "${OFFSETFLOW_PG_DSN}")
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
                        table=table, mode=mode or "append", key=key, conn_id=sink_conn_id),
        bad_records=bad_records or "fail", dead_letter_table=dlt, spark=spark,
        schedule=schedule, retries=retries if retries is not None else 2, pool=pool,
        quality_suite=suite, quality_policy=q_policy or "fail", description=str(desc or ""),
        tombstones=tombstones, kafka=KafkaConfig(conn_id=kafka_conn_id),
    )


def _conn_id(r: _Reader, sec: Mapping[str, Any], prefix: str, literal: str) -> str | None:
    """An Airflow connection id, given instead of (never beside) the literal field."""
    v = sec.get("conn_id")
    if v is None:
        return None
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,250}", v):
        raise r.err(prefix + "conn_id", f"{v!r} is not an Airflow connection id")
    if sec.get(literal) is not None:
        raise r.err(prefix + literal, f"give either {prefix}conn_id or {prefix}{literal}, "
                                      f"not both")
    return v


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


def _hash(relevant: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


# the default before 2026-11-22; batches planned under it carry it in their v1 fingerprint
V1_DEFAULT_MAX_OFFSETS_PER_TASK = 250_000


@dataclass(frozen=True)
class ConfigDrift:
    """How the config a batch was planned with differs from the one it is about to run with."""

    output_changed: bool  # format, transform, sink or bad-record policy: the user must accept
    split_from: int | None = None  # the batch's earlier split into parts, if it changed

    @property
    def any(self) -> bool:
        return self.output_changed or self.split_from is not None


def config_drift(cfg: PipelineConfig, fingerprint: str | None,
                 split_offsets: int | None) -> ConfigDrift:
    """Compare a batch's recorded config with `cfg`. A batch planned before the split was
    recorded apart carries a v1 fingerprint; it is matched with the split it most likely
    had (the configured one, else the old default), so neither an unchanged config nor the
    default's change is mistaken for a changed output."""
    split = cfg.spark.max_offsets_per_task
    if fingerprint is None:
        return ConfigDrift(False)
    if split_offsets is not None:
        return ConfigDrift(fingerprint != cfg.fingerprint(),
                           split_offsets if split_offsets != split else None)
    for old in dict.fromkeys((split, V1_DEFAULT_MAX_OFFSETS_PER_TASK)):
        if fingerprint == cfg.fingerprint_v1(old):
            return ConfigDrift(False, old if old != split else None)
    return ConfigDrift(True)


def load_pipeline(path: str | Path, env: Mapping[str, str] | None = None) -> PipelineConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(str(p), "<file>", f"cannot read: {e.strerror}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(str(p), "<yaml>", f"not valid YAML: {e}") from e
    return parse_pipeline(raw, str(p), env)


def pipelines_dir() -> Path:
    return Path(os.environ.get("OFFSETFLOW_PIPELINES_DIR")
                or Path(__file__).resolve().parents[2] / "include" / "pipelines")


def find_pipeline(name: str, directory: Path | None = None) -> PipelineConfig:
    """Load the pipeline called `name` from the pipelines folder (file stem or `name:`)."""
    d = directory or pipelines_dir()
    if not NAME_RE.match(name):
        raise ConfigError(str(d), "pipeline", f"{name!r} is not a valid pipeline name")
    direct = d / f"{name}.yaml"
    if direct.exists():
        return load_pipeline(direct)
    for f in sorted(d.glob("*.y*ml")):
        cfg = load_pipeline(f)
        if cfg.name == name:
            return cfg
    raise ConfigError(str(d), "pipeline", f"no pipeline named {name!r} in {d}")


def connect_address(url: str) -> tuple[str, int]:
    """Host and port of an `sc://host[:port][/;params]` URL (Spark Connect's default port
    is 15002)."""
    m = re.fullmatch(r"sc://(\[[^\]]+\]|[^:/;]+)(?::(\d+))?(?:/.*)?", url)
    if m is None:
        shown = url.split(";", 1)[0]  # parameters may carry a token: never echo them
        raise ValueError(f"not a Spark Connect URL: {shown!r} (expected sc://host[:port])")
    return m.group(1).strip("[]"), int(m.group(2) or 15002)
