"""Step 2 and 3 of the lifecycle on Spark: read a planned batch, stage it, commit it.

DataFrame API only (`mapInArrow`), so the same job runs on a local SparkSession, through
spark-submit on a cluster, or over Spark Connect. Large ranges are split into sub-ranges and
small ones packed into about 4 tasks per core (`offsetflow.packing`); a task reads its
sub-ranges with one `offsetflow.reader` consumer; rows are staged by the tasks and
committed by the driver in one PostgreSQL transaction (`offsetflow.commit.commit_batch`; in
append mode `offsetflow.partwise.PartwiseCommit`, which starts moving parts while later ones
are read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetflow import connect_session
from offsetflow.commit import (
    CommitResult,
    CommitSpec,
    check_fence,
    commit_batch,
)
from offsetflow.config import DECIMAL_RE, PipelineConfig, config_drift, connect_address
from offsetflow.dead_letters import Coordinate
from offsetflow.errors import (
    BadRecordError,
    BatchStateError,
    ConfigError,
    OffsetFlowError,
    SparkUnavailableError,
    StaleConfigError,
    StaleStageError,
)
from offsetflow.ledger import Batch, Ledger, connect, stage_part_table
from offsetflow.metrics import TaskClock
from offsetflow.packing import pack, task_count
from offsetflow.partwise import PartwiseCommit
from offsetflow.ranges import OffsetRange, split_ranges
from offsetflow.run_lock import hold_run_lock
from offsetflow.sinks import external_sink, task_data_files
from offsetflow.stage_reset import claim_pack_tasks, stage_generation
from offsetflow.staging import (
    BadBuffer,
    BadRows,
    SubrangeBad,
    bad_record_summary,
    binary_encoder,
    stage_rows,
)
from offsetflow.tables import create_stage_tables, ensure_dead_letter, ensure_target, pg_type

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from offsetflow.sink_iceberg_tasks import TaskFiles

log = logging.getLogger(__name__)

RAW_DDL = ("`topic` string, `partition` int, `offset` bigint, `timestamp` timestamp, "
           "`timestamp_type` int, `key` binary, `value` binary, "
           "`headers` array<struct<key:string,value:binary>>")
SPARK_TYPES = {"string": "string", "long": "bigint", "int": "int", "double": "double",
               "float": "float", "boolean": "boolean", "timestamp": "timestamp", "date": "date"}


def spark_ddl(cfg: PipelineConfig) -> str:
    fields = [f"`{name}` {SPARK_TYPES.get(t, t if DECIMAL_RE.match(t) else 'string')}"
              for name, t in cfg.schema.items()]
    return ", ".join([RAW_DDL, *fields])


# Arrow batches Spark hands a Python task (the DataFrame path's writer) are cut at 10,000
# rows by default and not by bytes: with 1 MB records that is 10 GB per batch, past Arrow's
# 2 GiB array limit. Spark 4 can cut them by bytes too (spark.conf of a pipeline overrides).
ARROW_MAX_BYTES_PER_BATCH = 64 << 20


def _arrow_conf() -> dict[str, str]:
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        return {}
    return {"spark.sql.execution.arrow.maxBytesPerBatch": str(ARROW_MAX_BYTES_PER_BATCH)}


def build_spark(cfg: PipelineConfig, app_name: str) -> SparkSession:
    """A SparkSession for the pipeline: spark-submit's if running under it, a warm Spark
    Connect server when `spark.launch: connect`, else a local one from `spark.master`."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if cfg.spark.launch == "connect":
        return _connect_session(cfg)
    # under spark-submit (which starts the Python driver with a gateway) the master comes
    # from spark-submit / the Airflow Spark connection, never from the pipeline config
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        builder = builder.master(cfg.spark.master)
        # executors run the interpreter the driver names in PYSPARK_PYTHON, and pyspark reads
        # only that variable, not spark.pyspark.python: a pipeline that ships its environment
        # (spark.archives) would otherwise have its executors run this process's Python,
        # which a cluster node does not have (spark-submit does this step itself)
        executor_python = cfg.spark.conf.get("spark.pyspark.python")
        if executor_python:
            os.environ["PYSPARK_PYTHON"] = executor_python
    builder = (builder.config("spark.sql.session.timeZone", "UTC")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "8"))
    log4j = os.environ.get("OFFSETFLOW_SPARK_LOG4J")  # console.setup_logging: quiet console
    if log4j and "spark.driver.extraJavaOptions" not in cfg.spark.conf:
        builder = builder.config("spark.driver.extraJavaOptions",
                                 f"-Dlog4j2.configurationFile=file:{log4j}")
    for k, v in {**_arrow_conf(), **cfg.spark.conf}.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("OFFSETFLOW_SPARK_LOG_LEVEL", "WARN"))
    return spark


