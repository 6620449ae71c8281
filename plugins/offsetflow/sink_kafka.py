"""The Kafka topic sink: step 4 of the commit protocol (`offsetflow.commit_spec.ExternalSink`)
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
    commit are visible together or not at all; the ledger's COMMIT follows.
Which names, which topic and how a row becomes a record: `offsetflow.sink_kafka_form`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg2.extensions
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as KTopicPartition

from offsetflow.commit_rows import move_stage_dead_letters
from offsetflow.commit_spec import CommitSpec, Moved
from offsetflow.config_schema import KafkaSinkConfig, PipelineConfig
from offsetflow.errors import KafkaSinkError, StagedRowsLostError
from offsetflow.ledger import Batch, stage_table
from offsetflow.ledger_identity import LedgerIdentity, ledger_identity
from offsetflow.sink_kafka_form import (
    BATCH_HEADER,
    METADATA_MAX_BYTES,
    SOURCE_HEADER,
    CommitMark,
    NotProduced,
    check_columns,
    commit_batch_ids,
    committed_state,
    not_produced_in,
    output_topic,
    record_headers,
    record_size,
    records_in,
    refuse_group_ahead,
    row_bytes_sql,
    rows_per_fetch,
    select_sql,
)
from offsetflow.sink_kafka_limits import (
    broker_txn_timeout_ms,
    route_not_produced,
    topic_limits,
)
from offsetflow.sink_kafka_stage import prefetched
from offsetflow.staged_parts import _staged_per_range

log = logging.getLogger(__name__)

# test-only fault points (tests/integration/test_sink_kafka*.py), looked up once per batch:
# pause_before_commit (records produced and flushed, transaction open; waits for the RESUME
# file, after writing the PAUSED file) | kill_after_commit (SIGKILL of the process group
# right after the Kafka commit, before the ledger's)
FAULT_ENV = "OFFSETFLOW_TEST_SINK_KAFKA_FAULT"
PAUSED_ENV = "OFFSETFLOW_TEST_SINK_KAFKA_PAUSED"
RESUME_ENV = "OFFSETFLOW_TEST_SINK_KAFKA_RESUME"

KAFKA_TIMEOUT_S = 60.0
CURSOR_ROWS = 5_000
# driver memory for one fetch of staged rows (large records: fewer rows per fetch; up to
# four fetches at once: one produced, two read ahead, one being read) and, unless
# sink.producer sets queue.buffering.max.kbytes, for librdkafka's queue (its default of 1 GB
# would let large records pile up in the driver)
FETCH_BYTES = 16 * 2**20
QUEUE_KBYTES = 65_536
UNKNOWN_OUTCOME = ("the outcome is unknown (the broker may have committed the transaction "
                   "before the error); the next run finds the batch committed in Kafka and "
                   "completes the ledger, or writes it again if it is not")
# a row whose key and value alone are this far below the record limit needs no exact size
NEAR_LIMIT_BYTES = 65_536


class KafkaTopicSink:
    """`ExternalSink` for `sink.type: kafka`. One instance serves one commit attempt."""

    def __init__(self, cfg: PipelineConfig, columns: Sequence[tuple[str, str]] | None,
                 spec: CommitSpec, timeout_s: float = KAFKA_TIMEOUT_S) -> None:
        """`columns`: the stage's (None: only `find`, which reads no rows)."""
        assert cfg.sink.kafka is not None
        self.cfg = cfg
        self.sink: KafkaSinkConfig = cfg.sink.kafka
        self.columns = dict(columns or ())
        if columns is not None:
            check_columns(self.sink, self.columns, cfg.source_file)
        self.spec = spec  # its dead-letter settings: the tasks' bad records go there
        self.timeout_s = timeout_s
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._txn_id = ""
        self._delivery_error: str | None = None
        self._open_txn = False  # begun, neither committed nor aborted by this run
        self._txn_began = 0.0  # time.monotonic() at begin_transaction
        self._txn_timeout_ms = 0
        self._mark = CommitMark(cfg.name, None, None)  # set from the ledger by find/write
        # the group's offsets `find` read when the batch was not there (`write` checks them)
        self._unfound: dict[tuple[str, int], tuple[int, str | None]] | None = None
        self.stage_gone = False  # see `completing`

    # --- ExternalSink ---------------------------------------------------------------

    def completing(self) -> None:
        """`offsetflow complete`: the stage is lost; `find` takes the counts and the
        left-out records from the commit's offset metadata alone."""
        self.stage_gone = True

    def find(self, cur: psycopg2.extensions.cursor, batch: Batch) -> Moved | None:
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
        route_not_produced(cur, self.cfg, self.columns, batch, skipped, topic, None,
                           stage_gone=self.stage_gone)
        if self.stage_gone:
            return _moved_from_record(batch, records_in(batch, mark, state), skipped)
        moved = Moved(rows=_staged_rows(cur, batch.batch_id) - len(skipped), dead=len(skipped))
        move_stage_dead_letters(cur, batch, self.spec, moved)
        return moved

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
                _fence(self.cfg, mark.transactional_id(batch), self.timeout_s)
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
            # not in `find`: abandoning a batch the sink does not hold stays possible
            state = (self._unfound if self._unfound is not None
                     else self._committed(batch, self._mark))
            refuse_group_ahead(batch, self._mark, state, _known_commits(cur, batch, state))
            return self._write(cur, batch, staged, topic)
        except BaseException:
            if self._open_txn:  # not left open: it would hold back read_committed readers
                self._abort(batch)
            raise
        finally:
            self.close()

    # --- the transaction --------------------------------------------------------------

    def _open(self, batch: Batch) -> None:
        """Producer and group consumer; `init_transactions` fences every older attempt."""
        base = self.cfg.admin_settings()
        self._txn_id = self._mark.transactional_id(batch)
        if not self._txn_timeout_ms:
            self._txn_timeout_ms = (int(self.sink.producer["transaction.timeout.ms"])
                                    if "transaction.timeout.ms" in self.sink.producer
                                    else broker_txn_timeout_ms(self.cfg, batch, self.timeout_s))
        conf: dict[str, Any] = {
            **base, "transactional.id": self._txn_id, "enable.idempotence": True,
            "linger.ms": 20, "partitioner": "murmur2_random",
            "delivery.report.only.error": True, "queue.buffering.max.kbytes": QUEUE_KBYTES,
            "on_delivery": self._on_delivery, **self.sink.producer,
            "transaction.timeout.ms": self._txn_timeout_ms}
        self._producer = Producer(conf)
        self._consumer = Consumer({**base, "group.id": self._mark.group(batch),
                                   "enable.auto.commit": False,
                                   "isolation.level": "read_committed"})
        try:
            self._producer.init_transactions(self.timeout_s)
        except KafkaException as e:
            self.close()
            raise KafkaSinkError(f"batch {batch.batch_id}: init_transactions of "
                                 f"transactional.id {self._txn_id} failed: {e}") from e

    def _timed_out(self) -> str | None:
        """Why a fence is not a newer run: the transaction is older than its timeout, after
        which the broker aborts it and bumps the epoch (the producer then reports a fence).
        The broker's clock starts after begin_transaction, so a younger one was not it."""
        if not self._txn_began:
            return None
        open_s = time.monotonic() - self._txn_began
        if open_s * 1000 < self._txn_timeout_ms:
            return None
        return (f"the transaction was open {open_s:.0f} s, longer than its "
                f"transaction.timeout.ms of {self._txn_timeout_ms} ms, so the broker aborted "
                f"it; nothing of it is visible. Every attempt of a batch this large takes as "
                f"long: make batches smaller (source.max_records_per_batch) or raise "
                f"sink.producer.transaction.timeout.ms (at most the broker's "
                f"transaction.max.timeout.ms)")

    def _on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None and self._delivery_error is None:
            src = dict(msg.headers() or []).get("offsetflow.source", b"?").decode()
            self._delivery_error = f"record of source {src}: {err.str()}"

    def _write(self, cur: psycopg2.extensions.cursor, batch: Batch, staged: int,
               topic: str) -> Moved:
        p = self._producer
        assert p is not None and self._consumer is not None
        partitions = self._partitions(batch, topic)
        limit, compacted = topic_limits(self.cfg, batch, topic, self.timeout_s)
        near = limit - NEAR_LIMIT_BYTES
        skipped: list[NotProduced] = []
        by_source = self.sink.partitioning == "source"
        p.begin_transaction()
        self._open_txn = True
        self._txn_began = time.monotonic()
        produced = 0
        stage = stage_table(batch.batch_id)
        cur.execute(row_bytes_sql(self.columns, stage))
        largest = int(cur.fetchone()[0])  # type: ignore[index]
        cur.execute("SET LOCAL TimeZone = 'UTC'")  # JSON timestamps the same every run
        # a JSON value arrives as text (no hex bytea on the wire, no copy; librdkafka
        # encodes it as UTF-8): up to 4 bytes a character until counted exactly
        text_value = self.sink.value_format == "json"
        vmul = 4 if text_value else 1
        batch_header: tuple[str, bytes | str | None] = (BATCH_HEADER,
                                                        str(batch.batch_id).encode())
        produce = p.produce
        with contextlib.closing(prefetched(
                cur.connection, f"offsetflow_sink_kafka_{batch.batch_id}",
                select_sql(self.sink, self.columns, stage),
                rows_per_fetch(largest, FETCH_BYTES, CURSOR_ROWS))) as chunks:
            for chunk in chunks:
                for s_topic, s_part, s_off, key, value, hdrs, ts in chunk:
                    if by_source and s_part >= partitions:
                        raise KafkaSinkError(
                            f"batch {batch.batch_id}: sink.partitioning: source puts "
                            f"{s_topic}[{s_part}] into partition {s_part} of {topic}, which "
                            f"has {partitions} partitions; add partitions to {topic} or use "
                            f"partitioning: key")
                    if key is not None:
                        key = bytes(key)
                    if value is not None and not text_value:
                        value = bytes(value)
                    headers: list[tuple[str, bytes | str | None]] = (
                        [batch_header, (SOURCE_HEADER, f"{s_topic}/{s_part}/{s_off}")]
                               if hdrs is None else
                               record_headers(batch.batch_id, s_topic, s_part, s_off, hdrs))
                    size = (0 if key is None else len(key)) + (
                        0 if value is None else vmul * len(value))
                    try:
                        if (key is None and compacted) or (
                                size > near and record_size(key, value, headers) > limit):
                            raise _NotProducible
                        produce(topic, value, key, s_part if by_source else -1,
                                timestamp=ts or 0, headers=headers)
                    except BufferError:  # the local queue is full: let deliveries drain it
                        if not self._produce(p, topic, key, value, headers,
                                             s_part if by_source else -1, ts or 0):
                            skipped.append(self._not_produced(batch, topic, limit, NotProduced(
                                s_topic, s_part, s_off, record_size(key, value, headers))))
                            continue
                    except (_NotProducible, KafkaException) as e:
                        if isinstance(e, KafkaException) and \
                                e.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                            raise
                        skipped.append(self._not_produced(batch, topic, limit, NotProduced(
                            s_topic, s_part, s_off, None if key is None and compacted
                            else record_size(key, value, headers))))
                        continue
                    produced += 1
        if produced + len(skipped) != staged:
            self._abort(batch)
            raise StagedRowsLostError(batch.batch_id, None,
                                      f"the stage holds {produced + len(skipped)} rows but "
                                      f"its markers count {staged}")
        p.flush(self.timeout_s)
        if self._delivery_error is not None:
            self._abort(batch)
            raise KafkaSinkError(f"batch {batch.batch_id}: producing to {topic} failed "
                                 f"({self._delivery_error}); "
                                 f"{self._timed_out() or 'the transaction was aborted'}")
        self._send_offsets(batch, skipped, _staged_per_range(cur, batch.batch_id))
        _fault_point("pause_before_commit")
        self._commit(batch, topic, produced)
        self._open_txn = False
        _fault_point("kill_after_commit")
        route_not_produced(cur, self.cfg, self.columns, batch, skipped, topic, limit)
        moved = Moved(rows=produced, dead=len(skipped))
        move_stage_dead_letters(cur, batch, self.spec, moved)
        return moved

    @staticmethod
    def _produce(p: Producer, topic: str, key: bytes | None, value: Any,
                 headers: Any, partition: int, timestamp: int) -> bool:
        """Produce once the local queue has room. False: librdkafka refused the record as
        too large (a size check it makes that `record_size` did not foresee); any other
        error is raised."""
        while True:
            p.poll(0.005)
            try:
                p.produce(topic, value, key, partition, timestamp=timestamp, headers=headers)
                return True
            except BufferError:
                continue
            except KafkaException as e:
                if e.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    return False
                raise

    # --- records the output topic cannot take -----------------------------------------

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

    def _partitions(self, batch: Batch, topic: str) -> int:
        assert self._producer is not None
        try:
            md = self._producer.list_topics(topic, timeout=self.timeout_s)
        except KafkaException as e:
            raise KafkaSinkError(f"batch {batch.batch_id}: no metadata for output topic "
                                 f"{topic}: {e}") from e
        t = md.topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            why = t.error.str() if t is not None and t.error is not None else "not found"
            raise KafkaSinkError(f"batch {batch.batch_id}: output topic {topic} is not "
                                 f"usable ({why}); create it before running the pipeline")
        return len(t.partitions)

    def _send_offsets(self, batch: Batch, skipped: Sequence[NotProduced],
                      per_range: dict[str, int]) -> None:
        assert self._producer is not None and self._consumer is not None
        offsets = []
        for r in batch.ranges:
            if r.until_offset <= r.from_offset:
                continue
            left_out = [s for s in skipped if (s.topic, s.partition) == r.topic_partition]
            meta = self._mark.metadata(batch.batch_id, left_out,
                                       per_range.get(f"{r.topic}/{r.partition}", 0))
            if len(meta.encode()) > METADATA_MAX_BYTES:
                raise KafkaSinkError(
                    f"batch {batch.batch_id}: {len(left_out)} records of {r.topic}"
                    f"[{r.partition}] cannot be produced (first: offset {left_out[0].offset}:"
                    f" {left_out[0].error(self.sink.topic, None)}): too many to record in "
                    f"the commit; raise the limits, or make batches smaller")
            offsets.append(KTopicPartition(r.topic, r.partition, r.until_offset,
                                           metadata=meta))
        if not offsets:
            return
        group = self._consumer.consumer_group_metadata()
        self._retry(batch, "send_offsets_to_transaction",
                    lambda t: self._producer.send_offsets_to_transaction(  # type: ignore[union-attr]
                        offsets, group, t))

    def _commit(self, batch: Batch, topic: str, produced: int) -> None:
        assert self._producer is not None
        t = time.monotonic()
        self._retry(batch, "commit_transaction",
                    lambda left: self._producer.commit_transaction(left))  # type: ignore[union-attr]
        log.info("batch %d: Kafka transaction committed: %d records to %s "
                 "(transactional.id %s, %.1fs)", batch.batch_id, produced, topic,
                 self._txn_id, time.monotonic() - t)

    def _retry(self, batch: Batch, what: str, call: Any) -> None:
        """Retry a retriable error until the timeout (a broker restarting); an abortable one
        aborts; a fenced or fatal one leaves the outcome to the broker: the next run's
        `init_transactions` completes or aborts it and `find` tells which."""
        deadline = time.monotonic() + 3 * self.timeout_s
        while True:
            try:
                call(max(1.0, deadline - time.monotonic()))
                return
            except KafkaException as e:
                err: KafkaError = e.args[0]
                if err.retriable() and time.monotonic() < deadline:
                    log.warning("batch %d: %s: %s; retrying", batch.batch_id, what, err.str())
                    time.sleep(0.5)
                    continue
                if err.txn_requires_abort():
                    self._abort(batch)
                    # librdkafka also reports an EndTxn(commit) that failed after the
                    # transaction had failed as abortable, yet the commit may have landed
                    aborted = (UNKNOWN_OUTCOME if what == "commit_transaction" else
                               "the transaction was aborted, nothing of it is visible")
                    raise KafkaSinkError(f"batch {batch.batch_id}: {what} failed "
                                         f"({err.str()}); {self._timed_out() or aborted}"
                                         ) from e
                fenced = err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                        KafkaError.INVALID_PRODUCER_EPOCH)
                timed_out = self._timed_out() if fenced else None
                why = timed_out or (f"this run was fenced: a newer run of the batch took over "
                       f"transactional.id {self._txn_id} (its producer epoch is higher), so "
                       f"nothing this run produced becomes visible" if fenced else
                       UNKNOWN_OUTCOME)
                raise KafkaSinkError(f"batch {batch.batch_id}: {what} failed ({err.str()}); "
                                     f"{why}") from e

    def _abort(self, batch: Batch) -> None:
        assert self._producer is not None
        self._open_txn = False
        try:
            self._producer.abort_transaction(self.timeout_s)
        except KafkaException as e:  # the next run's init_transactions aborts it
            log.warning("batch %d: abort_transaction failed (%s); the next run's "
                        "init_transactions aborts the transaction", batch.batch_id, e)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        # no flush: the transaction is committed or aborted by now, and a fenced producer's
        # flush would raise over the error that says what happened
        self._producer = None


