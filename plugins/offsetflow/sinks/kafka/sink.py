"""The Kafka topic sink: step 4 of the commit protocol (`offsetflow.commit.spec.ExternalSink`)
as one Kafka transaction per batch, written by the driver.

Tasks stage rows in PostgreSQL as for every sink (the stage is the batch's durable buffer).
Inside the commit's still-open ledger transaction, with the batch row locked:
  `find`: `init_transactions` with the batch's stable `transactional.id` first. That bumps
    the producer epoch, so a zombie of an older attempt can neither commit nor add records
    from here on (the broker fences it), and it completes or aborts whatever transaction an
    earlier attempt left. Only then are the sink group's committed offsets read
    (read_committed, so stable): this batch's until_offsets with its metadata mean the Kafka
    commit happened and the ledger only has to catch up; nothing is produced again.
  `write`: the stage in source order (a server-side cursor, bounded memory) is produced in
    one transaction, the batch's until_offsets go into the same transaction with
    `send_offsets_to_transaction` (KIP-98), and it commits. Output and the record of the
    commit are visible together or not at all; the ledger's COMMIT follows. The producer
    follows the output topic's settings (`offsetflow.sinks.kafka.limits.TopicSettings`);
    a record the broker refused for itself is found after the abort
    (`offsetflow.sinks.kafka.refusals`) and left out of a new transaction of the attempt.
  Part by part (`begin_parts`, `take_parts`: `offsetflow.commit.PartwiseCommit`): the
    commit starts before the tasks end, with the batch row locked; `begin_parts` does
    `find`'s fence and look (and `write`'s refusals) before the first record, then each stage
    part is produced into the open transaction as soon as its task staged it, in source
    order per partition (a segment waits for the earlier sub-ranges of its partition:
    `offsetflow.sinks.kafka.order`). `write` after the read produces what is left into the
    same transaction and commits it as above. The overlap stops (the read's records are
    produced after it instead, in a transaction of their own) when its transaction gets
    old: past OVERLAP_SHARE of `transaction.timeout.ms` (the broker would abort it, and
    every retry of a long read the same way); and when a pass fails during the read (a
    record refused: `write`'s passes take it from there, as for any failed pass).
Which names, which topic and how a row becomes a record: `offsetflow.sinks.kafka.form`; the
producer and its transaction (open, send offsets, commit, retry, abort, fence):
`offsetflow.sinks.kafka.txn`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psycopg2.extensions
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTopicPartition
from confluent_kafka.admin import AdminClient
from psycopg2 import sql

from offsetflow.commit import CommitSpec, Moved, move_stage_dead_letters
from offsetflow.config import PipelineConfig
from offsetflow.errors import KafkaSinkError, StagedRowsLostError, TaskFileLostError
from offsetflow.ledger import (
    Batch,
    LedgerIdentity,
    ledger_identity,
    stage_part_table,
    stage_table,
    task_file_entries,
)
from offsetflow.ranges import OffsetRange, split_ranges
from offsetflow.sinks.kafka import taskfile
from offsetflow.sinks.kafka.avro_value import AvroValueEncoder, ValueDoesNotFit
from offsetflow.sinks.kafka.form import (
    OUTPUT_SETTINGS,
    check_columns,
    parts_select_sql,
    record_headers,
    record_size,
    rows_per_fetch,
    select_sql,
    stage_extent_sql,
)
from offsetflow.sinks.kafka.limits import (
    TIMESTAMP_MARGIN_MS,
    TopicSettings,
    note_output_partitions,
    refuse_window_repeat,
    replace_window_dead_letters,
    route_not_produced,
    topic_settings,
)
from offsetflow.sinks.kafka.mark import (
    BATCH_HEADER,
    SOURCE_HEADER,
    CommitMark,
    NotProduced,
    commit_batch_ids,
    committed_state,
    not_produced_in,
    output_topic,
    records_in,
    refuse_group_ahead,
)
from offsetflow.sinks.kafka.order import Segment, segments
from offsetflow.sinks.kafka.order import ready as ready_segments
from offsetflow.sinks.kafka.output_schema import pinned_encoder
from offsetflow.sinks.kafka.refusals import find_sources, judge, primary, refusal_error
from offsetflow.sinks.kafka.stage import prefetched
from offsetflow.sinks.kafka.txn import (
    KAFKA_TIMEOUT_S,
    KafkaTransaction,
    PassAborted,
    abortable_produce,
    fence,
)
from offsetflow.stage import Marker, Packing, staged_per_range, staged_rows

log = logging.getLogger(__name__)

# test-only fault points (tests/integration/sinks/kafka/test_sink_kafka*.py), looked up once
# per batch: pause_before_commit (records produced and flushed, transaction open; waits for
# the RESUME file, after writing the PAUSED file) | pause_in_overlap (the same, in the
# commit's thread right after the first records were produced during the read: the
# transaction open, the tasks going on) | pause_before_remainder (the same, after the read,
# before the overlap's pass produces what is left) | kill_after_commit (SIGKILL of the process group
# right after the Kafka commit, before the ledger's)
FAULT_ENV = "OFFSETFLOW_TEST_SINK_KAFKA_FAULT"
PAUSED_ENV = "OFFSETFLOW_TEST_SINK_KAFKA_PAUSED"
RESUME_ENV = "OFFSETFLOW_TEST_SINK_KAFKA_RESUME"

CURSOR_ROWS = 5_000
# a task file record's bytes besides its key, value and headers (topic name, partition,
# offset, timestamp), as `stage_extent_sql` adds its fixed columns': an upper bound
FILE_FIXED_BYTES = 320
# driver memory for one fetch of staged rows (large records: fewer rows per fetch; up to
# four fetches at once: one produced, two read ahead, one being read)
FETCH_BYTES = 16 * 2**20
# a row whose key and value alone are this far below the record limit needs no exact size
NEAR_LIMIT_BYTES = 65_536
# passes of one commit attempt that found no new record the broker refused for itself (a
# transaction left abortable for another cause). A pass that did find some is progress and
# is not counted: a pass finds only the refusals before its transaction became abortable
# (often one), so a bound on those would fail a batch with more such records every run
# the same way; they are bounded by the staged records instead (each such pass leaves out
# at least one more)
MAX_PASSES = 4
# the share of transaction.timeout.ms a transaction opened during the read may reach while
# the read goes on (and at its end, to be continued): beyond it the overlap's transaction
# is aborted and the batch produced after the read, so a read longer than the timeout
# never makes every attempt's transaction time out (a wedge)
OVERLAP_SHARE = 0.5
# after the read, the overlap's pass produces what is left while its transaction is younger
# than this share of transaction.timeout.ms; past it (a skewed read left a whole partition
# for after it) the pass is aborted and the batch produced in a new transaction, as short as
# without the overlap: else the broker aborts it on every retry alike (a wedge)
REMAINDER_SHARE = 0.8


class KafkaTopicSink(KafkaTransaction):
    """`ExternalSink` for `sink.type: kafka`. One instance serves one commit attempt."""

    # read the stage parts unsorted where they allow (False: always sorted; the A/B
    # measurement in docs/performance.md switches it)
    read_parts = True
    # produce each stage part while later ones are read (`begin_parts`; False: only after
    # the last task, as before; `KafkaPipelineSink.commits_partwise` follows it)
    overlap = True
    # the tests' and the bench's override of `sink.task_files` (also through this
    # variable, for a job run as a process; `include/bench/kafka_ab.py --task-files DIR`).
    # The markers decide how a batch is read (`records`), not this setting.
    task_files_dir: str | None = os.environ.get("OFFSETFLOW_TEST_KAFKA_TASK_FILES") or None

    def __init__(self, cfg: PipelineConfig, columns: Sequence[tuple[str, str]] | None,
                 spec: CommitSpec, timeout_s: float = KAFKA_TIMEOUT_S, dsn: str = "",
                 files_dir: str | None = None) -> None:
        """`columns`: the stage's (None: only `find`, which reads no rows); `dsn`: the
        ledger's (value_format: avro pins its schema id in a transaction of its own);
        `files_dir`: where the batch's task files may be (`KafkaPipelineSink.external`;
        None: its markers are not looked up, the stage is read)."""
        super().__init__(cfg, timeout_s)
        self.dsn = dsn
        self.files_dir = files_dir or self.task_files_dir
        # value_format: avro: each record's value bytes (`pinned_encoder`, built in `write`)
        self.encoder: AvroValueEncoder | None = None
        self.columns = dict(columns or ())
        if columns is not None:
            check_columns(self.sink, self.columns, cfg.source_file)
        self.spec = spec  # its dead-letter settings: the tasks' bad records go there
        # the group's offsets `find` read when the batch was not there (`write` checks them)
        # the stage parts' segments as `write` reads them unsorted (None: sorted)
        self._unsorted: list[Segment] | None = None
        self._unfound: dict[tuple[str, int], tuple[int, str | None]] | None = None
        self.stage_gone = False  # see `completing`
        self._ov: _Overlap | None = None  # the part-wise overlap (`begin_parts`)
        self._txn_batch: Batch | None = None  # whose transaction is open (for `close`)
        # `write`'s phases (wall s), reported in the batch's timings (`Moved.timings`)
        self.phases: dict[str, float] = {}

    # --- ExternalSink ---------------------------------------------------------------

    def completing(self) -> None:
        """`offsetflow complete`: the stage is lost; `find` takes the counts and the
        left-out records from the commit's offset metadata alone."""
        self.stage_gone = True

    def find(self, cur: psycopg2.extensions.cursor, batch: Batch) -> Moved | None:
        if self._ov is not None:  # `begin_parts` fenced and looked: not committed there
            return None
        topic = output_topic(self.sink, batch, self.cfg.source_file)
        ident = ledger_identity(cur)
        self._mark = CommitMark(self.cfg.name, ident.installation_id, topic)
        self._open(batch)
        try:
            return self._find(cur, batch, topic, ident)
        except BaseException:
            self.close()
            raise

    def _find(self, cur: psycopg2.extensions.cursor, batch: Batch, topic: str,
              ident: LedgerIdentity) -> Moved | None:
        mark, state = self._mark, self._committed(batch, self._mark)
        found = committed_state(batch, mark, state)
        self._unfound = None if found else state
        if not found and ident.predates(batch.batch_id):
            # planned before the ledger identity: an earlier attempt may have committed it
            # under the older names and metadata; fence that transactional.id, then look
            mark = CommitMark.legacy(self.cfg.name)
            state = self._committed(batch, mark)
            found = committed_state(batch, mark, state)
            if found:
                log.warning("batch %d: committed in Kafka under the names before the ledger "
                            "identity (group %s); completing the ledger", batch.batch_id,
                            mark.group(batch))
        if not found:
            return None  # the producer stays open (and its fence up) for `write`
        skipped = not_produced_in(batch, mark, state)
        self.close()
        log.info("batch %d: its Kafka transaction to %s is committed (group %s holds its "
                 "offsets); nothing is produced again", batch.batch_id, topic,
                 mark.group(batch))
        # the records that transaction left out go to the dead-letter table as it did
        replace_window_dead_letters(cur, self.cfg, batch)
        route_not_produced(cur, self.cfg, self.columns, batch, skipped, topic, None,
                           stage_gone=self.stage_gone, records=None if self.stage_gone
                           else self.left_out(cur, batch, skipped))
        if self.stage_gone:  # `offsetflow complete`: its task files go with the stage
            self._drop_task_files(batch, ident)
            return _moved_from_record(batch, records_in(batch, mark, state), skipped)
        moved = Moved(rows=staged_rows(cur, batch.batch_id) - len(skipped), dead=len(skipped))
        move_stage_dead_letters(cur, batch, self.spec, moved)
        return moved

    def _drop_task_files(self, batch: Batch, ident: LedgerIdentity) -> None:
        """Every task file of the batch in `files_dir` (best effort): where the
        markers that name them are lost (`offsetflow complete` after a PostgreSQL crash),
        the ledger's drop (`drop_named_task_files`) cannot find them."""
        directory = self.files_dir
        if directory is None:
            return
        try:
            taskfile.drop_batch_files(directory, ident.installation_id, batch.batch_id)
        except OSError as e:
            log.warning("batch %d: its task files in %s were not dropped: %s",
                        batch.batch_id, directory, e)

    def _committed(self, batch: Batch, mark: CommitMark
                   ) -> dict[tuple[str, int], tuple[int, str | None]]:
        """The committed offsets of `mark`'s group for the batch's partitions, read after
        `init_transactions` of its transactional.id (`_open` made it for this run's own
        mark; another's, the older names, is fenced here). A partition the broker answers
        with an error is no answer: refused, never taken for "not committed" (which would
        produce the batch again)."""
        group = mark.group(batch)
        tps = [KTopicPartition(r.topic, r.partition) for r in batch.ranges]
        consumer = self._consumer
        try:
            if mark != self._mark:
                fence(self.cfg, mark.transactional_id(batch), self.timeout_s)
                consumer = Consumer({**self.cfg.admin_settings(), "group.id": group,
                                     "enable.auto.commit": False,
                                     "isolation.level": "read_committed"})
            assert consumer is not None
            try:
                found = consumer.committed(tps, timeout=self.timeout_s)
            finally:
                if consumer is not self._consumer:
                    consumer.close()
            return committed_offsets(batch, group, found)
        except KafkaException as e:
            raise KafkaSinkError(f"batch {batch.batch_id}: cannot read the committed offsets "
                                 f"of group {group}: {e}") from e

    def write(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int) -> Moved:
        topic = output_topic(self.sink, batch, self.cfg.source_file)
        if self._producer is None:
            self._mark = CommitMark(self.cfg.name, ledger_identity(cur).installation_id, topic)
            self._open(batch)
        try:
            if self._ov is None:  # else `begin_parts` did, before the first record
                self._refusals(cur, batch, topic)
            return self._write(cur, batch, staged, topic)
        except BaseException:
            if self._open_txn:  # not left open: it would hold back read_committed readers
                self._abort(batch)
            raise
        finally:
            self.close()

    def _refusals(self, cur: psycopg2.extensions.cursor, batch: Batch, topic: str) -> None:
        """`write`'s refusals before any record, and the Avro schema it writes with."""
        # not in `find`: abandoning a batch the sink does not hold stays possible
        state = (self._unfound if self._unfound is not None
                 else self._committed(batch, self._mark))
        refuse_group_ahead(batch, self._mark, state, _known_commits(cur, batch, state))
        refuse_window_repeat(cur, batch, topic)  # a replay planned before that refusal
        if self.sink.value_format == "avro":  # the registry asked before any record
            self.encoder = pinned_encoder(self.dsn, cur, self.cfg, batch, topic,
                                          self.columns)

    def close(self) -> None:
        """An open transaction is aborted first (a failure while the read went on, or the
        run aborted): never left open, which would hold back read_committed readers."""
        if self._open_txn and self._producer is not None and self._txn_batch is not None:
            self._abort(self._txn_batch)
        super().close()

    # --- part by part, while the read goes on (PartwiseSink) ------------------------

    def begin_parts(self, cur: psycopg2.extensions.cursor, batch: Batch,
                    layout: Packing | None) -> None:
        """`find`'s fence and look, and `write`'s refusals, before the first record. The
        batch already committed in Kafka (or planned before the ledger identity: its look
        under the older names is `find`'s), a layout whose parts cannot be read in source
        order without a sort, or the switch off: nothing is produced during the read."""
        if not self.overlap or layout is None or batch.split_offsets is None:
            return
        plan = segments(layout.split, dict(enumerate(layout.groups)))
        ident = ledger_identity(cur)
        if not plan or ident.predates(batch.batch_id):
            return
        topic = output_topic(self.sink, batch, self.cfg.source_file)
        self._mark = CommitMark(self.cfg.name, ident.installation_id, topic)
        self._open(batch)
        try:
            state = self._committed(batch, self._mark)
            if committed_state(batch, self._mark, state):
                self.close()  # `find` after the read completes the ledger from it
                return
            self._unfound = state
            self._refusals(cur, batch, topic)
            by_source = self.sink.partitioning == "source"
            md = self._check_replicas(batch, topic, sorted(
                {r.partition for r in batch.ranges}) if by_source else None)
            cur.execute(OUTPUT_SETTINGS)
            cur.execute("SET LOCAL jit = off")
            cur.execute("SET LOCAL synchronize_seqscans = off")
        except BaseException:
            self.close()
            raise
        self._ov = _Overlap(topic, plan, md, self.settings.record_limit(self.sink.producer))
        log.info("batch %d: producing its stage parts to %s as their tasks stage them "
                 "(transactional.id %s)", batch.batch_id, topic, self._txn_id)

    def take_parts(self, cur: psycopg2.extensions.cursor, batch: Batch,
                   staged: Sequence[Marker]) -> None:
        """Produce every segment whose part is staged and whose earlier sub-ranges of its
        partition are produced, into the overlap's transaction (begun with its first
        record). Called on every poll: it also serves delivery reports, and stops the
        overlap once its transaction is too old or its pass failed."""
        ov = self._ov
        if ov is None or ov.stopped:
            return
        ov.staged.update(m.part for m in staged)
        p = self._producer
        assert p is not None
        p.poll(0)
        if ov.pass_ is not None and self._failed:
            self._stop(batch, "a record of the read's pass was not delivered")
            return
        if ov.pass_ is not None and self._too_old():
            self.phases["kafka_overlap_given_up_s"] = round(
                time.monotonic() - self._txn_began, 3)
            self._abort(batch)
            ov.pass_ = None
            self._stop(batch, f"its transaction reached {OVERLAP_SHARE:.0%} of "
                              f"transaction.timeout.ms ({self._txn_timeout_ms} ms) while "
                              f"the read went on; aborted, the batch is produced after the "
                              f"read")
            self._reopen(batch)
            return
        ready = ready_segments(ov.plan, ov.done, ov.staged)
        if not ready:
            return
        t = time.monotonic()
        largest = self._largest_in(cur, batch, [ov.plan[i] for i in ready])
        if ov.pass_ is None:
            ov.pass_ = self._begin_pass(batch, self.settings.timestamp_bounds(
                int(time.time() * 1000)))
        try:
            self._produce_rows(cur, batch, ov.topic, len(ov.md.partitions), ov.limit,
                               largest, ov.pass_,
                               self.records(cur, batch, [ov.plan[i] for i in ready]), {})
        except (PassAborted, _OutOfOrder) as e:  # `write`'s passes take it from here
            ov.pass_.error = e
            self._stop(batch, str(e))
            return
        first = not ov.done
        ov.done.update(ready)
        self._phase("kafka_overlap_s", t)
        if first:
            _fault_point("pause_in_overlap")

    def _largest_in(self, cur: psycopg2.extensions.cursor, batch: Batch,
                    segs: Sequence[Segment]) -> int:
        """The largest staged row of the overlap's parts so far, `segs`' parts measured
        (one scan of each part, once): it sizes the fetches."""
        ov = self._ov
        assert ov is not None
        for part in sorted({g.part for g in segs} - ov.measured):
            cur.execute(stage_extent_sql(self.columns, stage_part_table(batch.batch_id, part)))
            row = cur.fetchone()
            ov.largest = max(ov.largest, int(row[0]) if row else 0)
            ov.measured.add(part)
        return ov.largest

    def _stop(self, batch: Batch, why: str) -> None:
        """Nothing more is produced during the read (`why`); `write` takes it from here.
        The pass's transaction, if still open, is aborted now (its delivery reports kept
        for `write`'s refusal lookup): it can only be aborted, and left open for the rest
        of the read it would pin the last stable offset of every partition it wrote to,
        holding read_committed consumers of the topic back (up to transaction.timeout.ms)."""
        assert self._ov is not None
        self._ov.stopped = why
        stopped = round(time.monotonic() - self._txn_began, 3) if self._txn_began else 0.0
        p = self._producer
        if self._open_txn and p is not None:
            # its records purged and their reports served first: librdkafka holds them
            # once the transaction failed, and abort_transaction times out while any
            # report is unserved (which would leave the transaction open)
            p.purge()
            deadline = time.monotonic() + self.timeout_s
            while len(p) and time.monotonic() < deadline:
                p.poll(0.05)
            self._abort(batch)
        self.phases["kafka_overlap_stopped_s"] = stopped
        log.warning("batch %d: no more of it is produced during the read: %s",
                    batch.batch_id, why)

    def _too_old(self) -> bool:
        """The open transaction is past OVERLAP_SHARE of its timeout."""
        return bool(self._txn_began) and (time.monotonic() - self._txn_began) * 1000 > \
            OVERLAP_SHARE * self._txn_timeout_ms

    def _continued(self, batch: Batch) -> tuple[_Pass, list[Segment]] | None:
        """After the read: the overlap's pass and the segments it has still to produce,
        when it goes on (a failed one too: `_write` ends it as any failed pass). None: the
        batch is produced whole (no overlap; nothing produced during the read; the stage
        is not the layout's parts, read unsorted; or its transaction too old, aborted
        here with a new producer)."""
        ov = self._ov
        if ov is None:
            return None
        if ov.pass_ is None:
            if ov.settings_changed:  # the producer follows the topic's settings
                self._reopen(batch)
            return None
        ps = ov.pass_
        if (ps.error is not None or self._failed) and not ov.settings_changed:
            return ps, []
        why = ("the output topic's settings changed during the read"
               if ov.settings_changed else
               "the stage is not read part by part" if self._unsorted is None
               or not set(self._unsorted) <= set(ov.plan) else
               f"its transaction is past {OVERLAP_SHARE:.0%} of transaction.timeout.ms"
               if self._too_old() else "")
        if why:
            log.warning("batch %d: what was produced during the read is aborted (%s); the "
                        "batch is produced again in a new transaction", batch.batch_id, why)
            if self._open_txn:  # (else aborted as the overlap stopped)
                self._abort(batch)
            ov.pass_ = None
            self._reopen(batch)
            return None
        return ps, [seg for i, seg in enumerate(ov.plan) if i not in ov.done]

    def _reread_settings(self, batch: Batch, topic: str) -> None:
        """After the read: the output topic's settings read again. The overlap read them
        before the read, which may take minutes; the commit after the read used to read
        them then, and every pass of the attempt is produced and judged under the ones it
        holds (a limit lowered meanwhile: a record over it refused by the broker and judged
        against the old one, the attempt failed). Changed: what was produced under the old
        ones is aborted (`_continued`) and the batch produced under the new ones. Not
        readable now (a broker restarting): the ones read before the read stay."""
        assert self._ov is not None
        admin = AdminClient(dict(self.cfg.admin_settings()))  # type: ignore[arg-type]
        fresh = topic_settings(admin, batch, topic, self.timeout_s)
        if fresh == self.settings or fresh == TopicSettings(topic):
            return
        log.warning("batch %d: the settings of %s changed during the read (%s, now %s); "
                    "the batch is produced under the new ones", batch.batch_id, topic,
                    self.settings, fresh)
        self.settings = fresh
        self._ov.settings_changed = True

    def records(self, cur: psycopg2.extensions.cursor, batch: Batch,
                segs: Sequence[Segment] | None = None, *, ordered: bool = True
                ) -> sql.Composed | FileParts:
        """The one way the sink reads a batch's records, whatever reads them (a produce
        pass, its extent, the broker-refusal lookup, the dead letters of records not
        produced): the task files its parts' markers name (`taskfile`, issue 32) when they
        name files, else the stage; `segs`: those segments in that order, else the whole
        batch (in source order when `ordered`). Looked up only where the batch's files may
        be (`files_dir`): a run that staged in PostgreSQL asks it nothing more. A batch
        written to files and run again with the setting off is counted against the empty
        stage by the commit (`CommitSpec.task_files` follows the setting) and re-staged."""
        entries = self._file_entries(cur, batch, None if segs is None else
                                     {g.part for g in segs}) if self.files_dir else {}
        if entries:
            return FileParts(batch.batch_id, sorted((p, None) for p in entries)
                              if segs is None else
                              [(g.part, None if g.alone else g.range) for g in segs],
                              entries, ordered and segs is None)
        if segs is None:
            return select_sql(self.sink, self.columns, stage_table(batch.batch_id))
        return parts_select_sql(self.sink, self.columns, [
            (stage_part_table(batch.batch_id, g.part), None if g.alone else g.range)
            for g in segs])

    def extent(self, cur: psycopg2.extensions.cursor, batch: Batch
               ) -> tuple[int, int | None, int | None]:
        """The batch's largest record (bytes, an upper bound) and earliest and latest
        timestamp (epoch ms; None when its records have none), read where `records`
        reads them."""
        src = self.records(cur, batch, ordered=False)
        if isinstance(src, FileParts):
            return src.extent()
        cur.execute(stage_extent_sql(self.columns, stage_table(batch.batch_id)))
        row = cur.fetchone() or (0, None, None)
        return int(row[0] or 0), row[1], row[2]

    def chunks(self, cur: psycopg2.extensions.cursor, batch: Batch,
               src: sql.Composable | FileParts, name: str, rows: int
               ) -> Generator[list[tuple[Any, ...]], None, None]:
        """`src`'s rows in chunks: topic, partition, offset, key (hex text from the stage,
        bytes from a file: `FileParts`), value, headers, timestamp (ms)."""
        if isinstance(src, FileParts):
            return src.chunks()
        return prefetched(cur.connection, f"{name}_{batch.batch_id}", src, rows)

    def left_out(self, cur: psycopg2.extensions.cursor, batch: Batch,
                 skipped: Sequence[NotProduced]
                 ) -> dict[tuple[str, int, int], tuple[bytes | None, bytes | None, int | None]]:
        """The key, value and timestamp of records not produced, from the task files (for
        their dead letters); empty when the batch's records are in the stage (the dead
        letters are copied from it there)."""
        if not skipped:
            return {}
        src = self.records(cur, batch, ordered=False)
        if not isinstance(src, FileParts):
            return {}
        return src.rows_at({(r.topic, r.partition, r.offset) for r in skipped})

    # --- the transaction's records -----------------------------------------------

    def _write(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int,
               topic: str) -> Moved:
        if self._ov is not None:  # read before the read: read again, as the commit did
            self._reread_settings(batch, topic)
        p = self._producer
        assert p is not None and self._consumer is not None
        by_source = self.sink.partitioning == "source"
        md = self._ov.md if self._ov is not None else self._check_replicas(
            batch, topic, sorted({r.partition for r in batch.ranges}) if by_source else None)
        limit = self.settings.record_limit(self.sink.producer)
        extent: list[Any] = []  # the whole stage's, scanned once a pass reads it whole

        def stage_extent() -> tuple[int, int | None, int | None]:
            """The largest staged row and the earliest and latest timestamp: one scan of
            the stage, not needed by the overlap's pass going on (it measured its parts)."""
            if not extent:
                t = time.monotonic()
                extent.extend(self.extent(cur, batch))
                self._phase("kafka_extent_s", t)
            return int(extent[0] or 0), extent[1], extent[2]

        cur.execute(OUTPUT_SETTINGS)  # the same JSON text every run, whatever the session
        # a streamed cursor: compiling its expressions (JIT) costs more than it saves
        cur.execute("SET LOCAL jit = off")
        # no index on the stage here: a CREATE INDEX on an UNLOGGED stage part in this
        # transaction left PostgreSQL unable to finish crash recovery ("could not create
        # file ...: File exists") after `pg_ctl stop -m immediate` (test_sink_kafka_faults).
        # No sort either where the parts allow: they are read one after the other as stored
        # (`offsetflow.sinks.kafka.order`), each record's offset checked as it is produced
        self._unsorted = self._segments(cur, batch) if self.read_parts else None
        # the pass begun during the read, when it goes on
        pending = self._continued(batch)
        p = self._producer  # a new one when the overlap's pass was given up there
        assert p is not None
        # records the broker refused for themselves in an earlier pass of this attempt
        refused: dict[tuple[str, int, int], NotProduced] = {}
        why = ""  # why the last pass's transaction was aborted
        attempt = idle = 0  # passes; passes that found no new refused record
        # the last pass met a record out of source order in the unsorted read (`_unsorted`)
        resorted = False
        while True:
            attempt += 1
            began_ms = int(time.time() * 1000)
            try:
                if pending is not None:
                    ps, left = pending
                    pending = None
                    began_ms = ps.began_ms
                    if ps.error is not None:
                        raise ps.error
                    if left and not self._failed:
                        _fault_point("pause_before_remainder")
                        t = time.monotonic()
                        self._produce_rows(cur, batch, topic, len(md.partitions), limit,
                                           self._largest_in(cur, batch, left), ps,
                                           self.records(cur, batch, left), refused,
                                           deadline=self._txn_began + REMAINDER_SHARE
                                           * self._txn_timeout_ms / 1000)
                        self._phase("kafka_produce_s", t)
                    if self._failed:  # a report during the read: this pass is over
                        raise _PassFailed(f"librdkafka reported {len(self._failed)} records "
                                          f"not delivered: {self._failed[0].reason}")
                    produced, skipped = ps.produced, ps.skipped
                else:
                    largest, ts_min, ts_max = stage_extent()
                    lo, hi = self.settings.timestamp_bounds(began_ms)
                    bounds = (lo, hi) if ts_min is not None and ts_max is not None and (
                        ts_min < lo or ts_max > hi) else None
                    produced, skipped = self._produce_stage(cur, batch, topic,
                                                            len(md.partitions), limit,
                                                            largest, bounds, refused)
                if produced + len(skipped) != staged:
                    self._abort(batch)
                    raise StagedRowsLostError(batch.batch_id, None,
                                              f"the stage holds {produced + len(skipped)} "
                                              f"rows but its markers count {staged}")
                t = time.monotonic()
                self._flush()
                self._phase("kafka_flush_s", t)
                if not self._failed:  # a report of any kind: a record is not in it
                    t = time.monotonic()
                    self._send_offsets(batch, skipped, staged_per_range(cur, batch.batch_id))
                    break
                why = (f"librdkafka purged {len(self._failed)} of its records: "
                       f"{self._failed[0].reason}")
            except PassAborted as e:  # abortable with no record refused (so far)
                why = e.reason
            except _PassFailed as e:
                why = str(e)
            except _OutOfOrder as e:  # at most once: the next passes read sorted
                log.warning("batch %d: %s; producing the batch again from the stage read "
                            "sorted", batch.batch_id, e)
                self._unsorted = None
                resorted = True
            if self._open_txn:
                self._abort(batch)
            try:  # the purged messages' reports, before the next pass counts its own
                p.poll(0)
            except KafkaException as e:  # fatal: a producer the broker fenced as it timed
                if self._timed_out() is None:  # out its transaction (none of it visible);
                    raise  # any other fence: a newer run, which this one never fences back
                log.warning("batch %d: the aborted pass's producer is fenced (%s): %s",
                            batch.batch_id, e, self._timed_out())
            before = len(refused)
            if primary(self._failed):
                for rec in self._refused_by_broker(cur, batch, topic, stage_extent()[0],
                                                   began_ms):
                    refused[(rec.topic, rec.partition, rec.offset)] = self._not_produced(
                        batch, topic, limit, rec)
            if len(refused) > before:  # progress: at most one such pass per staged record
                why = f"the broker refused {len(refused)} records for themselves"
                log.warning("batch %d: the broker refused %d records of %s for themselves "
                            "(pass %d); producing the batch again without them",
                            batch.batch_id, len(refused), topic, attempt)
            elif resorted:  # not a failed pass: the stage is read another way
                resorted = False
            else:
                idle += 1
                if idle >= MAX_PASSES:
                    raise KafkaSinkError(
                        f"batch {batch.batch_id}: the transaction to {topic} still failed "
                        f"after {attempt} passes, {idle} of them with no record refused "
                        f"(last: {why}); nothing is visible, the next run produces the batch "
                        f"again")
                log.warning("batch %d: the transaction of pass %d to %s failed with no "
                            "record refused (%s) and was aborted; producing the batch again "
                            "in a new transaction", batch.batch_id, attempt, topic, why)
            p = self._reopen(batch)
        _fault_point("pause_before_commit")
        self._commit(batch, topic, produced)
        self._open_txn = False
        self._phase("kafka_commit_s", t)
        _fault_point("kill_after_commit")
        note_output_partitions(cur, batch, topic, len(md.partitions), not by_source)
        replace_window_dead_letters(cur, self.cfg, batch)
        route_not_produced(cur, self.cfg, self.columns, batch, skipped, topic, limit,
                           records=self.left_out(cur, batch, skipped))
        moved = Moved(rows=produced, dead=len(skipped), timings=dict(self.phases))
        move_stage_dead_letters(cur, batch, self.spec, moved)
        return moved

    def _phase(self, name: str, since: float) -> None:
        """Add the wall time since `since` to phase `name` (summed over passes)."""
        self.phases[name] = round(self.phases.get(name, 0.0) + time.monotonic() - since, 3)

    def _segments(self, cur: psycopg2.extensions.cursor, batch: Batch) -> list[Segment] | None:
        """The stage as segments to read one after the other in source order without a sort
        (`offsetflow.sinks.kafka.order`), or None: read the stage sorted (rows in the stage
        table itself, as a transform run stages them; a part whose table is missing; a
        batch planned before its split was recorded; markers that name no such layout)."""
        t = time.monotonic()
        try:
            if batch.split_offsets is None:
                return None
            cur.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM ONLY {})").format(
                stage_table(batch.batch_id)))
            row = cur.fetchone()
            if row is None or row[0]:
                return None
            cur.execute("""SELECT part, subranges,
                                  to_regclass(format('offsetflow_stage.%%I',
                                                     'b' || batch_id || '_p' || part))
                                  IS NOT NULL
                             FROM offsetflow.staged_parts
                            WHERE batch_id = %s AND kind = 'rows' AND rows_staged > 0""",
                        (batch.batch_id,))
            found = cur.fetchall()
            if not all(exists for _p, _s, exists in found):
                return None
            order = segments(split_ranges(batch.ranges, batch.split_offsets),
                             {int(part): subranges for part, subranges, _e in found})
            if not order:  # no rows staged, or no such order: the sorted read
                return None
            # a scan another backend runs at once could make this one start mid-table
            cur.execute("SET LOCAL synchronize_seqscans = off")
            return order
        finally:
            self._phase("kafka_order_s", t)

    def _produce_stage(self, cur: psycopg2.extensions.cursor, batch: Batch, topic: str,
                       partitions: int, limit: int, largest: int,
                       bounds: tuple[int, int] | None,
                       refused: dict[tuple[str, int, int], NotProduced]
                       ) -> tuple[int, list[NotProduced]]:
        """One transaction's records: the stage in source order, produced (not flushed);
        what the topic can never take is left out, checked before producing (the size
        limit, a keyless record for a compacted topic, a timestamp outside `bounds` when
        some are) or refused by the broker in an earlier pass (`refused`). Read from the
        parts unsorted (`_unsorted`) when set; a record out of source order there raises
        `_OutOfOrder`, and `_write` ends that pass as any aborted one (the transaction
        aborted, the records the broker refused in it kept, a new producer: neither the
        purged records' reports nor a sequence number the refused ones spent reach the
        next pass) and the next passes read the stage sorted."""
        ps = self._begin_pass(batch, bounds)
        query = self.records(cur, batch, self._unsorted)
        self._produce_rows(cur, batch, topic, partitions, limit, largest, ps, query, refused)
        return ps.produced, ps.skipped

    def _begin_pass(self, batch: Batch, bounds: tuple[int, int] | None) -> _Pass:
        """A pass's transaction begun, its delivery reports reset."""
        p = self._producer
        assert p is not None
        self._failed = []
        try:
            p.begin_transaction()
        except KafkaException as e:  # a newer run fenced this one after the last pass
            raise KafkaSinkError(f"batch {batch.batch_id}: begin_transaction failed "
                                 f"({e.args[0].str()}); nothing of this run is visible, the "
                                 f"next run produces the batch") from e
        self._open_txn = True
        self._txn_batch = batch
        self._txn_began = time.monotonic()
        return _Pass(bounds, int(time.time() * 1000))

    def _file_entries(self, cur: psycopg2.extensions.cursor, batch: Batch,
                      parts: set[int] | None) -> dict[int, dict[str, Any]]:
        """The task file each of `parts`' markers names (None: every part's): empty when
        the batch's tasks wrote the stage."""
        requested = parts
        # the markers a task committed while this transaction reads: a cursor of its own
        # (`cur` is the ledger's, its snapshot may predate them)
        with contextlib.closing(psycopg2.connect(self.dsn)) if self.dsn else (
                contextlib.nullcontext(cur.connection)) as conn, conn.cursor() as c:
            found = {part: named[0] for part, named in task_file_entries(
                c, batch.batch_id, None if parts is None else sorted(parts)).items()}
            if parts is None and found:  # every part of the batch must name its file
                c.execute("""SELECT array_agg(part) FROM offsetflow.staged_parts
                              WHERE batch_id = %s AND kind = 'rows'""", (batch.batch_id,))
                row = c.fetchone()
                parts = set(row[0] or []) if row else set()
        if found and parts is not None and set(found) != parts:
            # staged before `sink.task_files` was set (a run that failed mid-read): refused
            # as lost parts, so the commit drops those with their markers and the next run
            # writes them to task files (a `KafkaSinkError` here was refused on every run)
            staged = sorted(parts - set(found))
            raise StagedRowsLostError(
                batch.batch_id, staged,
                f"parts {staged} were staged in PostgreSQL (before sink.task_files was set) "
                f"but parts {sorted(found)} were written to task files in "
                f"{self.files_dir}; a batch is produced from "
                f"one or the other, so the stage parts are dropped and the next run writes "
                f"them to task files")
        if found:  # every file there, or every lost one named at once (not one per run)
            try:
                taskfile.check_present(batch.batch_id, found,
                                       str(self.files_dir))
            except TaskFileLostError:
                if requested is not None:
                    self._file_entries(cur, batch, None)  # the batch's every staged part
                raise
        return found

    def _produce_rows(self, cur: psycopg2.extensions.cursor, batch: Batch, topic: str,
                      partitions: int, limit: int, largest: int, ps: _Pass,
                      query: sql.Composable | FileParts,
                      refused: dict[tuple[str, int, int], NotProduced],
                      deadline: float | None = None) -> None:
        """The records of `query` (stage rows in source order) into pass `ps`'s transaction:
        `_produce_stage`'s loop, for the whole stage or some of its segments. Past
        `deadline` (monotonic) the pass is aborted (`PassAborted`) before its next fetch."""
        p = self._producer
        assert p is not None
        near = limit - NEAR_LIMIT_BYTES
        compacted = self.settings.compacted
        check_ts = ps.bounds is not None
        lo, hi = ps.bounds or (0, 0)
        skipped = ps.skipped
        by_source = self.sink.partitioning == "source"
        produced = 0
        # a JSON value arrives as text (no hex bytea on the wire, no copy; librdkafka
        # encodes it as UTF-8): up to 4 bytes a character until counted exactly. An Avro
        # value arrives as that JSON text too and leaves `encode` as bytes
        text_value = self.sink.value_format != "raw"
        vmul = 4 if self.sink.value_format == "json" else 1
        encode = None if self.encoder is None else self.encoder.encode
        batch_header: tuple[str, bytes | str | None] = (BATCH_HEADER,
                                                        str(batch.batch_id).encode())
        produce, fromhex = p.produce, bytes.fromhex
        hex_keys = not isinstance(query, FileParts)  # a task file's keys are bytes
        began = time.monotonic()
        waited = 0.0  # for the stage's rows (PostgreSQL building them)
        # source order per topic/partition, checked record by record: the last offset of
        # the current run of one partition, and of every partition met before (in this
        # pass's earlier queries too)
        last = ps.last
        run_topic, run_part, run_off = "", -1, -1
        out_part, source_of = -1, ""  # the current run's output partition, header prefix
        with contextlib.closing(self.chunks(
                cur, batch, query, "offsetflow_sink_kafka",
                rows_per_fetch(largest, FETCH_BYTES, CURSOR_ROWS))) as fetches:
            chunks = iter(fetches)
            while True:
                w = time.monotonic()
                chunk = next(chunks, None)
                waited += time.monotonic() - w
                if chunk is None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    why = (f"its transaction passed {REMAINDER_SHARE:.0%} of "
                           f"transaction.timeout.ms while producing what the read left")
                    raise PassAborted(f"batch {batch.batch_id}: {why}", why)
                for s_topic, s_part, s_off, key, value, hdrs, ts in chunk:
                    if s_part != run_part or s_topic != run_topic:
                        last[(run_topic, run_part)] = run_off
                        run_topic, run_part = s_topic, s_part
                        run_off = last.get((s_topic, s_part), -1)
                        # what is the same for every record of this run of one partition
                        if by_source and s_part >= partitions:
                            raise KafkaSinkError(
                                f"batch {batch.batch_id}: sink.partitioning: source puts "
                                f"{s_topic}[{s_part}] into partition {s_part} of {topic}, "
                                f"which has {partitions} partitions; add partitions to "
                                f"{topic} or use partitioning: key")
                        out_part = s_part if by_source else -1
                        source_of = f"{s_topic}/{s_part}/"
                    if s_off < run_off:  # equal: rows a transform made of one record
                        raise _OutOfOrder(f"the stage gave {s_topic}/{s_part}/{s_off} after "
                                          f"offset {run_off} of that partition")
                    run_off = s_off
                    if refused and (s_topic, s_part, s_off) in refused:
                        skipped.append(refused[(s_topic, s_part, s_off)])
                        continue
                    if key is not None and hex_keys:
                        key = fromhex(key)  # `record_key`, inlined
                    if value is not None and not text_value:
                        value = bytes(value)
                    elif value is not None and encode is not None:
                        try:
                            value = encode(value)
                        except ValueDoesNotFit as e:
                            skipped.append(self._not_produced(batch, topic, limit, NotProduced(
                                s_topic, s_part, s_off, None, reason=self._unfit(e))))
                            continue
                    headers: list[tuple[str, bytes | str | None]] = (
                        [batch_header, (SOURCE_HEADER, source_of + str(s_off))]
                               if hdrs is None else
                               record_headers(batch.batch_id, s_topic, s_part, s_off, hdrs))
                    size = (0 if key is None else len(key)) + (
                        0 if value is None else vmul * len(value))
                    try:
                        if (key is None and compacted) or (
                                size > near and record_size(key, value, headers) > limit) or (
                                check_ts and ts and not lo <= ts <= hi):
                            raise _NotProducible
                        # positional (callback, on_delivery: the producer's): parsing
                        # keywords costs more than the rest of the call's arguments
                        produce(topic, value, key, out_part, None, None, ts or 0, headers)
                    except BufferError:  # the local queue is full: let deliveries drain it
                        if not self._produce(p, topic, key, value, headers, out_part,
                                             ts or 0):
                            skipped.append(self._not_produced(batch, topic, limit, NotProduced(
                                s_topic, s_part, s_off, record_size(key, value, headers))))
                            continue
                    except (_NotProducible, KafkaException) as e:
                        if isinstance(e, KafkaException) and \
                                e.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                            abortable_produce(e)
                            raise
                        skipped.append(self._not_produced(batch, topic, limit, NotProduced(
                            s_topic, s_part, s_off,
                            None if key is None and compacted else record_size(
                                key, value, headers),
                            ts if check_ts and ts and not lo <= ts <= hi else None)))
                        continue
                    produced += 1
        last[(run_topic, run_part)] = run_off
        ps.produced += produced
        self.phases["kafka_read_wait_s"] = round(
            self.phases.get("kafka_read_wait_s", 0.0) + waited, 3)
        self._phase("kafka_produce_s", began)

    def _flush(self) -> None:
        """Wait for the pass's records to be delivered, but not once one failed: the
        transaction must then be aborted, and the records queued after it wait for nothing
        (flush would sit out its whole timeout)."""
        p = self._producer
        assert p is not None
        deadline = time.monotonic() + self.timeout_s
        while p.flush(min(1.0, max(0.0, deadline - time.monotonic()))) and not self._failed \
                and time.monotonic() < deadline:
            continue

    def _refused_by_broker(self, cur: psycopg2.extensions.cursor, batch: Batch, topic: str,
                           largest: int, began_ms: int) -> list[NotProduced]:
        """After a pass whose records the broker refused (the transaction is aborted): the
        source records refused for themselves, which the next pass leaves out; when there
        is none, the error naming the record and the setting (`refusal_error`)."""
        failed = primary(self._failed)
        if not failed:  # only purged: an error of the transaction itself, reported before
            raise KafkaSinkError(f"batch {batch.batch_id}: producing to {topic} failed "
                                 f"({self._failed[0].reason}); "
                                 f"{self._timed_out() or 'the transaction was aborted'}")
        src = self.records(cur, batch, ordered=False)
        with contextlib.closing(self.chunks(cur, batch, src, "offsetflow_sink_kafka_refused",
                                            rows_per_fetch(largest, 16 * 2**20, 5_000))
                                ) as chunks:
            found = find_sources(chunks, batch, self.sink, failed,
                                 None if self.encoder is None else self.encoder.encode,
                                 hex_keys=not isinstance(src, FileParts))
        now = int(time.time() * 1000)
        # the broker checked each timestamp at some point of the pass, on its clock
        bounds = self.settings.timestamp_bounds(
            now, TIMESTAMP_MARGIN_MS + max(0, now - began_ms))
        culprits = judge(found, self.settings, self.batch_bytes, bounds)
        if culprits:
            return culprits
        timed_out = self._timed_out()
        raise KafkaSinkError(timed_out and f"batch {batch.batch_id}: {timed_out}" or
                             refusal_error(batch, topic, failed, found, self.settings,
                                           self.batch_bytes))

    # --- records the output topic cannot take -----------------------------------------

    def _unfit(self, e: ValueDoesNotFit) -> str:
        assert self.encoder is not None
        return (f"the value does not fit the Avro schema (sink.value_format: avro, schema "
                f"id {self.encoder.schema_id}): {e}")

    def _not_produced(self, batch: Batch, topic: str, limit: int,
                      rec: NotProduced) -> NotProduced:
        """A record that can never be produced: kept for the dead-letter table, or, without
        one, the batch fails here naming it (nothing of the transaction becomes visible)."""
        if self.cfg.bad_records == "dead_letter" and self.cfg.dead_letter_table:
            log.warning("batch %d: %s/%d/%d goes to the dead-letter table: %s",
                        batch.batch_id, rec.topic, rec.partition, rec.offset,
                        rec.error(topic, limit))
            return rec
        raise KafkaSinkError(
            f"batch {batch.batch_id}: the record {rec.topic}/{rec.partition}/{rec.offset} can "
            f"never be produced ({rec.error(topic, limit)}); the transaction was aborted. "
            f"Set bad_records: dead_letter to route such records to the dead-letter table, "
            f"or raise the limits")


