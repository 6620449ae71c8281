"""What runs inside the job's Spark tasks: read planned sub-ranges with one consumer per
task, turn each chunk into the stage's rows, and stage them (`offsetflow.stage.part`).

The driver (`offsetflow.job.driver`) builds these task functions with `make_reader`,
`make_writer` or `make_read_and_stage` and hands them to `mapInArrow`; Spark pickles them,
so everything they call lives at module level here, importable on the executors from the
shipped package. Only plain values cross to the tasks (`ReadContext`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetflow.commit import pg_type
from offsetflow.config import DECIMAL_RE, TYPED_FORMATS, PipelineConfig
from offsetflow.errors import TaskReportedError, reported_error
from offsetflow.ledger import stage_part_table
from offsetflow.ranges import OffsetRange
from offsetflow.stage import (
    BadBuffer,
    BadRows,
    SubrangeBad,
    TaskClock,
    binary_encoder,
    note_schema_ids,
    stage_rows,
)

if TYPE_CHECKING:
    from offsetflow.sinks.iceberg import TaskFiles

RAW_DDL = ("`topic` string, `partition` int, `offset` bigint, `timestamp` timestamp, "
           "`timestamp_type` int, `key` binary, `value` binary, "
           "`headers` array<struct<key:string,value:binary>>")
SPARK_TYPES = {"string": "string", "long": "bigint", "int": "int", "double": "double",
               "float": "float", "boolean": "boolean", "timestamp": "timestamp", "date": "date",
               "json": "string", "uuid": "string"}
# declared types whose PostgreSQL column is not the one of their Spark type (fused path)
PG_TYPES = {"json": "jsonb", "uuid": "uuid"}


def spark_ddl(cfg: PipelineConfig) -> str:
    """The rows `make_reader`'s tasks hand Spark: raw columns + the config's typed fields."""
    fields = [f"`{name}` {SPARK_TYPES.get(t, t if DECIMAL_RE.match(t) else 'string')}"
              for name, t in cfg.schema.items()]
    return ", ".join([RAW_DDL, *fields])


@dataclass(frozen=True)
class ReadContext:
    """What a task needs to read one sub-range: plain values, cheap to ship to workers (and
    a connection's librdkafka callbacks, e.g. `oauth_cb`, which pickle by reference)."""

    batch_id: int
    dsn: str = field(repr=False)  # secrets: not in a traceback's or log line's repr
    pipeline: str
    consumer_conf: dict[str, Any] = field(repr=False)
    schema: dict[str, str]
    fmt: str
    write_dead: bool
    specs: list[dict[str, Any]]
    generation: int | None = None  # the stage generation the run stages under
    # format avro: the registry (`source.registry_settings`) and each topic's reader schema
    # (id, text; None: records are read with their writer schema), resolved once per run
    # (its password: not in a repr, as `dsn`); protobuf and json_schema under
    # format.schema_evolution or with a json column (`resolves_latest`): the subject's
    # latest, which decides the columns and nested types only
    registry: dict[str, Any] | None = field(default=None, repr=False)
    readers: dict[str, tuple[int, str] | None] | None = None
    # format.key avro: each topic's `<topic>-key` reader schema (latest), as `readers`
    key_readers: dict[str, tuple[int, str] | None] | None = None

    @classmethod
    def of(cls, cfg: PipelineConfig, batch_id: int, dsn: str, specs: list[dict[str, Any]],
           generation: int | None = None,
           pinned: dict[str, tuple[int, str] | None] | None = None,
           pinned_keys: dict[str, tuple[int, str] | None] | None = None) -> ReadContext:
        """`pinned` (`pinned_keys`): the batch's value (Avro key) reader schemas, pinned by
        its first run (`job.evolution.pinned_readers`); None: resolved here (the subject's
        latest)."""
        registry = readers = key_readers = None
        if cfg.registry is not None:
            from offsetflow.source import (
                SCHEMA_TYPES,
                RegistryClient,
                reader_schemas,
                registry_settings,
                value_schemas,
            )

            reg = cfg.registry
            registry = registry_settings(reg.url, reg.username, reg.password, reg.timeout_s)
            topics = [str(s["topic"]) for s in specs]
            # on the driver, before any task: a registry that is down fails the run here
            client = RegistryClient.of(registry)
            if cfg.format_type == "avro":
                readers = pinned if pinned is not None \
                    else reader_schemas(client, topics, reg.reader_version)
            elif resolves_latest(cfg):
                # protobuf, json_schema: records are read with their writer schema; the
                # subject's latest decides the evolved columns and the nested types
                readers = pinned if pinned is not None else value_schemas(
                    client, topics, SCHEMA_TYPES[cfg.format_type],
                    strict=cfg.schema_evolution is not None)
            if cfg.key_format == "avro":
                key_readers = pinned_keys if pinned_keys is not None \
                    else reader_schemas(client, topics, None, part="key")
        schema = dict(cfg.schema)
        if cfg.schema_evolution == "add_columns" and readers:
            schema.update(added_columns(cfg, readers))
        return cls(batch_id, dsn, cfg.name, cfg.consumer_settings(), schema,
                   cfg.format_type, cfg.bad_records == "dead_letter", specs, generation,
                   registry, readers, key_readers)

    @property
    def reader_ids(self) -> dict[str, int | None] | None:
        """Each topic's reader schema id (None: read with the writer's); None for formats
        without a registry."""
        if self.registry is None:
            return None
        return {t: None if r is None else r[0] for t, r in (self.readers or {}).items()}

    def added(self, declared: dict[str, str]) -> dict[str, str]:
        """The columns schema evolution adds to `declared` (format.schema)."""
        return {c: t for c, t in self.schema.items() if c not in declared}

    def added_defaults(self, added: dict[str, str]) -> dict[str, Any]:
        """What the rows already in the target take in the `added` columns: the reader
        schema's defaults, as a record of an older writer gets them (`field_defaults`)."""
        if not added or not self.readers or self.fmt != "avro":
            return {}  # Protobuf, JSON Schema: a record without the field has NULL
        from offsetflow.source import field_defaults

        return field_defaults(self.readers, added)

    def typed_schema(self) -> pa.Schema | None:
        """The Arrow schema of the typed columns (None: raw format)."""
        from offsetflow.source import arrow_schema

        return arrow_schema(self.schema) if self.fmt in TYPED_FORMATS else None


def resolves_latest(cfg: PipelineConfig) -> bool:
    """Protobuf and JSON Schema values: whether a run resolves (and its batch pins) the
    subject's latest version as its reader, which records are not decoded with: under
    format.schema_evolution (its fields beyond format.schema are columns) or with a `json`
    column (its message, object or array is an Iceberg table's struct, list or map)."""
    return cfg.format_type in ("protobuf", "json_schema") and (
        cfg.schema_evolution is not None or "json" in cfg.schema.values())


def added_columns(cfg: PipelineConfig, readers: dict[str, tuple[int, str] | None]
                  ) -> dict[str, str]:
    """format.schema_evolution add_columns: the reader schemas' top-level fields that
    format.schema does not declare, as columns (name -> format.schema type); the batch
    stops (SchemaEvolutionError) on a field that cannot become one."""
    from offsetflow.config import IDENT_RE, RESERVED_COLUMNS
    from offsetflow.errors import SchemaEvolutionError
    from offsetflow.source import SCHEMA_TYPES, evolved_columns

    try:
        added = evolved_columns({t: None if r is None else r[1] for t, r in readers.items()},
                                cfg.schema, RESERVED_COLUMNS, SCHEMA_TYPES[cfg.format_type])
        for name, t in added.items():
            if not IDENT_RE.match(name) or name.startswith("_offsetflow"):
                raise ValueError(f"field {name!r} is not a column name OffsetFlow adds "
                                 f"(letters, digits and _, at most 63 characters)")
            if t.startswith("decimal(") and not DECIMAL_RE.match(t):
                raise ValueError(f"field {name!r}: {t} is not a decimal(p,s) type")
    except ValueError as e:
        ids = {t: r[0] for t, r in readers.items() if r is not None}
        out = ("declare the field in format.schema, or pin "
               "format.schema_registry.reader_version to an earlier version"
               if cfg.format_type == "avro" else
               "the reader is the subject's latest version: declare the field in "
               "format.schema where its name can be a column, or remove "
               "format.schema_evolution and run the batch with --accept-config-change (the "
               "field is then ignored, as any field format.schema does not declare)")
        raise SchemaEvolutionError(
            f"pipeline {cfg.name}: the reader schema (ids {ids}) cannot add columns: {e}; "
            f"{out}; nothing was read or committed") from None
    return added


_DECODERS: dict[str, Any] = {}


def avro_decoder(rc: ReadContext, part: str = "value") -> Any:
    """The Python worker's decoder for `rc`'s registry and reader schemas (of the values, or
    `part` key: of the keys): writer schemas are fetched once per id per worker (a
    registry's ids are immutable), not per chunk; json_schema's id checks likewise."""
    from offsetflow.source import AvroDecoder, JsonSchemaIds, ProtobufDecoder, RegistryClient

    assert rc.registry is not None
    readers = rc.key_readers if part == "key" else rc.readers
    key = repr((part, rc.fmt, sorted(rc.registry.items()), sorted((readers or {}).items())))
    if key not in _DECODERS:
        if len(_DECODERS) > 8:
            _DECODERS.clear()  # other runs' (other reader schemas): let them go
        client = RegistryClient.of(rc.registry)
        if part == "value" and rc.fmt == "json_schema":
            _DECODERS[key] = JsonSchemaIds(client)
        elif part == "value" and rc.fmt == "protobuf":
            _DECODERS[key] = ProtobufDecoder(client)
        else:
            _DECODERS[key] = AvroDecoder(client, readers or {})
    return _DECODERS[key]


def read_subrange(rc: ReadContext, idx: int, clock: TaskClock,
                  bad_sink: BadBuffer | None = None, consumer: Any = None
                  ) -> Iterator[pa.RecordBatch]:
    """Raw columns + typed fields of sub-range `idx`, chunk by chunk. Bad records go to
    `bad_sink` (the caller's staging transaction), else to a `SubrangeBad` that records
    them keyed by coordinates and writes the sub-range's marker when it is read to its end.
    A tombstone (null value) is a row with a null `value` (see
    `deserialize.tombstone_fields`). `consumer`: the task's own (`reader.range_consumer`),
    shared by the small sub-ranges it reads (a large one, or None: a consumer of its
    own for this sub-range)."""
    from offsetflow.source import SHARED_MAX_SPAN, read_range

    r = OffsetRange.from_dict(rc.specs[idx])
    typed_schema = rc.typed_schema()
    own: SubrangeBad | None = None
    sink: BadBuffer | SubrangeBad
    if bad_sink is None:
        sink = own = SubrangeBad(rc.dsn, rc.batch_id, idx, BadRows(rc.pipeline, rc.write_dead),
                                 rc.generation)
    else:
        sink = bad_sink
    shared = consumer is not None and r.span <= SHARED_MAX_SPAN
    chunks = iter(read_range(rc.consumer_conf, r, consumer=consumer) if shared
                  else read_range(rc.consumer_conf, r))
    while True:
        with clock.stage("read"):
            chunk = next(chunks, None)
        if chunk is None:
            if own is not None:
                own.close()
            return
        yield chunk_rows(rc, typed_schema, chunk, r, sink, clock)


def chunk_rows(rc: ReadContext, typed_schema: pa.Schema | None, chunk: Any, r: OffsetRange,
               sink: BadBuffer | SubrangeBad, clock: TaskClock) -> pa.RecordBatch:
    """A chunk of raw records (of range `r`, or of several: `chunk.topics`) as the stage's
    rows: raw columns + typed fields; its bad records go to `sink`."""
    from offsetflow.source import (
        BadRecord,
        deserialize_avro,
        deserialize_json,
        deserialize_json_schema,
        deserialize_protobuf,
    )

    clock.count("records", len(chunk))
    if rc.registry is not None and isinstance(sink, BadBuffer):
        with clock.stage("deserialize"):  # every record's writer schema id, for the ledger
            note_schema_ids(sink.schema_ids, chunk.values, chunk.offsets, r.topic,
                            r.partition, chunk.topics, chunk.partitions)
    typed: pa.Table | None = None
    good: list[int] | None = None
    bad: list[BadRecord] = []
    if typed_schema is not None and rc.fmt in ("avro", "json_schema", "protobuf"):
        with clock.stage("deserialize"):
            topics = chunk.topics if chunk.topics is not None else [r.topic] * len(chunk)
            keyed = avro_decoder(rc, "key") if rc.key_readers is not None else None
            decoders: dict[str, Callable[..., tuple[pa.Table, list[BadRecord], list[int]]]]
            decoders = {"avro": deserialize_avro, "json_schema": deserialize_json_schema,
                        "protobuf": deserialize_protobuf}
            decode = decoders[rc.fmt]
            typed, bad, good = decode(chunk.values, topics, rc.schema, avro_decoder(rc),
                                      chunk.keys, keyed)
    elif typed_schema is not None:
        with clock.stage("deserialize"):
            typed, bad, good = deserialize_json(chunk.values, rc.schema, chunk.keys)
    if chunk.refused:  # records the reader found unwritable (e.g. their timestamp)
        good, typed, bad = _drop_refused(chunk.refused, len(chunk), good, typed, bad)
    if bad:
        sink.add([
            {"topic": r.topic if chunk.topics is None else chunk.topics[x.index],
             "partition": r.partition if chunk.partitions is None
             else chunk.partitions[x.index],
             "offset": chunk.offsets[x.index], "timestamp": chunk.timestamps[x.index],
             "key": chunk.keys[x.index], "value": chunk.values[x.index], "error": x.reason}
            for x in bad])
    with clock.stage("to_arrow"):
        raw = chunk.to_arrow(r.topic, r.partition, None if not bad else good)
        if typed is None or typed_schema is None:
            return raw  # type: ignore[no-any-return]
        cols = list(raw.columns) + list(typed.combine_chunks().columns)
        return pa.RecordBatch.from_arrays(
            [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in cols],
            names=raw.schema.names + typed_schema.names)


def read_packed(rc: ReadContext, idxs: list[int], clock: TaskClock, bad_sink: BadBuffer,
                consumer: Any) -> Iterator[pa.RecordBatch]:
    """A packed task's sub-ranges: the small ones (up to `SHARED_MAX_SPAN` offsets, one per
    topic-partition) all at once on the task's consumer (`reader_packed`), in chunks that
    span ranges; the others one by one (`read_subrange`)."""
    from offsetflow.source import SHARED_MAX_SPAN, read_ranges

    small: dict[tuple[str, int], OffsetRange] = {}
    rest: list[int] = []
    for idx in idxs:
        r = OffsetRange.from_dict(rc.specs[idx])
        if r.span <= SHARED_MAX_SPAN and r.topic_partition not in small:
            small[r.topic_partition] = r
        else:
            rest.append(idx)
    if small:
        typed_schema = rc.typed_schema()
        first = next(iter(small.values()))
        chunks = iter(read_ranges(consumer, list(small.values())))
        while True:
            with clock.stage("read"):
                chunk = next(chunks, None)
            if chunk is None:
                break
            yield chunk_rows(rc, typed_schema, chunk, first, bad_sink, clock)
    for idx in rest:
        yield from read_subrange(rc, idx, clock, bad_sink, consumer)


def _drop_refused(refused: dict[int, str], n: int, good: list[int] | None,
                  typed: pa.Table | None, bad: list[Any]
                  ) -> tuple[list[int], pa.Table | None, list[Any]]:
    """Take the reader's refused records out of the good rows and into the bad ones."""
    from offsetflow.source import BadRecord

    good = list(range(n)) if good is None else good
    keep = [j for j, g in enumerate(good) if g not in refused]
    if typed is not None:
        typed = typed.take(pa.array(keep, pa.int64()))
    already = {b.index for b in bad}
    bad = sorted([*bad, *(BadRecord(i, why) for i, why in refused.items() if i not in already)],
                 key=lambda b: b.index)
    return [good[j] for j in keep], typed, bad


def _subranges(groups: list[tuple[int, ...]] | None, ids: Iterator[pa.RecordBatch]
               ) -> Iterator[int]:
    """The sub-ranges a task reads: its ids are sub-ranges, or (`groups`) packed parts."""
    for b in ids:
        for i in b.column("id").to_pylist():
            yield from (i,) if groups is None else groups[i]


def make_reader(cfg: PipelineConfig, batch_id: int, dsn: str, specs: list[dict[str, Any]],
                generation: int | None = None, groups: list[tuple[int, ...]] | None = None,
                rc: ReadContext | None = None
                ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """DataFrame path (a transform is configured): rows go to Spark for the transform.
    `groups`: the sub-ranges each task id reads (`offsetflow.stage.packing`), else one each.
    `rc`: the run's read context, when the driver built it (pinned reader schemas)."""
    if rc is None:
        rc = ReadContext.of(cfg, batch_id, dsn, specs, generation)

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from offsetflow.source import range_consumer

        with range_consumer(rc.consumer_conf, shared=True) as consumer:
            for idx in _subranges(groups, batches):
                clock = TaskClock()
                yield from read_subrange(rc, idx, clock, consumer=consumer)
                clock.emit(batch_id, "read", idx)
    return read


# `error_type`/`error`: a TaskReportedError the task stopped on (its part staged nothing);
# the driver raises it once (`raise_reported`)
STATS_DDL = "part int, rows bigint, skipped boolean, error_type string, error string"
_STATS_SCHEMA = pa.schema([("part", pa.int32()), ("rows", pa.int64()), ("skipped", pa.bool_()),
                           ("error_type", pa.string()), ("error", pa.string())])


def _stats_batch(part: int, stats: dict[str, Any],
                 error: TaskReportedError | None = None) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{"part": part, "rows": int(stats["rows"]), "skipped": bool(stats["skipped"]),
          "error_type": type(error).__name__ if error else None,
          "error": str(error) if error else None}], schema=_STATS_SCHEMA)