class _NotProducible(Exception):
    """A record the output topic can never take (checked before `produce`)."""


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


def _fence(cfg: PipelineConfig, txn_id: str, timeout_s: float) -> None:
    """`init_transactions` of `txn_id` and nothing else: an older producer of that id can
    neither commit nor add records any more, and its open transaction is completed or
    aborted, so the group's offsets read next are final."""
    p = Producer(fence_settings(cfg, txn_id))
    try:
        p.init_transactions(timeout_s)
    except KafkaException as e:
        raise KafkaSinkError(f"init_transactions of transactional.id {txn_id} failed: {e}"
                             ) from e


# `sink.producer` settings that say how to connect and who the producer is; the fencing
# producer takes only these (it produces nothing: delivery, batching and timeout settings
# could only clash with its own transaction timeout, e.g. delivery.timeout.ms > 60 s)
CONNECTION_PREFIXES = ("security.", "ssl", "sasl.", "enable.ssl.", "client.", "oauthbearer",
                       "broker.address.")


def fence_settings(cfg: PipelineConfig, txn_id: str) -> dict[str, Any]:
    """The fencing producer's settings: the client's, then the connection and identity
    settings of the batch's own producer (`sink.producer`: the credentials a cluster with
    ACLs gives the sink's principal), for another transactional.id."""
    producer = cfg.sink.kafka.producer if cfg.sink.kafka is not None else {}
    own = {k: v for k, v in producer.items() if k.startswith(CONNECTION_PREFIXES)}
    return {**cfg.admin_settings(), **own, "transactional.id": txn_id,
            "enable.idempotence": True}


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


def _staged_rows(cur: psycopg2.extensions.cursor, batch_id: int) -> int:
    cur.execute("""SELECT COALESCE(sum(rows_staged), 0) FROM offsetflow.staged_parts
                    WHERE batch_id = %s AND kind = 'rows'""", (batch_id,))
    row = cur.fetchone()
    return int(row[0]) if row else 0


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