@dataclass
class FileParts:
    """A batch's records read from its parts' task files (`KafkaTopicSink.records`): the
    parts in the order given, each filtered to its sub-range when one is given; rows as the
    stage query gives them but the key as bytes. `ordered`: the whole batch sorted into
    source order (the sorted read: its sort index held, its records read from the files)."""

    batch_id: int
    parts: list[tuple[int, OffsetRange | None]]
    entries: dict[int, dict[str, Any]]
    ordered: bool = False

    def batches(self) -> Iterator[pa.RecordBatch]:
        for part, r in self.parts:
            for rb in taskfile.read_part_file(self.batch_id, part, self.entries[part]):
                if r is not None:
                    off = rb.column("offset")
                    rb = rb.filter(pc.and_(
                        pc.and_(pc.equal(rb.column("topic"), r.topic),
                                pc.equal(rb.column("partition"), r.partition)),
                        pc.and_(pc.greater_equal(off, r.from_offset),
                                pc.less(off, r.until_offset))))
                yield rb

    def chunks(self) -> Generator[list[tuple[Any, ...]], None, None]:
        if not self.ordered:
            for rb in self.batches():
                yield _rows(rb)
            return
        yield from self._sorted_chunks()

    def _sorted_chunks(self) -> Iterator[list[tuple[Any, ...]]]:
        """The whole batch in source order (the sorted read takes no sub-range), in bounded
        memory (review finding 1: a sort of the whole batch held it all in the driver).
        Sorted by its keys alone (topic, partition, offset: a stable sort, so equal keys
        keep the order of parts and files), 8 bytes a record; then CURSOR_ROWS records at
        a time, each taken from its own record batch, which stays in its mapped file.
        Never a `take` from a table of many record batches (a task writes one per write):
        Arrow's take on chunked string or binary columns concatenates every chunk of them
        per call (apache/arrow#39565), a whole part copied for a few hundred records."""
        batches = [rb for part, _r in self.parts
                   for rb in taskfile.read_part_file(self.batch_id, part, self.entries[part],
                                                   mapped=True)
                   if rb.num_rows]
        if not batches:
            return
        keys = pa.Table.from_batches([rb.select(["topic", "partition", "offset"])
                                      for rb in batches])  # mapped, no copy
        order = pc.sort_indices(keys, sort_keys=[("topic", "ascending"),
                                                 ("partition", "ascending"),
                                                 ("offset", "ascending")])
        order = order.to_numpy().astype(np.int64)
        del keys
        starts = np.cumsum([0] + [rb.num_rows for rb in batches[:-1]])
        for i in range(0, len(order), CURSOR_ROWS):
            window = order[i:i + CURSOR_ROWS]
            which = np.searchsorted(starts, window, side="right") - 1  # its record batch
            by = np.argsort(which, kind="stable")  # the window grouped by record batch
            taken: list[tuple[Any, ...]] = []
            for group in np.split(by, np.flatnonzero(np.diff(which[by])) + 1):
                b = int(which[group[0]])
                taken.extend(_rows(batches[b].take(pa.array(window[group] - starts[b]))))
            out: list[tuple[Any, ...]] = [()] * len(window)
            for pos, row in zip(by.tolist(), taken, strict=True):
                out[pos] = row
            yield out

    def extent(self) -> tuple[int, int | None, int | None]:
        """As `stage_extent_sql`: the largest record's key, value and headers bytes (plus
        the fixed columns), the earliest and latest timestamp."""
        largest, lo, hi = 0, None, None
        for rb in self.batches():
            if not rb.num_rows:
                continue
            largest = max(largest, int(pc.max(taskfile.record_bytes(rb)).as_py() or 0))
            t_lo, t_hi = pc.min_max(rb.column("ts")).values()
            if t_lo.is_valid:
                lo = t_lo.as_py() if lo is None else min(lo, t_lo.as_py())
                hi = t_hi.as_py() if hi is None else max(hi, t_hi.as_py())
        return largest + FILE_FIXED_BYTES, lo, hi

    def rows_at(self, coords: set[tuple[str, int, int]]
                ) -> dict[tuple[str, int, int], tuple[bytes | None, bytes | None, int | None]]:
        """The key, value and timestamp of the records at `coords`."""
        out = {}
        for chunk in self.chunks():
            for s_topic, s_part, s_off, key, value, _h, ts in chunk:
                if (s_topic, s_part, s_off) in coords:
                    out[(s_topic, s_part, s_off)] = (key, value, ts)
        return out


