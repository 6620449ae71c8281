"""The Kafka topic sink behind the pipeline's `Sink` interface: step 4 is `KafkaTopicSink`
(one producer transaction per batch); a replay or backfill goes only to the side topic
(`sink.replay_topic`), since Kafka cannot delete what the live topic holds, and once per
window there unless asked for again (`check_window_repeat`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg2
import psycopg2.extensions

from offsetflow.commit import CommitSpec
from offsetflow.config import KafkaSinkConfig, PipelineConfig
from offsetflow.errors import KafkaSinkError, LedgerIdentityError, RequestError
from offsetflow.ledger import Batch, ledger_identity, sweep_task_files, task_file_entries
from offsetflow.ranges import OffsetRange
from offsetflow.sinks.base import Sink
from offsetflow.sinks.kafka.form import key_source, payload_columns
from offsetflow.sinks.kafka.mark import BATCH_HEADER, output_topic, replay_target
from offsetflow.sinks.kafka.sink import KafkaTopicSink
from offsetflow.sinks.kafka.taskfile import (
    KafkaTaskFiles,
    auto_directory,
    check_directory,
    drop_batch_files,
    private_directory,
    written_otherwise,
)
from offsetflow.sinks.kafka.values import BUILT_TYPES, NAME_BYTES
from offsetflow.stage import forget_parts

log = logging.getLogger(__name__)


class KafkaPipelineSink(Sink):
    """`sink.type: kafka`."""

    def __init__(self, cfg: PipelineConfig) -> None:
        super().__init__(cfg)
        assert cfg.sink.kafka is not None
        self.kafka: KafkaSinkConfig = cfg.sink.kafka
        # the directory this run's tasks write (`task_files`; None: the stage), once decided
        self.run_dir: str | None = None
        self.run_decided = False

    # -- the run ---------------------------------------------------------------------------
    def check_before_read(self, batch: Batch) -> None:
        """A replay or backfill without a side topic is refused before anything is read,
        not at the commit (`output_topic`)."""
        output_topic(self.kafka, batch, self.cfg.source_file)

    @property
    def commits_partwise(self) -> bool:
        """Each stage part is produced into the batch's Kafka transaction as soon as its
        task staged it (`KafkaTopicSink.begin_parts`), unless switched off."""
        return KafkaTopicSink.overlap

    @property
    def files_dir(self) -> str | None:
        """Where this pipeline's task files are: `KafkaTopicSink.task_files_dir` (the tests'
        and the bench's override), `sink.task_files`'s directory, or with `auto` (the
        default) this host's private one (`taskfile.auto_directory`; whether a run uses it
        is `task_files`'s decision); None: `off`."""
        if self.auto:
            return auto_directory(self.cfg.spark.conf.get("spark.local.dir"))
        return KafkaTopicSink.task_files_dir or self.kafka.task_files

    @property
    def auto(self) -> bool:
        """`sink.task_files: auto` decides (no directory named, no override): whether a run
        writes files is then `_auto_run_dir`'s choice."""
        return (not KafkaTopicSink.task_files_dir and self.kafka.task_files is None
                and self.kafka.task_files_auto)

    @property
    def tasks_write_files(self) -> bool:
        """`sink.task_files`: the tasks write their parts' finished records to task files,
        the stage stays empty and the commit counts the parts' markers, not the stage (not
        with a transform, a quality suite or value_format avro: those read the stage)."""
        return (self.files_dir is not None and not self.cfg.transform
                and not self.cfg.quality_suite
                and self.kafka.value_format in ("json", "raw"))

    def task_files(self, dsn: str, batch: Batch, columns: Sequence[tuple[str, str]],
                   evolved: Sequence[str] = (),
                   readers: Mapping[str, tuple[int, str] | None] | None = None,
                   tasks_here: bool = False) -> Any:
        """The task files' writers (`tasks_write_files`), or None: the stage, also for a
        batch with a column the sink reads of a type the task does not build (noted in the
        log, decided before the read), and with `auto` where the tasks may run on another
        host than the driver (`tasks_here` False: a cluster master, Spark Connect)."""
        self.run_dir, self.run_decided = None, True
        directory = self.files_dir
        if not self.tasks_write_files or directory is None:
            return None
        if self.auto:
            directory = self._auto_run_dir(batch, directory, tasks_here)
            if directory is None:
                return None
        types = dict(columns)
        wanted = ([self.kafka.value_column] if self.kafka.value_format == "raw" else
                  list(self.kafka.value_columns) or payload_columns(list(types)))
        key_col, _ = key_source(self.kafka, types)
        unbuilt = [c for c in [*wanted, *([key_col] if key_col else [])]
                   if types[c] not in BUILT_TYPES and not (
                       c in (key_col, self.kafka.value_column) and types[c] == "bytea")]
        if unbuilt:
            log.info("batch %d: staged in PostgreSQL, not in task files (sink.task_files): "
                     "the tasks do not build records of columns %s (%s)", batch.batch_id,
                     unbuilt, [types[c] for c in unbuilt])
            return None
        # a JSON value's keys are the stage's column names, which PostgreSQL truncates to
        # 63 bytes (row_to_json writes the truncated name; config and schema evolution
        # refuse such names today): such a batch is left to the stage
        if long := [c for c in wanted if self.kafka.value_format != "raw"
                    and len(c.encode()) > NAME_BYTES]:
            log.info("batch %d: staged in PostgreSQL, not in task files (sink.task_files): "
                     "the column names %s are longer than PostgreSQL's %d bytes",
                     batch.batch_id, long, NAME_BYTES)
            return None
        try:
            check_directory(directory)
        except OSError as e:
            raise KafkaSinkError(f"batch {batch.batch_id}: sink.task_files {directory} "
                                 f"cannot take the task files: {e}; create it (on every "
                                 f"host), or unset sink.task_files") from e
        sweep_closed(dsn, directory, batch.batch_id)
        write_again(dsn, batch.batch_id, directory, self.kafka.task_files_mode)
        self.run_dir = directory
        return KafkaTaskFiles(directory, _ledger_id(dsn), batch.batch_id, self.kafka, types)

    def _auto_run_dir(self, batch: Batch, directory: str, tasks_here: bool) -> str | None:
        """`sink.task_files: auto`: this host's private directory where the tasks run on
        it, else None (the stage), said in the log: files on one host's disk are not where
        another host's tasks write."""
        if not tasks_here:
            log.info("batch %d: staged in PostgreSQL: task files (sink.task_files: auto) are "
                     "used only where the tasks run on the driver's host (a local master, "
                     "not Spark Connect); on a cluster set sink.task_files to a directory "
                     "every host shares", batch.batch_id)
            return None
        try:
            return private_directory(directory)
        except OSError as e:
            log.warning("batch %d: staged in PostgreSQL, not in task files: this host's task "
                        "file directory cannot be used: %s (sink.task_files: auto; name a "
                        "directory of your own in sink.task_files, or set it to off to "
                        "silence this)", batch.batch_id, e)
            return None

    def after_commit(self, dsn: str, batch: Batch, spec: CommitSpec) -> None:
        """The batch's task files dropped once the ledger committed it (not at the Kafka
        commit: a run that finds the batch in the topic reads its left-out records' dead
        letters from them until the ledger holds it)."""
        directory = self.files_dir
        # `auto` on a host that never wrote task files (a cluster's driver): nothing to drop
        if directory is not None and os.path.isdir(directory):
            try:
                drop_batch_files(directory, _ledger_id(dsn), batch.batch_id)
            except (OSError, psycopg2.Error) as e:
                log.warning("batch %d: its task files in %s were not dropped: %s",
                            batch.batch_id, directory, e)

    def external(self, dsn: str, columns: Sequence[tuple[str, str]] | None = None,
                 spec: CommitSpec | None = None) -> KafkaTopicSink:
        """The batch's markers name its files wherever they are; `files_dir` only says
        whether to look them up: after a run's `task_files`, whether that run used files
        (a cluster run of `auto` asks PostgreSQL nothing more), else (a repair, a run
        without one) wherever this pipeline's files may be."""
        files = self.run_dir if self.run_decided else self.files_dir
        return KafkaTopicSink(self.cfg, columns, spec or CommitSpec(columns=()), dsn=dsn,
                              files_dir=files)

    # -- backfill and replay ---------------------------------------------------------------
    def check_window_target(self, kind: str, target_table: str | None) -> None:
        """Only ever into the side topic: never a table, never the live topic."""
        cfg = self.cfg
        if target_table is not None:
            raise RequestError(f"pipeline {cfg.name} writes to Kafka topic {self.kafka.topic}; "
                               f"a {kind} goes to its sink.replay_topic, not to a table "
                               f"(target_table)")
        if self.kafka.replay_topic is None:
            raise RequestError(f"a {kind} of pipeline {cfg.name} would write its records to "
                               f"the live output topic {self.kafka.topic} a second time "
                               f"(Kafka cannot delete them); name a side topic in "
                               f"sink.replay_topic of {cfg.source_file}")

    def check_window_repeat(self, cur: psycopg2.extensions.cursor, kind: str,
                            target_table: str | None, ranges: Sequence[OffsetRange],
                            topic_ids: Mapping[str, str], allow_duplicates: bool) -> None:
        """A window that committed replays or backfills already wrote into the side topic
        is refused there: Kafka cannot delete their records, so a read_committed consumer
        would see the window twice. Ranges of another incarnation of a source topic (its
        Kafka id differs) are other records, and a range that staged nothing wrote none."""
        target = self.window_target(target_table)
        earlier: dict[int, list[str]] = {}
        for r in ranges:
            cur.execute("""SELECT b.batch_id, greatest(br.from_offset, %s),
                                  least(br.until_offset, %s)
                             FROM offsetflow.batches b
                             JOIN offsetflow.batch_ranges br USING (batch_id)
                            WHERE b.pipeline = %s AND b.status = 'committed'
                              AND b.kind IN ('replay', 'backfill') AND b.target_table = %s
                              AND br.topic = %s AND br.partition = %s
                              AND br.from_offset < %s AND br.until_offset > %s
                              AND COALESCE(br.records, 1) > 0
                              AND (br.topic_id IS NULL OR %s::text IS NULL
                                   OR br.topic_id = %s)
                            ORDER BY 1""",
                        (r.from_offset, r.until_offset, self.cfg.name, target, r.topic,
                         r.partition, r.until_offset, r.from_offset, topic_ids.get(r.topic),
                         topic_ids.get(r.topic)))
            for bid, lo, hi in cur.fetchall():
                earlier.setdefault(int(bid), []).append(f"{r.topic}[{r.partition}] [{lo}, {hi})")
        if not earlier:
            return
        ids = sorted(earlier)
        which = (f"batch {ids[0]}" if len(ids) == 1 else
                 "batches " + ", ".join(str(i) for i in ids[:10]) + (" ..." if len(ids) > 10
                                                                      else ""))
        what = "; ".join(earlier[ids[0]][:5])
        topic = target.removeprefix("kafka:")
        if allow_duplicates:
            log.warning("pipeline %s: the %s writes offsets that %s already wrote to %s (%s) "
                        "again, as asked (allow_duplicates)", self.cfg.name, kind, which,
                        topic, what)
            return
        raise RequestError(
            f"pipeline {self.cfg.name}: this {kind} would write records to {topic} a second "
            f"time: {which} already wrote {what} there, and Kafka cannot delete them (a "
            f"read_committed consumer would see them twice). Read that replay where it is "
            f"(each record names its batch in the header {BATCH_HEADER}); or replay into "
            f"another topic (a new sink.replay_topic in {self.cfg.source_file}; no "
            f"--accept-config-change needed); or, to write the window there again anyway "
            f"(consumers then see both copies, told apart by {BATCH_HEADER}; safe if {topic} "
            f"was emptied or recreated since), ask with allow_duplicates (offsetflow {kind} "
            f"--allow-duplicates, or the form's Allow duplicates)")

    def writes_live_output(self, target_table: str | None) -> bool:
        """Never: a backfill writes the side topic (`check_window_target`)."""
        return False

    def window_target(self, target_table: str | None) -> str:
        """The side topic the batch writes to, not the live one (`kafka:<topic>`)."""
        return target_table or replay_target(self.kafka, self.cfg.sink.table)

    # -- repairs ---------------------------------------------------------------------------
    def complete_from(self, dsn: str, batch: Batch) -> KafkaTopicSink:
        return self.external(dsn)

    @property
    def live_topic(self) -> str | None:
        return self.kafka.topic


