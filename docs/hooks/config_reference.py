"""The configuration reference of docs/configuration.md, generated from the config schema,
and a check that every config example in the docs parses.

An MkDocs hook (mkdocs.yml `hooks:`), also runnable as a script to print the reference:
`.venv/bin/python docs/hooks/config_reference.py`.

What comes from the schema (`offsetflow.config`, imported only through that face:
`parse_pipeline` and `PipelineConfig`):

- the fields: which keys the parser accepts at the top level and in each section (per sink
  type for `sink`), read from its "unknown field; allowed: [...]" refusal of a probe key;
- each field's type (the annotation of the `PipelineConfig` attribute it becomes), default
  (what a minimal pipeline parses to without it, or "required" when the parser refuses its
  absence) and allowed values (the parser's "not one of [...]" refusal of a probe value).

What is written here, once: `FIELDS`, one line of description per field (and, where the
schema cannot say it, a type, default or allowed-values text). `check()` fails the build
when the parser accepts a key `FIELDS` does not describe, when `FIELDS` describes a key the
parser refuses, or when a `PipelineConfig` attribute (recursively through the sink, spark and
kafka sections) is neither described nor listed in `NOT_FROM_YAML`: adding a field to the
schema without documenting it fails `make docs`.

Every ```yaml block of the docs pages and of README.md must parse as a pipeline: a block with
`name`, or with both `source` and `sink`, as it is; any other block is a fragment whose
top-level sections replace those of `EXAMPLE_BASE`. `${VAR}` without a default gets a
placeholder value.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
try:
    import offsetflow.config  # noqa: F401
except ImportError:  # not installed into this interpreter: use the checkout's package
    sys.path.insert(0, str(ROOT / "plugins"))
from offsetflow.config import PipelineConfig, parse_pipeline  # noqa: E402

MARKER = "<!-- config-reference -->"
SINK_TYPES = ("postgres", "kafka", "iceberg")
PROBE = "zz_probe"


class Field(typing.NamedTuple):
    attr: str  # where the value lands on PipelineConfig (dotted; `[key]` for a mapping key)
    desc: str
    sinks: tuple[str, ...] = SINK_TYPES  # the sink types the field applies to
    type: str | None = None  # overrides of what the schema cannot say
    default: str | None = None
    allowed: str | None = None


F = Field
PG_ICE = ("postgres", "iceberg")

# every field of a pipeline YAML, by dotted name: the one place descriptions are written
FIELDS: dict[str, Field] = {
    # top level
    "name": F("name", "Pipeline name: the DAG `offsetflow_<name>` and the ledger rows; "
              "lowercase letters, digits and `_`.", default="the file's stem"),
    "description": F("description", "The DAG's description."),
    "schedule": F("schedule", "Cron expression or preset (`@hourly`) of the pipeline's DAG; "
                  "none: the DAG runs only when triggered."),
    "retries": F("retries", "Airflow task retries of the pipeline's DAG (30 s apart)."),
    "pool": F("pool", "Airflow pool of the pipeline's tasks."),
    "transform": F("transform", "Dotted path `package.module.function`: DataFrame -> "
                   "DataFrame; keep `topic`/`partition`/`offset`. Slower than the fused path."),
    "bad_records": F("bad_records", "A record that cannot be written: `fail` fails the batch "
                     "naming topic[partition]@offset; `dead_letter` routes it to the "
                     "dead-letter table."),
    "dead_letter_table": F("dead_letter_table", "PostgreSQL table of dead letters (bad "
                           "records, quality failures, rows without a key, tombstones)."),
    "tombstones": F("tombstones", "What a record with a null value does (see the PostgreSQL "
                    "sink page); refused with a Kafka sink, which forwards tombstones.",
                    sinks=PG_ICE, default="upsert: `delete`; append: `dead_letter` (json), "
                    "`null_row` (raw)"),
    # kafka
    "kafka.conn_id": F("kafka.conn_id", "An Airflow `kafka` connection (librdkafka settings in "
                       "its extra); instead of `bootstrap_servers`."),
    "kafka.bootstrap_servers": F("bootstrap_servers", "Brokers, when no `conn_id` is given.",
                                 default="`${OFFSETFLOW_KAFKA_BOOTSTRAP:-127.0.0.1:19092}`"),
    "kafka.isolation_level": F("isolation_level", "Consumers' isolation level; "
                               "`read_committed` never reads aborted records."),
    "kafka.client": F("client", "librdkafka settings, passed through (`${VAR}` for secrets); "
                      "settings that would let Kafka decide offsets (`group.id`, "
                      "`enable.auto.commit`, `auto.offset.reset`, ...) are refused."),
    # source
    "source.topics": F("topics", "Topics to read (or `topic_pattern`: exactly one of the "
                       "two)."),
    "source.topic_pattern": F("topic_pattern", "Regular expression a topic's whole name must "
                              "match to be read."),
    "source.starting": F("starting", "Where a partition with no committed position starts; a "
                         "time without a zone is UTC.", type="string or mapping",
                         allowed="`earliest`, `latest`, `{timestamp: T}`, "
                         "`{offsets: {topic: {partition: offset}}}`"),
    "source.max_records_per_partition": F("max_records_per_partition", "Rate limit: offsets "
                                          "per partition and batch."),
    "source.max_records_per_batch": F("max_records_per_batch", "Optional total cap per batch, "
                                      "shared fairly between partitions."),
    "source.data_loss": F("data_loss", "A committed position below the earliest offset: "
                          "`fail` plans nothing; `continue` skips to the earliest offset "
                          "(recorded either way)."),
    "source.rate.adaptive": F("rate.adaptive", "`pid`: size each scheduled batch with Spark "
                              "Streaming's PID rate estimator from the last batch's processing "
                              "rate (offsets / processing time), for the schedule's interval; "
                              "within `max_records_per_partition` and `max_records_per_batch`. "
                              "See Operations, adaptive batch sizing."),
    "source.rate.proportional": F("rate.proportional", "PID: weight of the current error "
                                  "(Spark's `spark.streaming.backpressure.pid.proportional`)."),
    "source.rate.integral": F("rate.integral", "PID: weight of the accumulated error, read "
                              "from the scheduling delay (`...pid.integral`)."),
    "source.rate.derived": F("rate.derived", "PID: weight of the error's change "
                             "(`...pid.derived`)."),
    "source.rate.min_rate": F("rate.min_rate", "PID: the lowest rate it sizes a batch for, "
                              "records per second, > 0 (`...pid.minRate`); the caps still "
                              "win."),
    "source.rate.interval_s": F("rate.interval_s", "Seconds between batches the rate is "
                                "sized for (Spark's batch interval).",
                                default="the `schedule`'s interval"),
    # format
    "format.type": F("format_type", "`json`: typed columns from `schema`; `avro`: Confluent "
                     "wire-format Avro decoded with `schema_registry`, typed columns from "
                     "`schema`; `json_schema`: Confluent wire-format JSON (5-byte header, "
                     "id checked in `schema_registry`) read as `json`; `protobuf`: "
                     "Confluent wire-format Protobuf decoded with the writer schema from "
                     "`schema_registry` (see Formats); `raw`: key and value bytes only."),
    "format.schema": F("schema", "json, avro, json_schema, protobuf: a mapping column -> "
                       "type (`string`, `long`, `int`, `double`, `float`, `boolean`, "
                       "`timestamp`, `date`, `decimal(p,s)`, `json` for a nested value as jsonb; "
                       "avro and protobuf also `uuid`); raw takes none.", type="mapping"),
    "format.key.type": F("key_format", "`avro`: each Kafka key is Confluent wire-format Avro "
                         "(subject `<topic>-key`); its record's fields fill the `schema` "
                         "columns of their names (upsert keys, a tombstone's delete). avro, "
                         "json_schema and protobuf formats only.", default="none (raw key bytes)"),
    "format.schema_evolution": F("schema_evolution", "avro, protobuf, json_schema into "
                                 "PostgreSQL or Iceberg (append or upsert): `add_columns`: "
                                 "the reader schema's fields `schema` does not declare "
                                 "become columns, added in the commit's transaction "
                                 "(Iceberg: its catalog commit); "
                                 "`fail`: a batch holding a schema change stops. Either way "
                                 "an incompatible change stops the batch (see Formats, "
                                 "Schema evolution).", sinks=("postgres", "iceberg"),
                                 default="none (the `schema` columns only)"),
    "format.schema_registry.url": F("registry.url", "avro, json_schema, protobuf: the "
                                    "Confluent-compatible Schema Registry (`${VAR}` allowed); writer "
                                    "schemas are looked up by each record's schema id.",
                                    default="required with `type: avro`, `json_schema`, `protobuf`"),
    "format.schema_registry.conn_id": F("registry.conn_id", "registry formats: an Airflow "
                                        "`http` connection instead of `url`, `username` and "
                                        "`password` (host with scheme, port, login, "
                                        "password), read where the pipeline runs."),
    "format.schema_registry.username": F("registry.username", "registry formats: HTTP basic "
                                         "auth user (with `password`)."),
    "format.schema_registry.password": F("registry.password", "registry formats: HTTP basic "
                                         "auth password; give it as `${VAR}`, it is never "
                                         "logged."),
    "format.schema_registry.reader_version": F("registry.reader_version", "avro: the "
                                               "version of `<topic>-value` records are read "
                                               "with; none: its latest, once per run.",
                                               default="latest"),
    "format.schema_registry.timeout_s": F("registry.timeout_s", "seconds one registry "
                                          "request may take (then retried 3 times before "
                                          "the batch fails).", default="`10`"),
    # sink, every type
    "sink.type": F("sink.type", "Where the rows go; each has a page under Sinks."),
    "sink.conn_id": F("sink.conn_id", "An Airflow `postgres` connection (ledger, stage, "
                      "dead letters, PostgreSQL target); instead of `connection`."),
    "sink.connection": F("sink.connection", "PostgreSQL DSN when no `conn_id` is given "
                         "(the ledger and the stage always live there)."),
    "sink.table": F("sink.table", "Target table, `table` or `schema.table` (Iceberg: "
                    "`namespace.table`, namespace `offsetflow` by default); created if "
                    "missing.", sinks=PG_ICE),
    "sink.mode": F("sink.mode", "`append` (a unique index on the coordinates) or `upsert` "
                   "on `key` (latest offset wins).", sinks=PG_ICE),
    "sink.key": F("sink.key", "Upsert key columns (a string is one column); only with "
                  "`mode: upsert`.", sinks=PG_ICE, type="list of strings"),
    # sink, type kafka
    "sink.topic": F("sink.kafka.topic", "Output topic (must exist).", sinks=("kafka",)),
    "sink.replay_topic": F("sink.kafka.replay_topic", "Where replays and backfills go (never "
                           "the live topic); changing it needs no --accept-config-change.",
                           sinks=("kafka",)),
    "sink.key_column": F("sink.kafka.key_column", "Column that becomes the record key; none: "
                         "the source record's key (or a transform's `key`).", sinks=("kafka",)),
    "sink.value_format": F("sink.kafka.value_format", "`json`: `value_columns` as an object; "
                           "`raw`: the bytes of `value_column`; `avro`: `value_columns` as a "
                           "Confluent wire-format Avro record ([Avro values]"
                           "(sinks/kafka.md#avro-values)).", sinks=("kafka",)),
    "sink.value_subject": F("sink.kafka.value_subject", "avro: the registry subject of the "
                            "value schema.", default="`<topic>-value`", sinks=("kafka",)),
    "sink.value_schema": F("sink.kafka.value_schema", "avro: an Avro record schema (JSON "
                           "text) instead of the one derived from the columns.",
                           sinks=("kafka",)),
    "sink.schema_registry": F("sink.kafka.registry", "avro: the registry the value schema is "
                              "registered in (`url`, `username`, `password`, `timeout_s`, or `conn_id`: "
                              "an Airflow `http` connection; as `format.schema_registry`).", default="`format.schema_registry`",
                              sinks=("kafka",)),
    "sink.value_columns": F("sink.kafka.value_columns", "json: the columns of the value "
                            "object; empty: every parsed column.", sinks=("kafka",),
                            type="list of strings"),
    "sink.value_column": F("sink.kafka.value_column", "raw: the column whose bytes are the "
                           "value.", sinks=("kafka",)),
    "sink.headers": F("sink.kafka.headers", "`carry` the source headers or `none` (the "
                      "`offsetflow.*` headers are always written).", sinks=("kafka",)),
    "sink.partitioning": F("sink.kafka.partitioning", "`key`: murmur2 of the key, as Java "
                           "clients; `source`: the source record's partition number.",
                           sinks=("kafka",)),
    "sink.producer": F("sink.kafka.producer", "librdkafka producer overrides "
                       "(`transactional.id`, `enable.idempotence`, `bootstrap.servers` are "
                       "OffsetFlow's).", sinks=("kafka",)),
    "sink.task_files": F("sink.kafka.task_files", "Where the tasks write each part's "
                         "finished records as a task file, instead of the PostgreSQL "
                         "stage, for the driver to produce from: `auto` (a private "
                         "directory of this host where the tasks run on the driver's host, "
                         "a local master; elsewhere the stage), `off` (the stage), or an "
                         "absolute directory the driver and every executor reach. See [the "
                         "Kafka sink](sinks/kafka.md#task-files).", default="`auto`",
                         type="string", sinks=("kafka",)),
    "sink.task_files_mode": F("sink.kafka.task_files_mode", "The task files' mode, a quoted "
                              "octal string (the umask may narrow it): `\"0640\"` lets the "
                              "writer's group read them, `\"0644\"` every user (a driver "
                              "sharing no group with the executors). See [the Kafka sink]"
                              "(sinks/kafka.md#task-files).", default='`"0640"`', type="string",
                              sinks=("kafka",)),
    # sink, type iceberg
    "sink.catalog.type": F("sink.iceberg.catalog_type", "Iceberg catalog type.",
                           sinks=("iceberg",)),
    "sink.catalog.name": F("sink.iceberg.catalog_name", "The catalog name readers use.",
                           sinks=("iceberg",)),
    "sink.catalog.warehouse": F("sink.iceberg.properties[warehouse]", "Where data files go "
                                "(`file:///data/lake`, `s3://bucket/lake`); required for "
                                "`sql`.", sinks=("iceberg",)),
    "sink.catalog.uri": F("sink.iceberg.properties[uri]", "Catalog URI; required for `rest` "
                          "and `hive`; `sql`: defaults to `sink.connection`.",
                          sinks=("iceberg",)),
    "sink.catalog.<other>": F("sink.iceberg.properties", "Any other key is passed to "
                              "pyiceberg's `load_catalog` (credentials, `s3.endpoint`, ...).",
                              sinks=("iceberg",), type="string", default="-"),
    "sink.partition_by": F("sink.iceberg.partition_by", "Partition spec of a table OffsetFlow "
                           "creates: `column`, `year(column)`, `month(...)`, `day(...)`, "
                           "`hour(...)`, `bucket(N, column)`, `truncate(N, column)`.",
                           sinks=("iceberg",), type="list of strings"),
    "sink.sort_by": F("sink.iceberg.sort_by", "Sort order of a table OffsetFlow creates: "
                      "`column`, then `asc` or `desc`, then `nulls first` or "
                      "`nulls last`.", sinks=("iceberg",), type="list of strings"),
    "sink.target_file_mb": F("sink.iceberg.target_file_mb", "`write.target-file-size-bytes` "
                             "of a table OffsetFlow creates.", sinks=("iceberg",)),
    # spark
    "spark.master": F("spark.master", "Spark master for `offsetflow run` (Airflow uses its "
                      "Spark connection)."),
    "spark.max_offsets_per_task": F("spark.max_offsets_per_task", "Ranges above this are "
                                    "split; small ones share tasks. Changing it re-stages "
                                    "an open batch, no --accept-config-change needed."),
    "spark.conf": F("spark.conf", "Spark settings (with `connect`: runtime SQL settings "
                    "only), e.g. `spark.archives` on a cluster. Without a transform, "
                    "`spark.executor.extraJavaOptions` defaults to "
                    "`-XX:TieredStopAtLevel=1` (C1-only executors); any value set here, "
                    "`\"\"` too, replaces it (see Performance)."),
    "spark.launch": F("spark.launch", "`connect`: a warm Spark Connect server; `submit`: a "
                      "spark-submit per batch (clusters, isolation)."),
    "spark.connect_url": F("spark.connect_url", "Spark Connect server, `sc://host[:port]` "
                           "(`/;token=...` is never logged)."),
    # quality
    "quality.suite": F("quality_suite", "Great Expectations suite run on the batch before "
                       "commit (`include/gx/expectations/<suite>.json`)."),
    "quality.on_failure": F("quality_policy", "`fail`: the batch is not committed; "
                            "`dead_letter`: rows breaking a row-level expectation become dead "
                            "letters (not with a Kafka sink)."),
}

# PipelineConfig attributes that no YAML field of their own sets
NOT_FROM_YAML = {
    "sink.kafka.registry.reader_version": "a source setting; the sink registers its schema",
    "sink.kafka.registry.conn_id": "format.schema_registry.conn_id only (the sink falls back "
                                   "to format.schema_registry)",
    "source_file": "the file the config was loaded from",
    "sink.iceberg.namespace": "from sink.table",
    "sink.iceberg.table": "from sink.table",
    "sink.iceberg.source_file": "the file the config was loaded from (for errors)",
    "sink.kafka.task_files_auto": "from sink.task_files (auto, the default)",
}

# minimal pipelines the probes start from, one per sink type (and upsert for the modes)
_SCHEMA = {"order_id": "string", "customer": "string", "amount": "double",
           "quantity": "long", "created_at": "timestamp", "event_id": "string"}
_COMMON: dict[str, Any] = {"name": "probe", "kafka": {}, "source": {"topics": ["orders"]},
                           "format": {"type": "json", "schema": _SCHEMA}}
BASES: dict[tuple[str, str], dict[str, Any]] = {
    ("postgres", "append"): {**_COMMON, "sink": {"table": "orders"}},
    ("postgres", "upsert"): {**_COMMON, "sink": {"table": "orders", "mode": "upsert",
                                                 "key": ["order_id"]}},
    ("kafka", "append"): {**_COMMON, "sink": {"type": "kafka", "topic": "orders.clean"}},
    ("iceberg", "append"): {**_COMMON, "sink": {"type": "iceberg", "table": "lake.orders",
                                                "catalog": {"warehouse": "file:///lake"}}},
}
# fragments of the docs' examples are checked inside this pipeline
EXAMPLE_BASE: dict[str, Any] = {**BASES[("postgres", "append")], "name": "example"}
# sections whose keys the parser does not close: no probe (documented keys only)
OPEN_SECTIONS = {"sink.catalog"}


class DocsError(Exception):
    """The reference or an example is wrong; the message says where."""


class _EchoEnv(Mapping[str, str]):
    """Every `${VAR}` resolves to itself, so a default shows as the config names it."""

    def __getitem__(self, key: str) -> str:
        return "${" + key + "}"

    def __contains__(self, key: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _parse(raw: Mapping[str, Any], env: Mapping[str, str] | None = None,
           source: str = "probe.yaml") -> tuple[PipelineConfig | None, Exception | None]:
    """(config, None) or (None, the parser's refusal: an error with `field` and `message`)."""
    try:
        return parse_pipeline(copy.deepcopy(dict(raw)), source,
                              _EchoEnv() if env is None else env), None
    except Exception as e:  # noqa: BLE001  (ConfigError: field and message, checked below)
        if not hasattr(e, "field") or not hasattr(e, "message"):
            raise
        return None, e


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def _drop(raw: dict[str, Any], dotted: str) -> bool:
    *parents, last = dotted.split(".")
    node: Any = raw
    for p in parents:
        node = node.get(p) if isinstance(node, Mapping) else None
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False


def _base(sink: str, mode: str = "append") -> dict[str, Any]:
    return copy.deepcopy(BASES[(sink, mode)])


def _allowed_keys(raw: dict[str, Any], section: str) -> set[str]:
    """The keys the parser accepts in `section` ("" for the top level)."""
    probe = copy.deepcopy(raw)
    _set(probe, f"{section}.{PROBE}" if section else PROBE, 1)
    _, err = _parse(probe)
    m = re.search(r"allowed: (\[.*?\])", getattr(err, "message", ""))
    if err is None or m is None:
        raise DocsError(f"the parser accepted an unknown key in {section or 'the top level'} "
                        f"({err}): cannot read its fields")
    return set(ast.literal_eval(m.group(1)))


def _bases_for(f: Field) -> list[tuple[str, str]]:
    return [k for k in BASES if k[0] in f.sinks]


# --- attribute paths on PipelineConfig: value and type --------------------------------------

_MISSING = object()


def _steps(attr: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"(\w+)(?:\[(\w+)\])?", attr)]


