"""The pipeline config model: what a validated `include/pipelines/<name>.yaml` becomes.

Pure data and the rules derived from it (consumer settings, fingerprints, drift, redaction);
parsing and its error messages live in config_parse, file loading in config.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from offsetflow.config.iceberg_sink import IcebergConfig, catalog_identity

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
DOTTED_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
DECIMAL_RE = re.compile(r"^decimal\((\d{1,2}),\s*(\d{1,2})\)$")
CONN_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")  # an Airflow connection id

FIELD_TYPES = {"string", "long", "int", "double", "float", "boolean", "timestamp", "date"}
# what format.schema may also declare for Avro: `json` (a record, array or map as jsonb) and
# `uuid` (PostgreSQL uuid); the JSON format's fast path reads neither yet
AVRO_FIELD_TYPES = FIELD_TYPES | {"json", "uuid"}
# formats whose records become format.schema's columns; those read through a schema registry
TYPED_FORMATS = ("json", "avro", "json_schema", "protobuf")
REGISTRY_FORMATS = ("avro", "json_schema", "protobuf")
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
class RateConfig:
    """`source.rate`: adaptive batch sizing. `adaptive: pid` sizes each scheduled batch with
    Spark Streaming's PID rate estimator (`spark.streaming.backpressure.pid.*`: same gains,
    same defaults) from the processing rate of the last batch, within the record caps.
    `interval_s`: the schedule's interval (Spark's batch interval), from `schedule` unless
    given. None `adaptive`: fixed caps only."""

    adaptive: str | None = None  # pid
    proportional: float = 1.0
    integral: float = 0.2
    derived: float = 0.0
    min_rate: float = 100.0  # records per second, > 0
    interval_s: float | None = None


@dataclass(frozen=True)
class KafkaConfig:
    """Where the Kafka settings come from in Airflow: a `kafka` connection (its extra holds
    librdkafka settings); then `kafka.bootstrap_servers` may be left out."""

    conn_id: str | None = None


@dataclass(frozen=True)
class KafkaSinkConfig:
    """`sink.type: kafka`: records go to `topic` in one producer transaction per batch
    (offsetflow.sinks.kafka.sink). Replays and backfills go to `replay_topic`, never to `topic`."""

    topic: str
    replay_topic: str | None = None
    key_column: str | None = None  # None: the source record's key
    # json: the value columns as an object | raw: one column's bytes | avro: the value
    # columns as a Confluent wire-format Avro record (offsetflow.sinks.kafka.avro_value)
    value_format: str = "json"
    value_columns: tuple[str, ...] = ()  # json; empty: every column but the source's own
    value_column: str = "value"  # raw
    headers: str = "carry"  # carry | none (the offsetflow.* headers are always written)
    partitioning: str = "key"  # key | source (the source record's partition number)
    # librdkafka overrides; may hold credentials, so not in the repr
    producer: Mapping[str, str] = field(default_factory=dict, repr=False)
    # avro: the subject (None: `<output topic>-value`), an explicit Avro schema (JSON text;
    # None: derived from the columns) and the registry (None: format.schema_registry's)
    value_subject: str | None = None
    value_schema: str | None = None
    registry: SchemaRegistryConfig | None = field(default=None, repr=False)
    # a directory the driver and every executor reach (absolute; None: `auto` or `off`):
    # the tasks write each part's finished records to a task file there and the driver
    # produces from the files (issue 32, `offsetflow.sinks.kafka.taskfile`)
    task_files: str | None = None
    # `auto` (the default; False: `off`, the stage): where the tasks run on the driver's
    # host (a local master, not Spark Connect), a private directory of that host
    # (`taskfile.private_directory`); elsewhere the PostgreSQL stage
    task_files_auto: bool = True
    # the task files' mode (`sink.task_files_mode`; the umask may narrow it): 0640 lets
    # the writer's group read them, 0644 every user of the host
    task_files_mode: int = 0o640


@dataclass(frozen=True)
class SchemaRegistryConfig:
    """`format.schema_registry` (formats avro, json_schema): a Confluent-compatible Schema
    Registry. The writer schema of a record is fetched by the id in its 5-byte header; the
    Avro reader schema is the subject `<topic>-value` at `reader_version` (None: its latest
    version, read once per batch run; an Avro key: `<topic>-key`, latest). `password` is a
    secret: never logged (`redacted`)."""

    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    reader_version: int | None = None
    timeout_s: int = 10
    # an Airflow `http` connection (host with scheme and port, login, password): the URL
    # and credentials are filled in where the pipeline runs (`orchestration.connections`)
    conn_id: str | None = None


@dataclass(frozen=True)
class SinkConfig:
    type: str
    connection: str = field(repr=False)  # a DSN with its password; "" with only `conn_id`
    table: str
    mode: str  # append | upsert
    key: tuple[str, ...] = ()
    conn_id: str | None = None  # an Airflow `postgres` connection
    kafka: KafkaSinkConfig | None = None  # type: kafka
    iceberg: IcebergConfig | None = None  # type: iceberg (sink_iceberg_config)

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
    # librdkafka settings, callbacks (oauth_cb) from a connection among them; secrets, so
    # not in the repr (an exception or a log line may show the config): see redacted()
    client: Mapping[str, Any] = field(repr=False)
    topics: tuple[str, ...]
    topic_pattern: str | None
    starting: StartingPolicy
    max_records_per_partition: int
    max_records_per_batch: int | None
    data_loss: str  # fail | continue
    format_type: str  # json | raw | avro | json_schema
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
    registry: SchemaRegistryConfig | None = None  # formats avro, json_schema
    key_format: str | None = None  # format.key.type: avro (None: the key stays raw bytes)
    # format.schema_evolution: add_columns | fail (None: format.schema's columns only)
    schema_evolution: str | None = None
    rate: RateConfig = field(default_factory=RateConfig)  # source.rate

    @property
    def tombstone_policy(self) -> str:
        return self.tombstones or default_tombstones(self.sink.mode, self.format_type)

    @property
    def kafka_origin(self) -> str:
        """Where the Kafka client settings come from, for errors that must name it."""
        if self.kafka.conn_id:
            return f"Airflow connection {self.kafka.conn_id!r} (kafka.conn_id)"
        return f"kafka.client of {self.source_file}"

    def matches_topic(self, topic: str) -> bool:
        if self.topic_pattern is not None:
            return re.fullmatch(self.topic_pattern, topic) is not None
        return topic in self.topics

    def consumer_settings(self) -> dict[str, Any]:
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

    def admin_settings(self) -> dict[str, Any]:
        conf = {k: v for k, v in self.client.items() if not k.startswith(("fetch.", "queued."))}
        conf["bootstrap.servers"] = self.bootstrap_servers
        # librdkafka's info notes (e.g. BGQUEUE when an admin client closes) go straight to
        # stderr; warnings and errors still do. A client.log_level of the pipeline wins.
        conf.setdefault("log_level", "4")
        return conf

    def _output_relevant(self) -> dict[str, Any]:
        return {
            "format": [self.format_type, dict(self.schema)],
            **({"key_format": self.key_format} if self.key_format else {}),
            # the reader schema decides fields' defaults; not the URL or credentials (a
            # registry that moves serves the same ids)
            **({"reader_version": self.registry.reader_version}
               if self.registry is not None else {}),
            **({"schema_evolution": self.schema_evolution} if self.schema_evolution else {}),
            "transform": self.transform,
            "sink": [self.sink.table, self.sink.mode, list(self.sink.key)],
            **({"sink_iceberg": [self.sink.iceberg.identifier, *catalog_identity(
                self.sink.iceberg, self.sink.connection, self.sink.conn_id)]}
               if self.sink.iceberg is not None else {}),
            "bad_records": [self.bad_records, self.dead_letter_table],
            "isolation_level": self.isolation_level,
            # only for a Kafka sink: other pipelines' fingerprints stay as they were. Not
            # replay_topic: naming one is how a refused replay is fixed, and the live
            # batches never write there
            **({"sink_kafka": _kafka_sink_output(self.sink.kafka)}
               if self.sink.kafka is not None else {}),
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
        if d.get("registry") and d["registry"].get("password") is not None:
            d["registry"]["password"] = "***"
        if d.get("registry"):
            d["registry"]["url"] = redact_dsn(d["registry"]["url"])
        if self.sink.kafka is not None:
            d["sink"]["kafka"]["producer"] = {k: redact_value(k, v) for k, v
                                              in self.sink.kafka.producer.items()}
            reg = d["sink"]["kafka"].get("registry")
            if reg:
                reg["url"] = redact_dsn(reg["url"])
                if reg.get("password") is not None:
                    reg["password"] = "***"
        if d["sink"].get("iceberg"):
            props = d["sink"]["iceberg"]["properties"]
            d["sink"]["iceberg"]["properties"] = {k: redact_value(k, v) if k != "uri" else
                                                  redact_dsn(v) for k, v in props.items()}
        return d


def _kafka_sink_output(sink: KafkaSinkConfig) -> dict[str, Any]:
    # not the registry's URL or credentials; the avro settings only when set (the
    # fingerprints of pipelines planned before them stay the same)
    return {k: v for k, v in asdict(sink).items()
            if k not in ("producer", "replay_topic", "registry", "task_files",
                         "task_files_auto", "task_files_mode")
            and not (k in ("value_subject", "value_schema") and v is None)}


def redact_value(key: str, value: Any) -> Any:
    """A setting as it may be shown: secrets as ***, a callback (oauth_cb) by its name."""
    if any(h in key.lower() for h in SECRET_HINTS):
        return "***"
    if callable(value):
        name = getattr(value, "__qualname__", None) or type(value).__name__
        return f"<callback {getattr(value, '__module__', None) or '?'}.{name}>"
    return value


# query parameters of a URL that carry a secret (a registry's `?api_key=`, a token)
SECRET_PARAMS = r"(?:api[_-]?key|api[_-]?secret|access[_-]?token|token|secret|password|passwd|key)"


def redact_dsn(dsn: str) -> str:
    """Hide the password of a URI or key=value DSN, a secret query parameter of a URL, and
    an http(s) URL's bare user part (a registry's API key given as `https://KEY@host`)."""
    # user may be empty; to the last @ (an unencoded / or @ in the password stays hidden)
    dsn = re.sub(r"(://[^:/@?#]*:).*@", r"\1***@", dsn)
    dsn = re.sub(r"^(https?://)[^:/@?#]+@", r"\1***@", dsn)
    dsn = re.sub(r"([?&;]" + SECRET_PARAMS + r"=)[^&;#\s]*", r"\1***", dsn, flags=re.I)
    # key=value: a quoted password may hold spaces and escaped quotes
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", dsn)


def split_table_name(table: str) -> tuple[str, str]:
    parts = table.split(".")
    return ("public", parts[0]) if len(parts) == 1 else (parts[0], parts[1])


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


def connect_address(url: str) -> tuple[str, int]:
    """Host and port of an `sc://host[:port][/;params]` URL (Spark Connect's default port
    is 15002)."""
    m = re.fullmatch(r"sc://(\[[^\]]+\]|[^:/;]+)(?::(\d+))?(?:/.*)?", url)
    if m is None:
        shown = url.split(";", 1)[0]  # parameters may carry a token: never echo them
        raise ValueError(f"not a Spark Connect URL: {shown!r} (expected sc://host[:port])")
    return m.group(1).strip("[]"), int(m.group(2) or 15002)