def _connect_session(cfg: PipelineConfig) -> SparkSession:
    """A session on the warm Spark Connect server. Reachability is checked first: the
    client itself retries an absent server for minutes before it says anything."""
    url = cfg.spark.connect_url
    host, port = connect_address(url)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise SparkUnavailableError(
            f"no Spark Connect server at sc://{host}:{port} (spark.connect_url of "
            f"{cfg.source_file}, spark.launch: connect): {e}. Start one (locally: "
            f"include/stack/stack.sh connect-start) or use spark.launch: submit") from e
    spark = _pipeline_session(cfg, url)
    # set by every run: the session outlives it, and the pipeline's config may have changed
    for k, v in {**_arrow_conf(), **cfg.spark.conf}.items():
        try:
            spark.conf.set(k, v)
        except Exception as e:  # noqa: BLE001 - pyspark raises several kinds here
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(cfg.source_file, f"spark.conf.{k}",
                              f"cannot be set on a running Spark Connect server ({first}); "
                              f"set it when the server is started") from e
    return spark  # type: ignore[no-any-return]


def _pipeline_session(cfg: PipelineConfig, url: str) -> Any:
    """The pipeline's own session on the server (connect_session): reopened by every run,
    so its Python workers stay warm and the server starts no new ones per run. Its first
    call sets the time zone, which also tells whether the server closed that id before.
    Built without the builder, whose create() makes calls (and registers the session as
    the process's default) before a closed id can be told and dropped."""
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # as the builder does: no local Spark
    if connect_session.names_session(url):
        candidates = [url]
    else:
        candidates = [connect_session.with_session_id(url, connect_session.session_id(
            cfg.name, url, g)) for g in range(connect_session.MAX_GENERATIONS)]
        candidates.append(url)  # every id closed: a session of this run's own
    for i, candidate in enumerate(candidates):
        spark = RemoteSession(connection=candidate)
        try:
            spark.conf.set("spark.sql.session.timeZone", "UTC")
        except Exception as e:  # noqa: BLE001 - pyspark raises several kinds here
            drop_session(spark)
            if i + 1 < len(candidates) and connect_session.is_closed_session(e):
                continue
            raise
        if candidate is candidates[-1] and len(candidates) > 1:
            log.warning("pipeline %s: the server closed its %d session ids; this run uses a "
                        "session of its own", cfg.name, connect_session.MAX_GENERATIONS)
        log.info("pipeline %s: Spark Connect session %s", cfg.name, spark.session_id)
        RemoteSession._set_default_and_active_session(spark)  # unless the process has one
        return spark
    raise AssertionError("unreachable: the last candidate returns or raises")


def drop_session(spark: Any) -> None:
    """End this process's use of a Spark session. A Spark Connect session stays on the
    server for the pipeline's next run (only the client is closed); a local one stops."""
    if hasattr(spark, "release_session_on_close"):  # pyspark.sql.connect.session
        spark.release_session_on_close = False
    spark.stop()


@contextlib.contextmanager
def connect_ctx(dsn: str) -> Iterator[Any]:
    conn = connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            yield cur
    finally:
        conn.close()


def load_transform(path: str, source: str) -> Callable[[DataFrame], DataFrame]:
    module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(source, "transform", f"cannot import {path}: {e}") from e
    if not callable(fn):
        raise ConfigError(source, "transform", f"{path} is not callable")
    return fn  # type: ignore[no-any-return]


