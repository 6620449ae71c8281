"""Step 2 and 3 of the lifecycle on Spark: read a planned batch, stage it, commit it.

DataFrame API only (`mapInArrow`), so the same job runs on a local SparkSession, through
spark-submit on a cluster, or over Spark Connect. Large ranges are split into sub-ranges and
small ones packed into about 4 tasks per core (`offsetflow.stage.packing`); a task reads its
sub-ranges with one `offsetflow.source.reader` consumer; rows are staged by the tasks and
committed by the driver in one PostgreSQL transaction (`offsetflow.commit.protocol.commit_batch`; in
a PostgreSQL append `offsetflow.commit.partwise.PartwiseCommit`, which starts moving parts while
later ones are read). What differs between the sinks is a method of the pipeline's
`offsetflow.sinks.Sink` (`sink_for`): the driver never asks which kind it holds.

This module is the driver's side: `run_batch` and the steps around the Spark job. What runs
inside the tasks is in `offsetflow.job.tasks`, the session in `offsetflow.job.spark_session`
(`build_spark` and `drop_session`; callers take all three from `offsetflow.job`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from offsetflow.commit import (
    CommitResult,
    CommitSpec,
    Coordinate,
    PartwiseCommit,
    check_fence,
    commit_batch,
    create_stage_tables,
    ensure_dead_letter,
    pg_type,
)
from offsetflow.config import PipelineConfig, config_drift
from offsetflow.errors import (
    BadRecordError,
    BatchStateError,
    ConfigError,
    OffsetFlowError,
    StaleConfigError,
    StaleStageError,
)
from offsetflow.job.evolution import check_schema_changes, pinned_readers
from offsetflow.job.spark_session import tasks_here
from offsetflow.job.tasks import (
    STATS_DDL,
    ReadContext,
    make_read_and_stage,
    make_reader,
    make_writer,
    raise_reported,
    spark_ddl,
    stage_columns,
)
from offsetflow.ledger import Batch, Ledger, connect, hold_run_lock
from offsetflow.ranges import split_ranges
from offsetflow.sinks import sink_for
from offsetflow.stage import (
    BadRows,
    bad_record_summary,
    claim_pack_tasks,
    pack,
    stage_generation,
    task_count,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


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


def committed_report(cfg: PipelineConfig, batch_id: int, dsn: str) -> RunReport | None:
    """The report of a batch that is already committed (what `run_batch` would return for
    it), else None: a retry of a committed batch (Airflow's, after its task died past the
    commit) answers from the ledger without starting a Spark session. The batch must be
    the pipeline's own, as in `run_batch`."""
    with Ledger(dsn) as ledger:
        batch = ledger.get_batch(batch_id)
    if batch.pipeline != cfg.name:
        raise BatchStateError(f"batch {batch_id} belongs to pipeline {batch.pipeline}, "
                              f"not {cfg.name}")
    if batch.status != "committed":
        return None
    log.info("batch %d is already committed; nothing to do", batch_id)
    return RunReport(batch_id, CommitResult(batch_id, "already_committed",
                                            batch.rows_written or 0, batch.bad_records or 0,
                                            {}))


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
        # batch from one a killed driver left `running` (`offsetflow.ledger.run_lock`)
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
            _mark_failed(dsn, batch_id, failure_message(e))
            raise
    timings["total_s"] = round(time.monotonic() - t0, 3)
    return report


# an OffsetFlow error a Spark task raised, as the last line of the task's traceback that
# Spark's exception carries (a PythonException's text)
_TASK_ERROR = re.compile(r"^offsetflow\.errors\.(\w+): (.+)$", re.MULTILINE)