def _rows(rb: pa.RecordBatch) -> list[tuple[Any, ...]]:
    """A task file's records as the stage query's rows (headers parsed, key as bytes)."""
    cols = [rb.column(i).to_pylist() for i in range(rb.num_columns)]
    hdrs = cols[5]
    if any(h is not None for h in hdrs):
        cols[5] = [None if h is None else json.loads(h) for h in hdrs]
    return list(zip(*cols, strict=True))


@dataclass
class _Pass:
    """One transaction's records so far: `_produce_rows` adds to it query by query."""

    bounds: tuple[int, int] | None  # the timestamps the topic takes, when checked
    began_ms: int
    produced: int = 0
    skipped: list[NotProduced] = field(default_factory=list)
    last: dict[tuple[str, int], int] = field(default_factory=dict)  # offset per partition
    error: BaseException | None = None  # how it failed while the read went on


@dataclass
class _Overlap:
    """The part-wise overlap of one commit attempt (`KafkaTopicSink.begin_parts`)."""

    topic: str
    plan: list[Segment]  # the stage's segments in source order, as the layout says
    md: Any  # the output topic's metadata
    limit: int  # the record limit
    staged: set[int] = field(default_factory=set)  # parts whose markers were seen
    done: set[int] = field(default_factory=set)  # indices into `plan`, produced
    measured: set[int] = field(default_factory=set)  # parts whose largest row is known
    largest: int = 1
    pass_: _Pass | None = None  # begun with the first record
    stopped: str = ""  # why nothing more is produced during the read
    settings_changed: bool = False  # the topic's, between the first record and the read's end