@dataclass
class RunReport:
    batch_id: int
    result: CommitResult
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadContext:
    """What a task needs to read one sub-range: plain values, cheap to ship to workers."""

    batch_id: int
    dsn: str
    pipeline: str
    consumer_conf: dict[str, str]
    schema: dict[str, str]
    fmt: str
    write_dead: bool
    specs: list[dict[str, Any]]
    generation: int | None = None  # the stage generation the run stages under

    @classmethod
    def of(cls, cfg: PipelineConfig, batch_id: int, dsn: str, specs: list[dict[str, Any]],
           generation: int | None = None) -> ReadContext:
        return cls(batch_id, dsn, cfg.name, cfg.consumer_settings(), dict(cfg.schema),
                   cfg.format_type, cfg.bad_records == "dead_letter", specs, generation)


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
    from offsetflow.deserialize import arrow_schema
    from offsetflow.reader import SHARED_MAX_SPAN, read_range

    r = OffsetRange.from_dict(rc.specs[idx])
    typed_schema = arrow_schema(rc.schema) if rc.fmt == "json" else None
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
    from offsetflow.deserialize import BadRecord, deserialize_json

    clock.count("records", len(chunk))
    typed: pa.Table | None = None
    good: list[int] | None = None
    bad: list[BadRecord] = []
    if typed_schema is not None:
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
    from offsetflow.deserialize import arrow_schema
    from offsetflow.reader import SHARED_MAX_SPAN
    from offsetflow.reader_packed import read_ranges

    small: dict[tuple[str, int], OffsetRange] = {}
    rest: list[int] = []
    for idx in idxs:
        r = OffsetRange.from_dict(rc.specs[idx])
        if r.span <= SHARED_MAX_SPAN and r.topic_partition not in small:
            small[r.topic_partition] = r
        else:
            rest.append(idx)
    if small:
        typed_schema = arrow_schema(rc.schema) if rc.fmt == "json" else None
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
    from offsetflow.deserialize import BadRecord

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
                generation: int | None = None, groups: list[tuple[int, ...]] | None = None
                ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """DataFrame path (a transform is configured): rows go to Spark for the transform.
    `groups`: the sub-ranges each task id reads (`offsetflow.packing`), else one each."""
    rc = ReadContext.of(cfg, batch_id, dsn, specs, generation)

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from offsetflow.reader import range_consumer

        with range_consumer(rc.consumer_conf, shared=True) as consumer:
            for idx in _subranges(groups, batches):
                clock = TaskClock()
                yield from read_subrange(rc, idx, clock, consumer=consumer)
                clock.emit(batch_id, "read", idx)
    return read


STATS_DDL = "part int, rows bigint, skipped boolean"