def _value(cfg: Any, attr: str) -> Any:
    node = cfg
    for name, key in _steps(attr):
        node = getattr(node, name, _MISSING)
        if node is _MISSING or node is None:
            return node
        if key is not None:
            node = node.get(key, _MISSING) if isinstance(node, Mapping) else _MISSING
    return node


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _hint(attr: str) -> Any:
    """The annotation of an attribute path (through optional dataclasses and mappings)."""
    tp: Any = PipelineConfig
    for name, key in _steps(attr):
        hints = typing.get_type_hints(_strip_optional(tp))
        if name not in hints:
            raise DocsError(f"{attr}: {getattr(tp, '__name__', tp)} has no field {name!r}")
        tp = _strip_optional(hints[name])
        if key is not None:
            tp = typing.get_args(tp)[1]
    return tp


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is str:
        return "string"
    if tp is bool:
        return "boolean"
    if tp is int:
        return "integer"
    if tp is float:
        return "number"
    if origin is tuple or origin is list:
        return "list"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _show(v: Any) -> str:
    if v is _MISSING or v is None:
        return "none"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, str):
        return f"`{v}`" if v else '`""`'
    if isinstance(v, tuple | list):
        return "`[" + ", ".join(str(x) for x in v) + "]`"
    if isinstance(v, Mapping):
        return "`{}`" if not v else "`{" + ", ".join(f"{k}: {x}" for k, x in v.items()) + "}`"
    if dataclasses.is_dataclass(v) and hasattr(v, "kind"):
        return f"`{v.kind}`"
    return f"`{v}`"