def sweep_closed(dsn: str, directory: str, batch_id: int) -> int:
    """At the start of a run with task files: the files of this ledger's committed or
    abandoned batches removed (`sweep_task_files`: one listing, one query), so files
    left by a driver that died between the ledger's COMMIT and their unlink (or lost the
    COMMIT's outcome) do not pile up until `offsetflow cleanup`. Best effort: a sweep
    that fails or refuses (another ledger shares this one's identity) is logged, never
    the run's failure. How many removed."""
    try:
        with contextlib.closing(psycopg2.connect(dsn)) as conn, conn, conn.cursor() as cur:
            removed = sweep_task_files(cur, directory)
    except LedgerIdentityError as e:
        log.warning("batch %d: no task file swept: %s", batch_id, e)
        return 0
    except Exception as e:  # best effort, whatever the directory holds: never the run's
        log.warning("batch %d: task files of closed batches in %s not swept: %s", batch_id,
                    directory, e, exc_info=not isinstance(e, (OSError, psycopg2.Error)))
        return 0
    if removed:
        log.info("batch %d: %d task file(s) of committed or abandoned batches removed from "
                 "%s (left by a driver that died after its ledger commit, or by killed "
                 "tasks)", batch_id, len(removed), directory)
    return len(removed)


def write_again(dsn: str, batch_id: int, directory: str, mode: int) -> list[int]:
    """Before the tasks run: the parts of the batch whose kept file the driver may not read
    but that would now be written otherwise (`written_otherwise`: `sink.task_files`,
    `sink.task_files_mode` or the setgid directory's group changed since, the ways out a
    `TaskFileAccessError` names) dropped with their markers, so this run's tasks write them
    again under the new setting. Without this the files kept keep their old mode and
    group, and every run fails on them as before the fix. One query where the batch has no
    task file yet."""
    with contextlib.closing(psycopg2.connect(dsn)) as conn, conn, conn.cursor() as cur:
        entries = {part: named[0] for part, named in task_file_entries(cur, batch_id).items()}
    again = written_otherwise(entries, mode, directory) if entries else {}
    if again:
        log.warning("batch %d: the driver may not read the task files of part(s) %s, which "
                    "this run writes again under the changed setting: %s", batch_id,
                    sorted(again), "; ".join(f"part {p}: {why}"
                                             for p, why in sorted(again.items())[:5]))
        forget_parts(dsn, batch_id, sorted(again))
    return sorted(again)


def _ledger_id(dsn: str) -> str:
    """The ledger's installation id: the task files' names start with it (`taskfile`)."""
    with contextlib.closing(psycopg2.connect(dsn)) as conn, conn.cursor() as cur:
        return ledger_identity(cur).installation_id
