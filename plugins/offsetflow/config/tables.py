"""The field tables of a pipeline YAML: which keys each section takes, of which kind, with
which allowed values. The parser reads with them (its unknown-field and allowed-value checks)
and `offsetflow schema` generates the editors' JSON Schema from them, so the two cannot
drift; the rules between fields (exclusive fields, columns of format.schema) stay in the
parser. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass

from offsetflow.config.iceberg_sink import CATALOG_TYPES
from offsetflow.config.schema import (
    CONN_ID_RE,
    DOTTED_RE,
    IDENT_RE,
    ISOLATION_LEVELS,
    NAME_RE,
    TOMBSTONE_POLICIES,
    TOPIC_RE,
)

SINK_TYPES = ("postgres", "kafka", "iceberg")
PG_ICE = ("postgres", "iceberg")
_IDENT = IDENT_RE.pattern.strip("^$")
COLUMN = IDENT_RE.pattern
TABLE = rf"^{_IDENT}(\.{_IDENT})?$"  # `table` or `schema.table` (config.validate_table_name)


@dataclass(frozen=True)
class Spec:
    """One field. `kind`: string, integer, number, boolean, mapping (free keys), section (a mapping
    of fields of this table), strings (a string or a list of them), starting, any."""

    kind: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    exclusive: bool = False  # the minimum itself is refused (number: > minimum)
    pattern: str | None = None  # the value's (strings: each item's) form, as a regex
    sinks: tuple[str, ...] = SINK_TYPES  # in `sink`: the sink types that take it
    nullable: bool = False  # null means "not given"
    required: bool = False  # (in `sink`: for its sink types)
    env: bool = False  # `${VAR}` / `${VAR:-default}` is resolved in it


def _choice(*values: str) -> Spec:
    return Spec("string", choices=values, env=True)


S = Spec
# every field, by dotted name; a section's own entry (kind "section") precedes its fields
FIELDS: dict[str, Spec] = {
    "name": S("string", pattern=NAME_RE.pattern, env=True),
    "description": S("any", nullable=True),
    "schedule": S("string", nullable=True),
    "retries": S("integer", minimum=0, nullable=True),
    "pool": S("string", nullable=True, env=True),
    "kafka": S("section", required=True),
    "kafka.bootstrap_servers": S("string", nullable=True, env=True),
    "kafka.isolation_level": _choice(*sorted(ISOLATION_LEVELS)),
    "kafka.client": S("mapping", nullable=True),
    "kafka.conn_id": S("string", pattern=CONN_ID_RE.pattern, nullable=True, env=True),
    "source": S("section", required=True),
    "source.topics": S("strings", pattern=TOPIC_RE.pattern, nullable=True),
    "source.topic_pattern": S("string", nullable=True, env=True),
    "source.starting": S("starting"),
    "source.max_records_per_partition": S("integer", minimum=1, nullable=True),
    "source.max_records_per_batch": S("integer", minimum=1, nullable=True),
    "source.data_loss": _choice("fail", "continue"),
    "source.rate": S("section", nullable=True),
    "source.rate.adaptive": _choice("pid"),
    "source.rate.proportional": S("number", minimum=0, nullable=True),
    "source.rate.integral": S("number", minimum=0, nullable=True),
    "source.rate.derived": S("number", minimum=0, nullable=True),
    "source.rate.min_rate": S("number", minimum=0, exclusive=True, nullable=True),
    "source.rate.interval_s": S("number", minimum=0, exclusive=True, nullable=True),
    "format": S("section", nullable=True),
    "format.type": _choice("json", "raw", "avro", "json_schema", "protobuf"),
    "format.schema": S("mapping", nullable=True),
    "format.key": S("section", nullable=True),
    "format.key.type": _choice("avro"),
    "format.schema_evolution": _choice("add_columns", "fail"),
    "format.schema_registry": S("section", nullable=True),
    "format.schema_registry.url": S("string", nullable=True, env=True),
    "format.schema_registry.conn_id": S("string", pattern=CONN_ID_RE.pattern, nullable=True,
                                        env=True),
    "format.schema_registry.username": S("string", nullable=True, env=True),
    "format.schema_registry.password": S("string", nullable=True, env=True),
    "format.schema_registry.reader_version": S("integer", minimum=1, nullable=True),
    "format.schema_registry.timeout_s": S("integer", minimum=1, nullable=True),
    "transform": S("string", pattern=DOTTED_RE.pattern, nullable=True, env=True),
    "sink": S("section", required=True),
    "sink.type": _choice(*SINK_TYPES),
    "sink.connection": S("string", nullable=True, env=True),
    "sink.conn_id": S("string", pattern=CONN_ID_RE.pattern, nullable=True, env=True),
    "sink.table": S("string", pattern=TABLE, sinks=PG_ICE, required=True),
    "sink.mode": Spec("string", choices=("append", "upsert"), sinks=PG_ICE, env=True),
    "sink.key": S("strings", pattern=COLUMN, sinks=PG_ICE, nullable=True),
    "sink.topic": S("string", pattern=TOPIC_RE.pattern, sinks=("kafka",), env=True,
                     required=True),
    "sink.replay_topic": S("string", pattern=TOPIC_RE.pattern, sinks=("kafka",),
                           nullable=True, env=True),
    "sink.key_column": S("string", pattern=COLUMN, sinks=("kafka",), nullable=True),
    "sink.value_format": Spec("string", choices=("json", "raw", "avro"), sinks=("kafka",),
                              env=True),
    "sink.value_subject": S("string", sinks=("kafka",), nullable=True),
    "sink.value_schema": S("string", sinks=("kafka",), nullable=True),
    "sink.schema_registry": S("section", sinks=("kafka",), nullable=True),
    "sink.schema_registry.url": S("string", nullable=True, env=True),
    "sink.schema_registry.conn_id": S("string", pattern=CONN_ID_RE.pattern, nullable=True,
                                      env=True),
    "sink.schema_registry.username": S("string", nullable=True, env=True),
    "sink.schema_registry.password": S("string", nullable=True, env=True),
    "sink.schema_registry.timeout_s": S("integer", minimum=1, nullable=True),
    "sink.value_columns": S("strings", pattern=COLUMN, sinks=("kafka",), nullable=True),
    "sink.value_column": S("string", pattern=COLUMN, sinks=("kafka",)),
    "sink.headers": Spec("string", choices=("carry", "none"), sinks=("kafka",), env=True),
    "sink.partitioning": Spec("string", choices=("key", "source"), sinks=("kafka",), env=True),
    "sink.producer": S("mapping", sinks=("kafka",), nullable=True),
    "sink.task_files": S("string", sinks=("kafka",), nullable=True, env=True),
    # the task files' mode (octal, quoted): who besides their writer may read the records
    "sink.task_files_mode": Spec("string", choices=("0600", "0640", "0644"),
                                 sinks=("kafka",), env=True),
    "sink.catalog": S("mapping", sinks=("iceberg",), nullable=True),
    "sink.partition_by": S("strings", sinks=("iceberg",), nullable=True),
    "sink.sort_by": S("strings", sinks=("iceberg",), nullable=True),
    "sink.target_file_mb": S("integer", minimum=1, sinks=("iceberg",)),
    "bad_records": _choice("fail", "dead_letter"),
    "dead_letter_table": S("string", pattern=TABLE),
    "tombstones": _choice(*dict.fromkeys(p for ps in TOMBSTONE_POLICIES.values() for p in ps)),
    "spark": S("section", nullable=True),
    "spark.master": S("string", env=True),
    "spark.max_offsets_per_task": S("integer", minimum=1, nullable=True),
    "spark.conf": S("mapping", nullable=True),
    "spark.launch": _choice("submit", "connect"),
    "spark.connect_url": S("string", env=True),
    "quality": S("section", nullable=True),
    "quality.suite": S("string", nullable=True, env=True),
    "quality.on_failure": _choice("fail", "dead_letter"),
}

# sink.catalog: the keys OffsetFlow reads; any other is passed to pyiceberg's load_catalog
CATALOG_FIELDS: dict[str, Spec] = {
    "type": S("string", choices=CATALOG_TYPES),
    "name": S("string"),
    "uri": S("string"),
    "warehouse": S("string"),
}


def section_fields(section: str, sink_type: str | None = None) -> set[str]:
    """The keys `section` ("" for the top level) takes; in `sink`, those of `sink_type`
    (None: of any sink type)."""
    prefix = f"{section}." if section else ""
    return {name[len(prefix):] for name, spec in FIELDS.items()
            if name.startswith(prefix) and "." not in name[len(prefix):]
            and (sink_type is None or sink_type in spec.sinks)}


def choices(name: str) -> set[str]:
    """The allowed values of field `name` (dotted)."""
    return set(FIELDS[name].choices)
