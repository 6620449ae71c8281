"""The Apache Iceberg sink's pure parts: its config section, partition-spec and sort-order
parsing, and the snapshot summary that makes a batch's commit findable (no I/O here; the
sink itself is `offsetflow.sinks.iceberg.sink`).

A batch's snapshot carries `offsetflow.pipeline`, `offsetflow.batch-id`, `offsetflow.kind`
and `offsetflow.ranges` in its summary, the way Flink's Iceberg sink records its checkpoint
id: a retry looks for them before it writes, so a batch is appended once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlsplit

from offsetflow.errors import ConfigError, OffsetFlowError

if TYPE_CHECKING:  # config.fields imports this module (through config.schema)
    from offsetflow.config.fields import FieldReader

T = TypeVar("T")

CATALOG_TYPES = ("sql", "rest", "glue", "hive")
DEFAULT_NAMESPACE = "offsetflow"
DEFAULT_CATALOG_NAME = "offsetflow"
# transforms Iceberg defines (`bucket` and `truncate` take a width)
TRANSFORMS = {"identity", "year", "month", "day", "hour", "bucket", "truncate", "void"}
# the Iceberg types each transform takes (the spec's table; a unit test holds it to
# pyiceberg's `Transform.can_transform`): a table column's type as `column_kind` names it
_ANY = frozenset({"string", "int", "long", "float", "double", "boolean", "timestamptz",
                  "timestamp", "date", "binary", "decimal"})
_TIMES = frozenset({"date", "timestamp", "timestamptz"})
TRANSFORM_TYPES: dict[str, frozenset[str]] = {
    "identity": _ANY, "void": _ANY,
    "bucket": frozenset({"int", "long", "decimal", "date", "timestamp", "timestamptz",
                         "string", "binary"}),
    "truncate": frozenset({"int", "long", "decimal", "string", "binary"}),
    "year": _TIMES, "month": _TIMES, "day": _TIMES,
    "hour": frozenset({"timestamp", "timestamptz"}),
}
# time transforms of one column are redundant to Iceberg (Java's spec builder refuses two)
_TIME_TRANSFORMS = ("year", "month", "day", "hour")
MAX_WIDTH = 2**31 - 1  # bucket count and truncate width are Iceberg ints
# the Iceberg type of a target column, by its config type (format.schema) or PostgreSQL
# stage type: nested values land as JSON text
_KINDS = {"string": "string", "text": "string", "jsonb": "string", "long": "long",
          "bigint": "long", "int": "int", "integer": "int", "smallint": "int",
          "double": "double", "double precision": "double", "float": "float",
          "real": "float", "boolean": "boolean", "timestamp": "timestamptz",
          "timestamptz": "timestamptz", "date": "date", "binary": "binary",
          "bytea": "binary", "uuid": "string"}  # json, uuid: Iceberg strings
_PARTITION_RE = re.compile(r"^\s*(?:(\w+)\(\s*(?:(\d+)\s*,\s*)?(\w+)\s*\)|(\w+))\s*$")
_SORT_RE = re.compile(r"^\s*(\w+)(?:\s+(asc|desc))?(?:\s+nulls\s+(first|last))?\s*$", re.I)

SUMMARY_PIPELINE = "offsetflow.pipeline"
SUMMARY_BATCH = "offsetflow.batch-id"
SUMMARY_KIND = "offsetflow.kind"
SUMMARY_RANGES = "offsetflow.ranges"
SUMMARY_ROWS = "offsetflow.rows"
SUMMARY_DEAD = "offsetflow.dead-letters"
# the ledger that committed the batch (its identity), and the oldest batch of the pipeline
# still open in that ledger when it did: maintenance run from another ledger cannot ask it
# which of its batches are open, the table tells (`offsetflow.sinks.iceberg.maint`)
SUMMARY_LEDGER = "offsetflow.ledger"
SUMMARY_OPEN_FLOOR = "offsetflow.open-floor"


class BatchIdentityError(OffsetFlowError):
    """A snapshot names this pipeline's batch id but other ranges: batch ids were reused
    (a ledger restored or rebuilt, two deployments on one table), so it is not this
    batch; neither "found" (records lost) nor "missing" (maybe written twice) is safe."""


def column_kind(type_name: str) -> str:
    """The Iceberg type (as `TRANSFORM_TYPES` names it) of a column of config type
    `type_name` (format.schema's `long`, `decimal(10,2)`) or PostgreSQL stage type."""
    t = type_name.strip().lower()
    if t.startswith(("decimal(", "numeric(")):
        return "decimal"
    return _KINDS.get(t, "string")


@dataclass(frozen=True)
class PartitionField:
    column: str
    transform: str  # pyiceberg's spelling: identity, day, bucket[16], truncate[4]

    @property
    def base(self) -> str:
        """The transform without its width: `bucket` of `bucket[16]`."""
        return self.transform.split("[", 1)[0]

    def spelled(self) -> str:
        """As a config names it: `bucket(16, event_id)`, `day(timestamp)`, `partition`."""
        if self.base == "identity":
            return self.column
        width = self.transform[len(self.base) + 1:-1] if "[" in self.transform else ""
        return f"{self.base}({width + ', ' if width else ''}{self.column})"

    @property
    def name(self) -> str:
        """The partition field's name, as Spark names it (`event_id_bucket`)."""
        base = self.transform.split("[", 1)[0]
        return self.column if base == "identity" else f"{self.column}_{base}"


@dataclass(frozen=True)
class SortField:
    column: str
    descending: bool = False
    nulls_first: bool = False


@dataclass(frozen=True)
class IcebergConfig:
    """`sink.type: iceberg`: where the table's catalog is and how the table is laid out."""

    catalog_type: str = "sql"
    catalog_name: str = DEFAULT_CATALOG_NAME
    # pyiceberg catalog properties (uri, warehouse, credentials ...); the SQL catalog's `uri`
    # defaults to the sink's PostgreSQL (sink.connection) as a SQLAlchemy URL
    properties: Mapping[str, str] = field(default_factory=dict, repr=False)
    namespace: str = DEFAULT_NAMESPACE
    table: str = ""
    partition_by: tuple[PartitionField, ...] = ()
    sort_by: tuple[SortField, ...] = ()
    target_file_mb: int = 128
    source_file: str = ""  # the pipeline file, for errors naming a field of it

    @property
    def identifier(self) -> str:
        return f"{self.namespace}.{self.table}"


def layout_drift(cfg: IcebergConfig, partitioned: Sequence[tuple[str, str]],
                 sorted_by: Sequence[SortField], file_bytes: int | None) -> list[str]:
    """How an existing table's layout (partition fields as (column, transform), sort
    fields, write.target-file-size-bytes) differs from the config's, in words; the config
    shapes only a table OffsetFlow creates, so an edit afterwards would otherwise go
    unnoticed."""
    out = []
    want_p = [(f.column, f.transform) for f in cfg.partition_by]
    if list(partitioned) != want_p:
        out.append(f"partitioned by {_show_partition(partitioned)} but sink.partition_by "
                   f"says {_show_partition(want_p)}")
    if list(sorted_by) != list(cfg.sort_by):
        out.append(f"sorted by {_show_sort(sorted_by)} but sink.sort_by says "
                   f"{_show_sort(cfg.sort_by)}")
    if file_bytes is not None and file_bytes != cfg.target_file_mb << 20:
        out.append(f"target file size {file_bytes / (1 << 20):g} MB but "
                   f"sink.target_file_mb says {cfg.target_file_mb}")
    return out


def _show_partition(fields: Sequence[tuple[str, str]]) -> str:
    return "[" + ", ".join(c if t == "identity" else f"{t}({c})" for c, t in fields) + "]"


def _show_sort(fields: Sequence[SortField]) -> str:
    return "[" + ", ".join(f"{f.column} {'desc' if f.descending else 'asc'}"
                           + (" nulls first" if f.nulls_first else "") for f in fields) + "]"


def resolve_identifier(cfg: IcebergConfig, sink_table: str, target_table: str) -> str:
    """The Iceberg table a batch writes, as `namespace.table`: the pipeline's own when
    `target_table` names `sink.table` (`t`, `public.t` and `offsetflow.t` are all the table
    `sink.table: t` lands in), else `target_table` with namespace offsetflow by default.
    Compare these, never the spellings, to decide "the pipeline's own table"."""
    if _pg_name(target_table) == _pg_name(sink_table):
        return cfg.identifier
    ns, _, name = target_table.rpartition(".")
    return f"{ns or DEFAULT_NAMESPACE}.{name}"


def _pg_name(table: str) -> tuple[str, str]:
    """`config_schema.split_table_name` (a PostgreSQL name: schema public by default)."""
    ns, _, name = table.rpartition(".")
    return ns or "public", name


def parse_partition_field(text: Any, source: str, fld: str) -> PartitionField:
    """`event_id`, `day(timestamp)`, `bucket(16, event_id)`, `truncate(4, topic)`."""
    m = _PARTITION_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(source, fld, f"{text!r} is not a partition field; use a column or "
                                       f"transform(column), e.g. day(timestamp), "
                                       f"bucket(16, event_id)")
    if m.group(4):
        return PartitionField(m.group(4), "identity")
    transform, width, column = m.group(1).lower(), m.group(2), m.group(3)
    if transform not in TRANSFORMS:
        raise ConfigError(source, fld, f"unknown transform {transform!r}; use one of "
                                       f"{sorted(TRANSFORMS)}")
    if transform in ("bucket", "truncate"):
        if width is None or not 0 < int(width) <= MAX_WIDTH:
            raise ConfigError(source, fld, f"{transform} needs a positive width (at most "
                                           f"{MAX_WIDTH}): {transform}(N, {column})")
        return PartitionField(column, f"{transform}[{int(width)}]")
    if width is not None:
        raise ConfigError(source, fld, f"{transform} takes no width")
    return PartitionField(column, transform)


def transform_type_error(f: PartitionField, kind: str) -> str | None:
    """Why a transform cannot take a column of Iceberg type `kind` (`TRANSFORM_TYPES`):
    `day` of a string or `bucket` of a double is refused before any table is made with it."""
    if kind in TRANSFORM_TYPES[f.base]:
        return None
    takes = sorted(TRANSFORM_TYPES[f.base])
    return (f"{f.spelled()!r}: {f.base} cannot partition {f.column!r}, a {kind} column; "
            f"{f.base} takes {', '.join(takes)} columns: partition by another column or "
            f"transform")


def partition_spec_errors(fields: Sequence[tuple[int, PartitionField]]
                          ) -> list[tuple[str, str]]:
    """(field, why) of what Iceberg refuses in a spec as a whole: one field twice (one
    partition name), and two time transforms of one column (redundant: Java's spec builder
    refuses it). `fields`: (index in sink.partition_by, field)."""
    out = []
    seen: dict[str, int] = {}
    times: dict[str, int] = {}
    for i, f in fields:
        fld = f"sink.partition_by[{i}]"
        if f.name in seen:
            out.append((fld, f"{f.spelled()!r} repeats sink.partition_by[{seen[f.name]}] "
                             f"(partition field {f.name!r}); name each field once"))
            continue
        seen[f.name] = i
        if f.base in _TIME_TRANSFORMS:
            if f.column in times:
                out.append((fld, f"{f.spelled()!r}: {f.column!r} is already partitioned by "
                                 f"time in sink.partition_by[{times[f.column]}]; Iceberg "
                                 f"takes one of year, month, day, hour per column"))
            else:
                times[f.column] = i
    return out


def parse_sort_field(text: Any, source: str, fld: str) -> SortField:
    """`offset`, `event_id desc`, `timestamp asc nulls first`."""
    m = _SORT_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ConfigError(source, fld, f"{text!r} is not a sort field; use 'column [asc|desc] "
                                       f"[nulls first|last]'")
    return SortField(m.group(1), (m.group(2) or "asc").lower() == "desc",
                     (m.group(3) or "last").lower() == "first")


def parse_iceberg(r: FieldReader, raw: Mapping[str, Any], table: str, mode: str,
                  columns: Mapping[str, str] | None) -> IcebergConfig:
    """The `sink` section's Iceberg fields (`catalog`, `partition_by`, `sort_by`,
    `target_file_mb`); `table` is `namespace.table` or `table`; `mode` append or upsert
    (`sink.key` is checked with the other sinks'). `columns`: the columns the table
    will have and their Iceberg types (`column_kind`; None: a transform decides them,
    checked before the table is made, `sinks.iceberg.layout`). Errors are recorded on
    `r` (the parser's field reader)."""
    if mode not in ("append", "upsert"):
        r.fail("sink.mode", f"{mode!r}: sink.type iceberg takes mode append or upsert")
    cat = raw.get("catalog") or {}
    if not isinstance(cat, Mapping):
        raise r.err("sink.catalog", "must be a mapping (type, name, uri, warehouse, ...)")
    props = {str(k): str(v) for k, v in cat.items() if k not in ("type", "name")}
    ctype = str(cat.get("type", "sql"))
    if ctype not in CATALOG_TYPES:
        r.fail("sink.catalog.type", f"{ctype!r} is not one of {list(CATALOG_TYPES)}"
                                    f"{r.suggest(ctype, CATALOG_TYPES)}")
    if ctype in ("rest", "hive") and not props.get("uri"):
        r.fail("sink.catalog.uri", f"a {ctype} catalog needs its uri")
    if ctype == "sql" and not props.get("warehouse"):
        r.fail("sink.catalog.warehouse",
               "a sql catalog needs a warehouse (where data files go), e.g. "
               "file:///data/lake or s3://bucket/lake")
    name = str(cat.get("name", DEFAULT_CATALOG_NAME))
    parts = table.split(".")
    namespace, tname = (parts[0], parts[1]) if len(parts) == 2 else (DEFAULT_NAMESPACE, table)
    partition_by = _parsed(r, parse_partition_field, raw.get("partition_by"),
                           "sink.partition_by")
    sort_by = _parsed(r, parse_sort_field, raw.get("sort_by"), "sink.sort_by")
    for fld, msg in partition_spec_errors(partition_by):
        r.fail(fld, msg)
    if columns is not None:
        named: list[tuple[str, Sequence[tuple[int, PartitionField | SortField]]]] = [
            ("partition_by", partition_by), ("sort_by", sort_by)]
        for what, flds in named:
            for i, f in flds:
                if f.column not in columns:
                    r.fail(f"sink.{what}[{i}]", f"{f.column!r} is not a column of the table "
                                                f"({', '.join(columns)})"
                                                f"{r.suggest(f.column, columns)}")
        for i, p in partition_by:
            refused = transform_type_error(p, columns[p.column]) if p.column in columns \
                else None
            if refused:
                r.fail(f"sink.partition_by[{i}]", refused)
    mb = raw.get("target_file_mb", 128)
    if not isinstance(mb, int) or isinstance(mb, bool) or mb <= 0:
        r.fail("sink.target_file_mb", f"must be a positive integer, got {mb!r}")
    return IcebergConfig(ctype, name, props, namespace, tname,
                         tuple(f for _, f in partition_by), tuple(f for _, f in sort_by), mb,
                         r.source)


def _parsed(r: FieldReader, parse: Callable[[Any, str, str], T], v: Any, fld: str
            ) -> list[tuple[int, T]]:
    """Each item of a list field (`fld`) parsed, with its index; a bad one recorded on `r`."""
    out = []
    for i, item in enumerate(r.attempt(_as_list, v, r.source, fld) or []):
        f = r.attempt(parse, item, r.source, f"{fld}[{i}]")
        if f is not None:
            out.append((i, f))
    return out


def _as_list(v: Any, source: str, fld: str) -> list[Any]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise ConfigError(source, fld, "must be a list")
    return v


def sqlalchemy_url(dsn: str) -> str:
    """A libpq DSN (URI or key=value) as the SQLAlchemy URL pyiceberg's SQL catalog takes."""
    if dsn.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg2://" + dsn.split("://", 1)[1]
    if "://" in dsn:
        return dsn  # already a SQLAlchemy URL
    kv = dict(re.findall(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn))
    kv = {k: v.strip("'") for k, v in kv.items()}
    auth = quote(kv.pop("user", ""), safe="")
    if "password" in kv:
        auth += ":" + quote(kv.pop("password"), safe="")
    host = kv.pop("host", "localhost")
    port = kv.pop("port", "")
    db = kv.pop("dbname", "")
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in kv.items())
    return (f"postgresql+psycopg2://{auth}{'@' if auth else ''}{host}"
            f"{':' + port if port else ''}/{db}{'?' + query if query else ''}")