def _stats_batch(part: int, stats: dict[str, Any]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{"part": part, "rows": int(stats["rows"]), "skipped": bool(stats["skipped"])}],
        schema=pa.schema([("part", pa.int32()), ("rows", pa.int64()), ("skipped", pa.bool_())]))


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
                        files: TaskFiles | None = None
                        ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """Fused path (no transform): each task reads its sub-ranges (`groups[part]`, packed by
    `offsetflow.packing`; without `groups`, the sub-range its id names) with one consumer
    and COPYs them into its stage part itself, so records never cross into the JVM and
    back. Spark schedules, retries and spreads the tasks; the stage marker, which names the
    sub-ranges, still makes a retried task stage nothing twice. With `files` (an Iceberg
    append, `sinks.task_data_files`) the task writes its rows as the table's data files
    and lists them in that marker instead (`offsetflow.sink_iceberg_tasks`)."""
    rc = ReadContext.of(cfg, batch_id, dsn, specs, generation)
    pg_types = [t for _, t in stage_columns(cfg)]

    def read_and_stage(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from offsetflow.reader import range_consumer

        part = _task_part()
        clock = TaskClock(ignore=("wait_upstream",))  # here upstream is read + deserialize

        bad_in = BadBuffer()  # read-side bad records: written in the part's transaction
        consumer = contextlib.ExitStack()

        def rows() -> Iterator[pa.RecordBatch]:
            shared = consumer.enter_context(range_consumer(rc.consumer_conf, shared=True))
            yield from read_packed(rc, list(_subranges(groups, batches)), clock, bad_in,
                                   shared)
        with consumer:
            stats = stage_rows(dsn, batch_id, part, _coalesced(rows()), clock,
                               binary_encoder(pg_types),
                               table=stage_part_table(batch_id, part),
                               bad=BadRows(rc.pipeline, rc.write_dead), bad_in=bad_in,
                               generation=generation,
                               subranges=None if groups is None else groups[part],
                               files=None if files is None else files.writer(part))
        clock.emit(batch_id, "read_stage", part)
        yield _stats_batch(part, stats)
    return read_and_stage


def _coalesced(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Successive small chunks (a packed task's ranges of a few records each) as one, so
    they cost one COPY and savepoint, not one per range; a chunk stays within the reader's
    row and byte bounds, and chunks of another schema are never joined."""
    from offsetflow.reader import MAX_CHUNK_BYTES, MAX_CHUNK_ROWS

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


def stage_columns(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """Stage/target columns of the fused path, from the config alone (no Spark analysis)."""
    types = [("topic", "string"), ("partition", "int"), ("offset", "bigint"),
             ("timestamp", "timestamp"), ("timestamp_type", "int"), ("key", "binary"),
             ("value", "binary"), ("headers", "array<struct<key:string,value:binary>>")]
    if cfg.format_type == "json":
        types += [(n, SPARK_TYPES.get(t, t)) for n, t in cfg.schema.items()]
    return [(n, pg_type(t)) for n, t in types]


def to_stage_form(df: DataFrame) -> DataFrame:
    """Binary as PostgreSQL hex text, nested types as JSON, so tasks can COPY CSV."""
    from pyspark.sql import functions as F

    cols = []
    for f in df.schema.fields:
        t = f.dataType.simpleString()
        c = F.col(f"`{f.name}`")
        if t == "binary":
            c = F.concat(F.lit("\\x"), F.lower(F.hex(c)))
        elif t.startswith(("array<", "struct<", "map<")):
            c = F.to_json(c, {"ignoreNullFields": "false"})  # as the fused path: keep nulls
        cols.append(c.alias(f.name))
    return df.select(*cols)


def run_batch(spark: SparkSession, cfg: PipelineConfig, batch_id: int, dsn: str,
              accept_config_change: bool = False) -> RunReport:
    """Read, stage and commit one planned batch. Safe to retry: a committed batch is a
    no-op, staged parts are never staged twice, and the commit is fenced."""
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    with Ledger(dsn) as ledger, contextlib.ExitStack() as claim:
        # whose batch, before touching it: a driver pointed at the wrong ledger must not mark
        # another pipeline's batch running (or count an attempt against it)
        owner = ledger.get_batch(batch_id).pipeline
        if owner != cfg.name:
            raise BatchStateError(f"batch {batch_id} belongs to pipeline {owner}, "
                                  f"not {cfg.name}")
        # held until this run ends or its process dies: the watcher tells a live run of the
        # batch from one a killed driver left `running` (`offsetflow.run_lock`)
        if claim.enter_context(hold_run_lock(dsn, batch_id)):
            log.warning("batch %d: another run of it is alive; this one runs too (the "
                        "commit's fencing lets only one of them commit it)", batch_id)
        batch = ledger.mark_running(batch_id)
        if batch.status == "committed":
            log.info("batch %d is already committed; nothing to do", batch_id)
            res = CommitResult(batch_id, "already_committed", batch.rows_written or 0,
                               batch.bad_records or 0, {})
            return RunReport(batch_id, res)
        try:
            _check_topic_identity(cfg, ledger, batch)
        except OffsetFlowError as e:
            ledger.mark_failed(batch_id, str(e))
            raise
        drift = config_drift(cfg, batch.config_fingerprint, batch.split_offsets)
        if drift.output_changed and not accept_config_change:
            err = BatchStateError(
                f"pipeline {cfg.name} config changed since batch {batch_id} was planned "
                f"(format, transform, sink or bad-record policy); re-run with "
                f"--accept-config-change to apply the new config to the same ranges, or "
                f"abandon the batch")
            ledger.mark_failed(batch_id, str(err))
            raise err
        if drift.any:
            # what an earlier attempt staged was shaped by the old config (its format, its
            # split into parts): it must not be reused under the new one
            ledger.adopt_config(batch_id, cfg.fingerprint(), cfg.spark.max_offsets_per_task)
            batch = dataclasses.replace(batch, config_fingerprint=cfg.fingerprint())
            if drift.output_changed:
                log.warning("batch %d: config change accepted; its staged data from earlier "
                            "attempts was dropped and the ranges are read again", batch_id)
            else:
                log.info("batch %d: spark.max_offsets_per_task changed from %d to %d; staged "
                         "data from earlier attempts was dropped and the ranges are read "
                         "again", batch_id, drift.split_from, cfg.spark.max_offsets_per_task)
        try:
            report = _run(spark, cfg, batch, dsn, ledger, timings)
        except Exception as e:
            if _committed_meanwhile(dsn, batch_id):
                # a concurrent run of the same batch committed first; this one is fenced
                log.warning("batch %d was committed by another run while this one was "
                            "working (%s: %s); this run is fenced, nothing to do", batch_id,
                            type(e).__name__, str(e)[:200])
                res = CommitResult(batch_id, "already_committed", 0, 0, {})
                return RunReport(batch_id, res)
            if isinstance(e, (StaleConfigError, StaleStageError)):
                # another run took the batch up after this one and owns its status now
                log.warning("batch %d: this run is stale and stops: %s", batch_id, e)
                raise
            msg = str(e) if isinstance(e, OffsetFlowError) else \
                f"{type(e).__name__}: {str(e)[:2000]}"
            _mark_failed(dsn, batch_id, msg)
            raise
    timings["total_s"] = round(time.monotonic() - t0, 3)
    return report


def _task_files(cfg: PipelineConfig, dsn: str, batch: Batch,
                columns: list[tuple[str, str]]) -> TaskFiles:
    """What the tasks need to write the batch's Iceberg data files (the table's metadata
    as loaded, or created, now; the rows must fit its schema)."""
    from offsetflow.sink_iceberg import IcebergSink

    sink = external_sink(cfg, dsn, columns, CommitSpec(
        columns=tuple(c for c, _ in columns), tombstones=cfg.tombstone_policy,
        dead_letter_table=cfg.dead_letter_table))
    assert isinstance(sink, IcebergSink)
    try:
        return sink.task_files(batch)
    finally:
        sink.close()


def _cores(spark: SparkSession) -> int:
    """The cores the batch's tasks run on: the session's default parallelism (a Spark
    Connect client cannot ask for it: the server's `spark.default.parallelism` if set,
    else this machine's, where the local server runs)."""
    try:
        return int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext
        pass
    try:
        value = spark.conf.get("spark.default.parallelism", None)
        if value:
            return int(value)
    except Exception:  # noqa: BLE001
        pass
    return os.cpu_count() or 1


def _check_topic_identity(cfg: PipelineConfig, ledger: Ledger, batch: Batch) -> None:
    """Before anything is read: the batch's topics are the ones it was planned with."""
    from offsetflow.kafka_meta import KafkaMetadata
    from offsetflow.planning import check_batch_topics

    with ledger.transaction() as cur:
        check_batch_topics(cur, KafkaMetadata(cfg.admin_settings(), cfg.isolation_level),
                           batch, cfg.name)


def _quality_gate(cfg: PipelineConfig, batch: Batch, dsn: str, ledger: Ledger
                  ) -> dict[Coordinate, list[str]]:
    """Run the suite on the staged batch. Returns the rows to route to the dead-letter
    table (the commit routes them, in its own transaction, so a failed commit routes
    nothing); raises QualityGateError when the batch must not commit."""
    from offsetflow.quality import QualityGateError, validate_stage

    assert cfg.quality_suite is not None
    result = validate_stage(dsn, batch.batch_id, cfg.quality_suite)
    result.policy = cfg.quality_policy
    log.info("batch %d quality suite %s: %s", batch.batch_id, cfg.quality_suite,
             "passed" if result.success else f"FAILED: {result.summary_text()}")
    rows: dict[Coordinate, list[str]] = {}
    if not result.success:
        rows = result.failing_coordinates() if cfg.quality_policy == "dead_letter" else {}
        if not rows:
            ledger.mark_failed(batch.batch_id, str(QualityGateError(batch.batch_id, result)),
                               quality=result.to_dict())
            raise QualityGateError(batch.batch_id, result)
        result.routed_rows = len(rows)
        log.warning("batch %d: %d rows that broke the suite go to %s with the commit; the "
                    "rest commits", batch.batch_id, result.routed_rows, cfg.dead_letter_table)
    with ledger.transaction() as cur:
        cur.execute("UPDATE offsetflow.batches SET quality = %s WHERE batch_id = %s",
                    (json.dumps(result.to_dict(), default=str), batch.batch_id))
    return rows


def _record_commit_time(ledger: Ledger, batch_id: int, seconds: float) -> None:
    """The commit's own duration, for the publish task's stats (the batch is committed:
    failing to note how long it took must not fail it)."""
    try:
        ledger.add_timings(batch_id, {"commit_s": seconds})
    except Exception as e:  # noqa: BLE001
        log.warning("batch %d: could not record its commit time: %s", batch_id, e)


def _publish_lag(cfg: PipelineConfig, ledger: Ledger) -> None:
    """Best effort: monitoring must never fail a committed batch."""
    from offsetflow.lag import publish_positions

    try:
        publish_positions(cfg, ledger.positions(cfg.name))
    except Exception as e:  # noqa: BLE001
        log.warning("could not publish consumer-group offsets of %s: %s", cfg.name, e)


def _committed_meanwhile(dsn: str, batch_id: int) -> bool:
    try:
        with Ledger(dsn) as fresh:
            return fresh.get_batch(batch_id).status == "committed"
    except Exception:  # noqa: BLE001 - the ledger itself may be what failed
        return False


def _mark_failed(dsn: str, batch_id: int, msg: str) -> None:
    """Record the failure on a fresh connection (the failing one may be dead)."""
    try:
        with Ledger(dsn) as fresh:
            fresh.mark_failed(batch_id, msg)
    except Exception as e:  # noqa: BLE001 - never hide the original error
        log.error("could not record the failure of batch %d in the ledger: %s", batch_id, e)


def _run(spark: SparkSession, cfg: PipelineConfig, batch: Batch, dsn: str, ledger: Ledger,
         timings: dict[str, float]) -> RunReport:
    t = time.monotonic()
    with ledger.transaction() as cur:
        check_fence(cur, batch)  # a stale batch stops here, before it reads anything
    fused = not cfg.transform
    # claimed with the config and split this run checked (a transform run, whose parts are
    # Spark's partitions, starts its own generation): a run that rebuilds the stage after
    # this point makes this run a zombie, whose markers the commit refuses
    generation = stage_generation(ledger, batch, cfg.spark.max_offsets_per_task,
                                  restart=not fused)
    subranges = split_ranges(batch.ranges, cfg.spark.max_offsets_per_task)
    specs = [r.to_dict() for r in subranges]
    # small sub-ranges share a task, as many tasks as the batch's first run chose
    packing = pack(subranges, claim_pack_tasks(ledger, batch.batch_id,
                                               task_count(_cores(spark))),
                   cfg.spark.max_offsets_per_task)
    groups = list(packing.groups)
    n = max(len(groups), 1)
    ids = spark.range(0, len(groups), 1, n)
    if cfg.transform:
        df = ids.mapInArrow(make_reader(cfg, batch.batch_id, dsn, specs, generation, groups),
                            spark_ddl(cfg))
        df = load_transform(cfg.transform, cfg.source_file)(df)
        missing = [c for c in ("topic", "partition", "offset") if c not in df.columns]
        if missing:
            raise ConfigError(cfg.source_file, "transform",
                              f"{cfg.transform} dropped the source coordinates {missing}; "
                              f"target rows must keep topic, partition and offset")
        columns = [(f.name, pg_type(f.dataType.simpleString())) for f in df.schema.fields]
        staging = to_stage_form(df).mapInArrow(
            make_writer(dsn, batch.batch_id,
                        BadRows(cfg.name, cfg.bad_records == "dead_letter"), generation),
            STATS_DDL)
    else:
        columns = stage_columns(cfg)
        # an Iceberg append: the tasks write the table's data files (the table is loaded,
        # or created, here: they need its schema and partition spec)
        files = _task_files(cfg, dsn, batch, columns) if task_data_files(cfg) else None
        staging = ids.mapInArrow(make_read_and_stage(cfg, batch.batch_id, dsn, specs,
                                                     generation, groups, files), STATS_DDL)
    if cfg.sink.kafka is not None:  # refused before anything is read, not at the commit
        from offsetflow.sink_kafka_form import output_topic

        output_topic(cfg.sink.kafka, batch, cfg.source_file)
    with connect_ctx(dsn) as cur:
        if cfg.sink.type == "postgres":
            ensure_target(cur, batch.target_table, columns, cfg.sink.mode, cfg.sink.key)
        # every pipeline may route rows there in its commit: bad records, quality
        # failures, upsert rows without a key, tombstones
        ensure_dead_letter(cur, cfg.dead_letter_table)
    create_stage_tables(dsn, batch.batch_id, columns, parts=n if fused else 0)
    timings["prepare_s"] = round(time.monotonic() - t, 3)

    # append without a quality gate: the commit moves parts while later ones are read
    # (an external sink commits the whole batch in step 4: never part by part)
    partwise = (fused and cfg.sink.mode == "append" and not cfg.quality_suite
                and cfg.sink.type == "postgres")
    spec = CommitSpec(columns=tuple(c for c, _ in columns), mode=cfg.sink.mode,
                      key=tuple(cfg.sink.key), tombstones=cfg.tombstone_policy,
                      dead_letter_table=cfg.dead_letter_table,
                      bad_records_staged=cfg.bad_records == "dead_letter",
                      config_fingerprint=batch.config_fingerprint,
                      stage_generation=generation, subrange_parts=fused,
                      task_files=task_data_files(cfg))
    committer = PartwiseCommit(
        dsn, batch, columns=spec.columns, parts=n, dead_letter_table=cfg.dead_letter_table,
        timings=timings, spec=spec) if partwise else None
    with committer if committer is not None else contextlib.nullcontext():
        t = time.monotonic()
        stats = staging.collect()
        timings["read_stage_s"] = round(time.monotonic() - t, 3)
        skipped = sum(1 for s in stats if s["skipped"])
        log.info("batch %d: staged %d rows in %d parts (%d already staged by an earlier "
                 "attempt)", batch.batch_id, sum(s["rows"] for s in stats), len(stats),
                 skipped)

        bad_count, samples = bad_record_summary(ledger, batch.batch_id)
        if bad_count and cfg.bad_records == "fail":
            first = samples[0]
            raise BadRecordError(first["topic"], first["partition"], first["offset"],
                                 first["error"], more=bad_count - 1)
        if cfg.quality_suite:
            t = time.monotonic()
            spec = dataclasses.replace(spec, quality_routes=_quality_gate(cfg, batch, dsn,
                                                                          ledger))
            timings["quality_s"] = round(time.monotonic() - t, 3)
        # checked again before COMMIT: a topic deleted and recreated while the tasks read
        # gave them the new topic's records under the old one's offsets
        _check_topic_identity(cfg, ledger, batch)
        sink = external_sink(cfg, dsn, columns, spec)  # with the quality gate's routes
        if sink is not None:
            spec = dataclasses.replace(spec, external=sink)
        t = time.monotonic()
        if committer is not None:
            result = committer.finish(expected_parts=len(stats))
        else:
            result = commit_batch(ledger, batch.batch_id, expected_parts=len(stats),
                                  spec=spec, timings=timings)
        timings["commit_s"] = round(time.monotonic() - t, 3)
    if result.status == "committed":
        _record_commit_time(ledger, batch.batch_id, timings["commit_s"])
        if spec.task_files:  # task attempts that died or lost their marker left files
            from offsetflow.sink_iceberg_maint import sweep_batch_orphans

            sweep_batch_orphans(cfg, dsn, batch.batch_id)
        elif cfg.sink.iceberg is not None and batch.attempts > 1:  # dead attempts' files
            from offsetflow.sink_iceberg_maint import sweep_after_retry

            sweep_after_retry(cfg, dsn, batch.batch_id)
    log.info(result.message)
    if batch.moves_positions and result.status == "committed":
        _publish_lag(cfg, ledger)
    return RunReport(batch.batch_id, result, timings)