def failure_message(e: BaseException) -> str:
    """What the ledger records of a failed run: an OffsetFlow error's own message, also when
    a Spark task raised it (not the head of a Python traceback), else the exception."""
    if isinstance(e, OffsetFlowError):
        return str(e)
    found = _TASK_ERROR.findall(str(e))
    if found:
        name, text = found[-1]
        return f"{name} (in a Spark task): {text}"
    return f"{type(e).__name__}: {str(e)[:2000]}"


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
    from offsetflow.plan import check_batch_topics
    from offsetflow.source import KafkaMetadata

    with ledger.transaction() as cur:
        kafka = KafkaMetadata(cfg.admin_settings(), cfg.isolation_level,
                              origin=cfg.kafka_origin)
        check_batch_topics(cur, kafka, batch, cfg.name)


def _quality_gate(cfg: PipelineConfig, batch: Batch, dsn: str, ledger: Ledger
                  ) -> dict[Coordinate, list[str]]:
    """Run the suite on the staged batch. Returns the rows to route to the dead-letter
    table (the commit routes them, in its own transaction, so a failed commit routes
    nothing); raises QualityGateError when the batch must not commit."""
    from offsetflow.job.quality import QualityGateError, validate_stage

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


def _ledger_time(ledger: Ledger) -> datetime | None:
    """When read+stage ended, on the ledger's clock, for the batch's timings (the commit
    keeps it; a part-by-part commit holds the batch row, so it cannot be written now).
    Informational: never fails the batch."""
    try:
        return ledger.clock()
    except Exception as e:  # noqa: BLE001
        log.warning("could not read the ledger's clock for the batch's timings: %s", e)
        return None