# --- what the parser says about a field ---------------------------------------------------------

def _default(name: str, f: Field) -> str:
    if f.default is not None:
        return f.default
    sink, mode = _bases_for(f)[0]
    raw = _base(sink, mode)
    had = _drop(raw, name)
    cfg, err = _parse(raw)
    if err is not None:
        if had and (err.field == name or err.field.startswith(name + ".")):  # type: ignore[attr-defined]
            return "required"
        raise DocsError(f"{name}: the minimal {sink} pipeline without it is refused: {err}")
    return _show(_value(cfg, f.attr))


def _allowed(name: str, f: Field) -> str:
    if f.allowed is not None:
        return f.allowed
    found: dict[str, list[str]] = {}
    for sink, mode in _bases_for(f):
        raw = _base(sink, mode)
        _set(raw, name, PROBE)
        _, err = _parse(raw)
        m = re.search(r"one of (\[.*?\])", getattr(err, "message", "")) if err else None
        if err is None or m is None or err.field != name:  # type: ignore[attr-defined]
            continue
        found.setdefault(mode, ast.literal_eval(m.group(1)))
    if not found:
        return ""
    shown = {mode: ", ".join(f"`{v}`" for v in vals) for mode, vals in found.items()}
    if len(set(shown.values())) == 1:
        return next(iter(shown.values()))
    return "; ".join(f"{mode}: {vals}" for mode, vals in shown.items())