def catalog_identity(cfg: IcebergConfig, sink_connection: str, sink_conn_id: str | None
                     ) -> list[str]:
    """Which catalog the table is in, without secrets, for the config fingerprint: type,
    name, warehouse and where the catalog lives (its uri without user, password or query;
    for a SQL catalog on the sink's PostgreSQL, that connection's conn_id or host, port
    and database). A batch retried against another catalog would miss the snapshot an
    earlier attempt committed and write the batch into a second table."""
    uri = cfg.properties.get("uri", "")
    if uri:
        where = _uri_identity(uri)
    elif sink_conn_id:
        where = f"conn_id:{sink_conn_id}"
    else:
        where = _dsn_identity(sink_connection)
    return [cfg.catalog_type, cfg.catalog_name, cfg.properties.get("warehouse", ""), where]


def catalog_label(cfg: IcebergConfig, sink_connection: str, sink_conn_id: str | None
                  ) -> str:
    """Which catalog holds the sink's table, in words and without secrets, as the ledger
    records it with the table's identity: type, name and where it lives (`catalog_identity`
    without the warehouse, which places only tables created from now on)."""
    ctype, name, _warehouse, where = catalog_identity(cfg, sink_connection, sink_conn_id)
    # a SQL catalog's uri and the sink's DSN name one database alike
    where = re.sub(r"^postgres(?:ql)?(?:\+\w+)?://", "", where)
    return f"{ctype} catalog {name!r} at {where or '?'}"