def _publish_lag(cfg: PipelineConfig, ledger: Ledger) -> None:
    """Best effort: monitoring must never fail a committed batch."""
    from offsetflow.source import publish_positions

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
    sink = sink_for(cfg)  # what differs between PostgreSQL, Iceberg and Kafka
    with ledger.transaction() as cur:
        check_fence(cur, batch)  # a stale batch stops here, before it reads anything
    fused = not cfg.transform
    rc: ReadContext | None = None
    added: dict[str, str] = {}
    ddl = False
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
    # the reader schemas the batch's first run resolved, for every run of it
    pinned = pinned_readers(cfg, ledger, batch.batch_id, specs)
    pinned_keys = pinned_readers(cfg, ledger, batch.batch_id, specs, "key")
    if cfg.transform:
        rc = ReadContext.of(cfg, batch.batch_id, dsn, specs, generation, pinned,
                            pinned_keys)
        df = ids.mapInArrow(make_reader(cfg, batch.batch_id, dsn, specs, generation, groups,
                                        rc), spark_ddl(cfg))
        df = load_transform(cfg.transform, cfg.source_file)(df)
        missing = [c for c in ("topic", "partition", "offset") if c not in df.columns]
        if missing:
            raise ConfigError(cfg.source_file, "transform",
                              f"{cfg.transform} dropped the source coordinates {missing}; "
                              f"target rows must keep topic, partition and offset")
        columns = [(f.name, pg_type(f.dataType.simpleString())) for f in df.schema.fields]
        # the stage path stages in PostgreSQL (no data files from the tasks); the sink
        # learns what the reader schemas say of its columns (an Iceberg table's nested ones)
        files = sink.task_files(dsn, batch, columns, (), rc.readers,
                                tasks_here=tasks_here(cfg, spark))
        staging = to_stage_form(df).mapInArrow(
            make_writer(dsn, batch.batch_id,
                        BadRows(cfg.name, cfg.bad_records == "dead_letter"), generation),
            STATS_DDL)
    else:
        # the reader schemas, resolved once for the run; under schema evolution their
        # fields beyond format.schema are columns too (`ReadContext.added`)
        rc = ReadContext.of(cfg, batch.batch_id, dsn, specs, generation, pinned,
                            pinned_keys)
        columns = stage_columns(cfg, rc.schema)
        added = rc.added(dict(cfg.schema))
        # an Iceberg append: the tasks write the table's data files (the table is loaded,
        # or created, here: they need its schema and partition spec)
        files = sink.task_files(dsn, batch, columns, tuple(added), rc.readers,
                                tasks_here=tasks_here(cfg, spark))
        staging = ids.mapInArrow(make_read_and_stage(cfg, batch.batch_id, dsn, specs,
                                                     generation, groups, files, rc),
                                 STATS_DDL)
    sink.check_before_read(batch)  # refused before anything is read, not at the commit
    dead_letters = batch.dead_letters_into(cfg.dead_letter_table)  # an audit's: its shadow
    with connect_ctx(dsn) as cur:
        # a PostgreSQL sink's table; True: the commit adds or widens evolved columns
        ddl = sink.prepare_target(cur, batch, columns, tuple(added))
        # every pipeline may route rows there in its commit: bad records, quality
        # failures, upsert rows without a key, tombstones
        ensure_dead_letter(cur, dead_letters)
    create_stage_tables(dsn, batch.batch_id, columns, parts=n if fused else 0)
    timings["prepare_s"] = round(time.monotonic() - t, 3)

    # append without a quality gate: the commit moves parts while later ones are read
    # (an external sink: unless it commits the whole batch at once in step 4), unless
    # the commit alters the target: its lock would then be held for the whole read
    partwise = fused and not cfg.quality_suite and sink.commits_partwise and not ddl
    spec = CommitSpec(columns=tuple(c for c, _ in columns), mode=cfg.sink.mode,
                      key=tuple(cfg.sink.key), tombstones=cfg.tombstone_policy,
                      dead_letter_table=dead_letters,
                      bad_records_staged=cfg.bad_records == "dead_letter",
                      config_fingerprint=batch.config_fingerprint,
                      stage_generation=generation, subrange_parts=fused,
                      # the tasks wrote files this run, not merely the setting: a sink
                      # that fell back to the stage (a column type the tasks do not
                      # build) has its stage counted against its markers as without it
                      task_files=sink.tasks_write_files and files is not None,
                      add_columns=tuple((c, t) for c, t in columns if c in added),
                      column_defaults={} if rc is None else rc.added_defaults(added),
                      readers=None if rc is None else rc.reader_ids)
    # a sink outside PostgreSQL that commits part by part (a Kafka topic) takes the parts
    # into its own transaction: its step 4 is built now (no quality routes on this path)
    committer = PartwiseCommit(
        dsn, batch, columns=spec.columns, parts=n, dead_letter_table=dead_letters,
        timings=timings, spec=dataclasses.replace(spec, external=sink.external(
            dsn, columns, spec))) if partwise else None
    with committer if committer is not None else contextlib.nullcontext():
        t = time.monotonic()
        stats = staging.collect()
        raise_reported(stats)  # e.g. a warehouse a task could not write: once, by name
        timings["read_stage_s"] = round(time.monotonic() - t, 3)
        staged_at = _ledger_time(ledger)
        skipped = sum(1 for s in stats if s["skipped"])
        log.info("batch %d: staged %d rows in %d parts (%d already staged by an earlier "
                 "attempt)", batch.batch_id, sum(s["rows"] for s in stats), len(stats),
                 skipped)

        if rc is not None:  # before the bad records: a schema change explains them
            check_schema_changes(cfg, rc, ledger, batch.batch_id)
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
        # step 4 outside PostgreSQL (None: in the ledger's transaction), with the quality
        # gate's routes
        spec = dataclasses.replace(spec, external=sink.external(dsn, columns, spec))
        t = time.monotonic()
        if committer is not None:
            result = committer.finish(expected_parts=len(stats), staged_at=staged_at)
        else:
            result = commit_batch(ledger, batch.batch_id, expected_parts=len(stats),
                                  spec=spec, timings=timings, staged_at=staged_at)
        timings["commit_s"] = round(time.monotonic() - t, 3)
    if result.status == "committed":
        _record_commit_time(ledger, batch.batch_id, timings["commit_s"])
        sink.after_commit(dsn, batch, spec)  # e.g. data files of dead attempts
    log.info(result.message)
    if batch.moves_positions and result.status == "committed":
        _publish_lag(cfg, ledger)
    return RunReport(batch.batch_id, result, timings)