# --- the checks ---------------------------------------------------------------------------------

def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _prefixes() -> set[str]:
    """Every section FIELDS describes fields of (`sink`, `sink.catalog`, ...)."""
    return {".".join(n.split(".")[:i]) for n in FIELDS for i in range(1, n.count(".") + 1)}


def _sections() -> set[str]:
    """The sections whose keys the parser closes (it refuses unknown ones): probed."""
    return _prefixes() - OPEN_SECTIONS


def _children(section: str, sink: str) -> set[str]:
    """The keys FIELDS describes directly in `section` for a sink type: fields and
    sub-sections with a field of that sink type."""
    fields = {n for n, f in FIELDS.items() if _parent(n) == section and sink in f.sinks}
    subs = {p for p in _prefixes() if _parent(p) == section
            and any(n.startswith(p + ".") and sink in f.sinks for n, f in FIELDS.items())}
    return fields | subs


def _dataclass_paths(tp: Any, prefix: str = "") -> Iterator[str]:
    for name, hint in typing.get_type_hints(tp).items():
        path = f"{prefix}{name}"
        inner = _strip_optional(hint)
        yield path
        if dataclasses.is_dataclass(inner):
            yield from _dataclass_paths(inner, path + ".")


def check() -> None:
    """Fail when the schema and FIELDS disagree (see the module docstring)."""
    problems: list[str] = []
    described = set(FIELDS)
    # keys the parser accepts, per section (sink per type), against FIELDS
    for sink, mode in BASES:
        raw = _base(sink, mode)
        for section in sorted(_sections() | {""}):
            if section.startswith("sink") and mode != "append":
                continue
            prefix = f"{section}." if section else ""
            accepted = {prefix + k for k in _allowed_keys(raw, section)}
            mine = _children(section, sink)
            for key in sorted(accepted - mine):
                if key in described or key in _prefixes():
                    # described for other sink types: the parser must refuse it for this one
                    probe = _base(sink, mode)
                    _set(probe, key, PROBE)
                    _, err = _parse(probe)
                    if err is None or not err.field.startswith(key):  # type: ignore[attr-defined]
                        problems.append(f"{key}: accepted with sink.type {sink} but not "
                                        f"described for it (Field.sinks)")
                else:
                    problems.append(f"{key}: accepted by the parser (sink.type {sink}) but "
                                    f"has no description in docs/hooks/config_reference.py")
            for key in sorted(mine - accepted):
                problems.append(f"{key}: described for sink.type {sink} but the parser "
                                f"does not accept it")
    # every attribute path resolves, and every PipelineConfig attribute is described
    attrs = set()
    for name, f in FIELDS.items():
        try:
            _hint(f.attr)
        except DocsError as e:
            problems.append(f"{name}: {e}")
        attrs.add(re.sub(r"\[\w+\]", "", f.attr))
    for path in _dataclass_paths(PipelineConfig):
        covered = (path in NOT_FROM_YAML or path in attrs
                   or any(path.startswith(a + ".") for a in attrs))
        has_parts = any(a.startswith(path + ".") for a in attrs)
        if not covered and not has_parts:
            problems.append(f"PipelineConfig.{path}: no YAML field in FIELDS sets it (add its "
                            f"field, or list it in NOT_FROM_YAML)")
    for path in NOT_FROM_YAML:
        try:
            _hint(path)
        except DocsError:
            problems.append(f"NOT_FROM_YAML names {path}, which PipelineConfig lacks")
    if problems:
        raise DocsError("the configuration reference and the schema disagree:\n  "
                        + "\n  ".join(dict.fromkeys(problems)))