def _uri_identity(uri: str) -> str:
    u = urlsplit(uri)
    if not u.scheme or not u.netloc:
        return uri.split("?", 1)[0] if "@" not in uri else ""
    host = u.hostname or ""
    return f"{u.scheme}://{host}{f':{u.port}' if u.port else ''}{u.path}"


def _dsn_identity(dsn: str) -> str:
    """host:port/dbname of a libpq DSN (URI or key=value); "" when it does not parse."""
    if not dsn:
        return ""
    from psycopg2.extensions import parse_dsn

    try:
        kv = parse_dsn(dsn)
    except Exception:  # noqa: BLE001  (psycopg2.ProgrammingError; no password in the output)
        return ""
    return f"{kv.get('host', '')}:{kv.get('port', '')}/{kv.get('dbname', '')}"


def catalog_properties(cfg: IcebergConfig, sink_dsn: str) -> dict[str, str]:
    """What `pyiceberg.catalog.load_catalog` gets."""
    props = {"type": cfg.catalog_type, **cfg.properties}
    if cfg.catalog_type == "sql" and not props.get("uri"):
        props["uri"] = sqlalchemy_url(sink_dsn)
    return props


def snapshot_summary(pipeline: str, batch_id: int, kind: str,
                     ranges: Sequence[tuple[str, int, int, int]], rows: int, dead: int,
                     ledger: str | None = None, open_floor: int | None = None
                     ) -> dict[str, str]:
    """The summary properties of a batch's snapshot (`ranges`: topic, partition, from, until;
    `ledger`: the committing ledger's identity, `open_floor`: the pipeline's oldest batch
    open in it, this one included)."""
    out = {SUMMARY_PIPELINE: pipeline, SUMMARY_BATCH: str(batch_id), SUMMARY_KIND: kind,
           SUMMARY_RANGES: json.dumps([list(r) for r in ranges], separators=(",", ":")),
           SUMMARY_ROWS: str(rows), SUMMARY_DEAD: str(dead)}
    if ledger is not None:
        out[SUMMARY_LEDGER] = ledger
    if open_floor is not None:
        out[SUMMARY_OPEN_FLOOR] = str(open_floor)
    return out