def raise_reported(stats: list[Any]) -> None:
    """The error a task reported instead of failing (`TaskReportedError`), raised once
    (the first part's: the others met the same)."""
    for s in sorted(stats, key=lambda s: s["part"]):
        if s["error"]:
            raise reported_error(s["error_type"], s["error"])


def _task_part() -> int:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx.partitionId() if ctx is not None else 0


def make_writer(dsn: str, batch_id: int, bad: BadRows, generation: int | None = None
                ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """DataFrame path: stage the transform's output (in stage form); rows PostgreSQL
    refuses become bad records under `bad`'s policy."""
    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        part = _task_part()
        clock = TaskClock()
        stats = stage_rows(dsn, batch_id, part, batches, clock, bad=bad,
                           generation=generation)
        clock.emit(batch_id, "stage", part)
        yield _stats_batch(part, stats)
    return write


def make_read_and_stage(cfg: PipelineConfig, batch_id: int, dsn: str,
                        specs: list[dict[str, Any]], generation: int | None = None,
                        groups: list[tuple[int, ...]] | None = None,
                        files: TaskFiles | None = None, rc: ReadContext | None = None
                        ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Fused path (no transform): each task reads its sub-ranges (`groups[part]`, packed by
    `offsetflow.stage.packing`; without `groups`, the sub-range its id names) with one consumer
    and COPYs them into its stage part itself, so records never cross into the JVM and
    back. Spark schedules, retries and spreads the tasks; the stage marker, which names the
    sub-ranges, still makes a retried task stage nothing twice. With `files` (an Iceberg
    append, `sinks.task_data_files`) the task writes its rows as the table's data files
    and lists them in that marker instead (`offsetflow.sinks.iceberg.tasks`). `rc`: the
    run's read context, when the driver built it already (its reader schemas decide the
    stage's columns under schema evolution)."""
    if rc is None:
        rc = ReadContext.of(cfg, batch_id, dsn, specs, generation)
    pg_types = [t for _, t in stage_columns(cfg, rc.schema)]
    ids = rc.registry is not None

    def read_and_stage(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from offsetflow.source import range_consumer

        part = _task_part()
        clock = TaskClock(ignore=("wait_upstream",))  # here upstream is read + deserialize

        bad_in = BadBuffer()  # read-side bad records: written in the part's transaction
        consumer = contextlib.ExitStack()

        def rows() -> Iterator[pa.RecordBatch]:
            shared = consumer.enter_context(range_consumer(rc.consumer_conf, shared=True))
            yield from read_packed(rc, list(_subranges(groups, batches)), clock, bad_in,
                                   shared)
        try:
            with consumer:
                stats = stage_rows(dsn, batch_id, part, coalesced(rows()), clock,
                                   binary_encoder(pg_types),
                                   table=stage_part_table(batch_id, part),
                                   bad=BadRows(rc.pipeline, rc.write_dead), bad_in=bad_in,
                                   generation=generation,
                                   subranges=None if groups is None else groups[part],
                                   files=None if files is None else files.writer(part),
                                   schema_ids=ids)
        except TaskReportedError as e:  # its transaction rolled back: no marker
            drained(batches)
            yield _stats_batch(part, {"rows": 0, "skipped": False}, e)
            return
        drained(batches)
        clock.emit(batch_id, "read_stage", part)
        yield _stats_batch(part, stats)
    return read_and_stage


def drained(ids: Iterator[pa.RecordBatch]) -> None:
    """Read the rest of a task's input (its few sub-range ids). A task that returns before
    reading them (a part an earlier attempt staged, a reported error) leaves them in the
    worker's socket, and Spark then kills that Python worker instead of reusing it: the
    next task pays a new worker's start (~1.15 CPU-s of imports, docs/performance.md)."""
    for _ in ids:
        pass


def coalesced(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Successive small chunks (a packed task's ranges of a few records each) as one, so
    they cost one COPY and savepoint, not one per range; a chunk stays within the reader's
    row and byte bounds, and chunks of another schema are never joined."""
    from offsetflow.source import MAX_CHUNK_BYTES, MAX_CHUNK_ROWS

    buf: list[pa.RecordBatch] = []
    rows = size = 0
    for b in batches:
        if buf and (rows + b.num_rows > MAX_CHUNK_ROWS or size + b.nbytes > MAX_CHUNK_BYTES
                    or not b.schema.equals(buf[0].schema)):
            yield buf[0] if len(buf) == 1 else pa.concat_batches(buf)
            buf, rows, size = [], 0, 0
        buf.append(b)
        rows += b.num_rows
        size += b.nbytes
    if buf:
        yield buf[0] if len(buf) == 1 else pa.concat_batches(buf)


def stage_columns(cfg: PipelineConfig, schema: dict[str, str] | None = None
                  ) -> list[tuple[str, str]]:
    """Stage/target columns of the fused path, from the config alone (no Spark analysis);
    `schema`: format.schema with the columns schema evolution adds (`ReadContext.schema`)."""
    types = [("topic", "string"), ("partition", "int"), ("offset", "bigint"),
             ("timestamp", "timestamp"), ("timestamp_type", "int"), ("key", "binary"),
             ("value", "binary"), ("headers", "array<struct<key:string,value:binary>>")]
    out = [(n, pg_type(t)) for n, t in types]
    if cfg.format_type in TYPED_FORMATS:
        out += [(n, PG_TYPES.get(t) or pg_type(SPARK_TYPES.get(t, t)))
                for n, t in (cfg.schema if schema is None else schema).items()]
    return out