# --- rendering ----------------------------------------------------------------------------------

def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def reference() -> str:
    """The reference as Markdown: one table per section."""
    check()
    groups: dict[str, list[str]] = {}
    for name in FIELDS:
        section = _parent(name)
        if section == "sink.catalog":
            section = "sink"
        groups.setdefault(section, []).append(name)
    out: list[str] = []
    titles = {"": "Top level"}
    for section, names in groups.items():
        out += [f"### {titles.get(section, section)}", ""]
        sink_col = section == "sink"
        head = ["Field", "Type", "Default", "Allowed values", "Description"]
        if sink_col:
            head.insert(1, "Sinks")
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in names:
            f = FIELDS[name]
            row = [f"`{name}`", f.type or _type_name(_hint(f.attr)), _default(name, f),
                   _allowed(name, f), f.desc]
            if sink_col:
                row.insert(1, "all" if f.sinks == SINK_TYPES else ", ".join(f.sinks))
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
        out.append("")
    return "\n".join(out)


# --- the docs' examples -------------------------------------------------------------------------

YAML_BLOCK = re.compile(r"^```ya?ml[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
ENV_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}")


def check_examples(markdown: str, where: str) -> int:
    """Parse every ```yaml block of a page as a pipeline (see the module docstring)."""
    import yaml

    count = 0
    for m in YAML_BLOCK.finditer(markdown):
        line = markdown.count("\n", 0, m.start()) + 1
        text = m.group(1)
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise DocsError(f"{where}:{line}: the yaml example is not valid YAML: {e}") from e
        if not isinstance(doc, Mapping):
            raise DocsError(f"{where}:{line}: the yaml example is not a mapping")
        if "name" in doc or {"source", "sink"} <= set(doc):
            raw = dict(doc)
        else:
            raw = {**copy.deepcopy(EXAMPLE_BASE), **doc}
        env = {"OFFSETFLOW_PG_DSN": "postgresql://offsetflow@localhost/offsetflow"}
        env.update({v.group(1): f"example-{v.group(1).lower()}"
                    for v in ENV_VAR.finditer(text) if v.group(2) is None})
        _, err = _parse(raw, env, source=f"{where}:{line}")
        if err is not None:
            raise DocsError(f"{where}:{line}: the yaml example does not parse: "
                            f"{err.field}: {err.message}")  # type: ignore[attr-defined]
        count += 1
    return count


# --- MkDocs hooks -------------------------------------------------------------------------------

def _plugin_error(e: DocsError) -> Exception:
    from mkdocs.exceptions import PluginError

    return PluginError(str(e))


def on_pre_build(config: Any) -> None:
    try:
        check()
        readme = ROOT / "README.md"
        check_examples(readme.read_text(), "README.md")
    except DocsError as e:
        raise _plugin_error(e) from e


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    where = f"docs/{page.file.src_path}"
    try:
        check_examples(markdown, where)
        if MARKER in markdown:
            markdown = markdown.replace(MARKER, reference())
    except DocsError as e:
        raise _plugin_error(e) from e
    return markdown


def main(argv: list[str]) -> int:
    run: Callable[[], str] = reference
    try:
        print(run())
    except DocsError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