def summary_batch(summary: Mapping[str, str], pipeline: str, batch_id: int,
                  ledger: str | None = None) -> tuple[int, int] | None:
    """(rows, dead letters) when `summary` is the snapshot of this pipeline's batch. With
    `ledger`, a snapshot another ledger committed (its pipeline of the same name, whose
    batch ids are its own) is not; one that names no ledger (written before it was
    recorded) may be."""
    if summary.get(SUMMARY_PIPELINE) != pipeline or summary.get(SUMMARY_BATCH) != str(batch_id):
        return None
    if ledger is not None and summary.get(SUMMARY_LEDGER, ledger) != ledger:
        return None
    return int(summary.get(SUMMARY_ROWS, "0")), int(summary.get(SUMMARY_DEAD, "0"))


def check_summary_ranges(summary: Mapping[str, str], pipeline: str, batch_id: int,
                         ranges: Sequence[tuple[str, int, int, int]], snapshot: str) -> None:
    """Raise BatchIdentityError unless the snapshot `summary_batch` matched recorded the
    batch's very ranges (`snapshot`: how the error names it)."""
    try:
        recorded = sorted((str(t), int(p), int(lo), int(hi))
                          for t, p, lo, hi in json.loads(summary.get(SUMMARY_RANGES, "[]")))
    except (ValueError, TypeError):
        recorded = []
    if recorded == sorted(ranges):
        return

    def show(rs: Sequence[tuple[str, int, int, int]]) -> str:
        return ", ".join(f"{t}[{p}] [{lo}, {hi})" for t, p, lo, hi in rs) or "none"

    raise BatchIdentityError(
        f"batch {batch_id} of pipeline {pipeline}: Iceberg snapshot {snapshot} names this "
        f"batch with ranges {show(recorded)} but the ledger's batch has {show(sorted(ranges))}"
        f"; a ledger restored or rebuilt, or two deployments writing one table under one "
        f"pipeline name, reuse batch ids. Nothing was written and the ledger did not move: "
        f"find which ledger belongs to the table, and give another deployment its own "
        f"pipeline name or table")