class _PassFailed(Exception):
    """The overlap's pass had a record not delivered: `_write` ends it as a failed pass."""


class _NotProducible(Exception):
    """A record the output topic can never take (checked before `produce`)."""


class _OutOfOrder(Exception):
    """The unsorted read of the stage parts gave a record before an earlier offset of its
    partition: `KafkaTopicSink._write` aborts that pass and reads the stage sorted."""


def committed_offsets(batch: Batch, group: str, found: Sequence[KTopicPartition]
                      ) -> dict[tuple[str, int], tuple[int, str | None]]:
    """`Consumer.committed()`'s answer as offsets and metadata; a partition returned with
    an error (its offset then reads as none) is refused."""
    for tp in found:
        if tp.error is not None:
            raise KafkaSinkError(f"batch {batch.batch_id}: cannot read the committed offset of "
                                 f"{tp.topic}[{tp.partition}] in group {group}: "
                                 f"{tp.error.str()}; nothing is produced until it can be read")
    return {(tp.topic, tp.partition): (tp.offset, tp.metadata) for tp in found}


def _known_commits(cur: psycopg2.extensions.cursor, batch: Batch,
                   found: dict[tuple[str, int], tuple[int, str | None]]
                   ) -> set[tuple[int, str, int, int]]:
    """This ledger's committed ranges (batch id, topic, partition, until_offset) of the
    batches the group's offsets name: what `refuse_group_ahead` accepts above a from_offset."""
    ids = [i for i in commit_batch_ids(found) if i != batch.batch_id]
    if not ids:
        return set()
    cur.execute("""SELECT r.batch_id, r.topic, r.partition, r.until_offset
                     FROM offsetflow.batch_ranges r JOIN offsetflow.batches b USING (batch_id)
                    WHERE b.status = 'committed' AND b.pipeline = %s
                      AND r.batch_id = ANY(%s)""", (batch.pipeline, ids))
    return {(int(b), str(t), int(p), int(u)) for b, t, p, u in cur.fetchall()}


def _moved_from_record(batch: Batch, records: dict[str, int] | None,
                       skipped: Sequence[NotProduced]) -> Moved:
    """Step 4's counts of a batch whose stage is gone, from its commit's record: the
    staged records per range, less those the topic did not take."""
    if records is None:  # committed by a release that did not record them
        log.warning("batch %d: its Kafka commit records no counts (an older release made "
                    "it); the ledger counts its rows as 0", batch.batch_id)
        return Moved(rows=0, dead=len(skipped))
    return Moved(rows=sum(records.values()) - len(skipped), dead=len(skipped),
                 per_range=records)


def _fault_point(name: str) -> None:
    """A test-only fault (FAULT_ENV); not on the per-record path."""
    if os.environ.get(FAULT_ENV) != name:
        return
    if name == "kill_after_commit":
        log.warning("test fault: SIGKILL after the Kafka commit, before the ledger's")
        os.killpg(os.getpgid(0), signal.SIGKILL)
    paused, resume = os.environ.get(PAUSED_ENV), os.environ.get(RESUME_ENV)
    if paused:
        Path(paused).write_text(str(os.getpid()))
    deadline = time.monotonic() + 600
    while resume and not Path(resume).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
