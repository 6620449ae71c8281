"""The Kafka topic sink's transaction (`offsetflow.sinks.kafka.sink` decides what goes in it): one
producer per commit attempt with the batch's stable `transactional.id`, whose
`init_transactions` fences every older attempt; the batch's until_offsets sent into the
transaction with its records (`send_offsets_to_transaction`, KIP-98); the commit, retried
while the broker's error is retriable, else aborted or left to the broker with what is known
of its outcome. `fence` fences another transactional.id (a batch's commit under the older
names) without producing."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as KTopicPartition
from confluent_kafka.admin import AdminClient

from offsetflow.config import KafkaSinkConfig, PipelineConfig
from offsetflow.errors import KafkaSinkError
from offsetflow.ledger import Batch
from offsetflow.sinks.kafka.form import value_digest
from offsetflow.sinks.kafka.limits import (
    PRODUCER_BATCH_BYTES,
    TopicSettings,
    broker_txn_timeout_ms,
    topic_settings,
)
from offsetflow.sinks.kafka.mark import METADATA_MAX_BYTES, CommitMark, NotProduced

log = logging.getLogger(__name__)

KAFKA_TIMEOUT_S = 60.0
# driver memory for librdkafka's queue, unless sink.producer sets queue.buffering.max.kbytes
# (its default of 1 GB would let large records pile up in the driver)
QUEUE_KBYTES = 65_536
# delivery reports kept for the failure path (each a key, a digest and a few numbers)
MAX_FAILED = 10_000
# reports of messages the producer dropped because the transaction was aborted (by this
# run, or by librdkafka when the transaction became abortable)
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
# how long a batch waits for a partition's in-sync replicas to come back up to the topic's
# min.insync.replicas (a broker restarting) before it fails naming the setting
ISR_WAIT_S = 30.0
# abortable errors that no new transaction of the attempt can escape (a setting of the
# cluster decides them): never one more pass, which would produce the batch again for nothing
NOT_PASSING = {KafkaError.GROUP_AUTHORIZATION_FAILED: "grant the sink's principal (sink."
               "producer) Read on the group named in the error",
               KafkaError.TOPIC_AUTHORIZATION_FAILED: "grant the sink's principal (sink."
               "producer) Write on the output topic",
               KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "grant the sink's "
               "principal (sink.producer) Write on its transactional.id"}
UNKNOWN_OUTCOME = ("the outcome is unknown (the broker may have committed the transaction "
                   "before the error); the next run finds the batch committed in Kafka and "
                   "completes the ledger, or writes it again if it is not")


class KafkaTransaction:
    """The producer side of `offsetflow.sinks.kafka.sink.KafkaTopicSink`: its producer and group
    consumer, and the transaction's steps. One instance serves one commit attempt."""

    def __init__(self, cfg: PipelineConfig, timeout_s: float = KAFKA_TIMEOUT_S) -> None:
        assert cfg.sink.kafka is not None
        self.cfg = cfg
        self.sink: KafkaSinkConfig = cfg.sink.kafka
        self.timeout_s = timeout_s
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._txn_id = ""
        self._failed: list[Failed] = []  # this transaction's delivery errors (`Failed`)
        self.settings = TopicSettings("")  # the output topic's, read by `_open`
        self.batch_bytes = PRODUCER_BATCH_BYTES  # the producer's batch.size, set by `_open`
        self._open_txn = False  # begun, neither committed nor aborted by this run
        self._txn_began = 0.0  # time.monotonic() at begin_transaction
        self._txn_timeout_ms = 0
        self._mark = CommitMark(cfg.name, None, None)  # set from the ledger by find/write

    def _open(self, batch: Batch, same_attempt: bool = False) -> None:
        """Producer and group consumer; `init_transactions` fences every older attempt.
        The producer's batches and codec follow the output topic's settings (`_mark.topic`),
        and it never creates the topic (a broker with auto.create.topics.enable would make
        a deleted output topic again, empty and with its default partitions).
        `same_attempt` (a new producer for the next pass): the settings the attempt read
        stay, as its record limit and timestamp bounds do; read again, a broker that does
        not answer the DescribeConfigs (restarting between passes) would leave the pass
        with none known (batches over the topic's limit, no compaction check)."""
        base = self.cfg.admin_settings()
        self._txn_id = self._mark.transactional_id(batch)
        admin = AdminClient(dict(base))  # type: ignore[arg-type]
        if not self._txn_timeout_ms:
            self._txn_timeout_ms = (int(self.sink.producer["transaction.timeout.ms"])
                                    if "transaction.timeout.ms" in self.sink.producer
                                    else broker_txn_timeout_ms(admin, batch, self.timeout_s))
        if self._mark.topic and not same_attempt:
            self.settings = topic_settings(admin, batch, self._mark.topic, self.timeout_s)
        derived = self.settings.producer_settings(self.sink.producer)
        for k, v in derived.items():
            if k in self.sink.producer and str(self.sink.producer[k]) != str(v):
                log.warning("batch %d: sink.producer.%s is %s, but the output topic %s needs "
                            "%s (%s); using %s", batch.batch_id, k, self.sink.producer[k],
                            self._mark.topic, v, "its compression.type" if k ==
                            "compression.type" else "its max.message.bytes", v)
        conf: dict[str, Any] = {
            **base, "transactional.id": self._txn_id, "enable.idempotence": True,
            "linger.ms": 20, "partitioner": "murmur2_random",
            "delivery.report.only.error": True, "queue.buffering.max.kbytes": QUEUE_KBYTES,
            "on_delivery": self._on_delivery, **self.sink.producer, **derived,
            "allow.auto.create.topics": False,
            "transaction.timeout.ms": self._txn_timeout_ms}
        self.batch_bytes = int(conf.get("batch.size", PRODUCER_BATCH_BYTES))
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

    def _reopen(self, batch: Batch) -> Producer:
        """A new producer (and group consumer) for the next pass of the attempt, after the
        last one's transaction was aborted: its `init_transactions` bumps the epoch, so
        the sequence numbers start again. A record the broker refused spent its sequence
        number; librdkafka bumps the epoch on the abort only when a later request of the
        pass to that partition failed out of order, so without this the next pass's first
        request to it is one past what the broker expects ("skipped sequence numbers")."""
        self.close()
        self._open(batch, same_attempt=True)
        assert self._producer is not None
        return self._producer

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
        """Only errors are reported (delivery.report.only.error). A report carries no
        headers (nor, for a failed message, a timestamp): the failure path finds the source
        record by key and value."""
        if err is None or len(self._failed) >= MAX_FAILED:
            return
        if err.code() in PURGED and self._failed and self._failed[-1].code in PURGED:
            return  # one of a run of purged messages tells it: room for the refused ones
        ts = msg.timestamp()
        self._failed.append(Failed(err.code(), err.str(), msg.partition(), msg.key(),
                                   value_digest(msg.value()), ts[1] if ts else 0))

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
                abortable_produce(e)
                raise

    def _partitions(self, batch: Batch, topic: str) -> Any:
        """The output topic's metadata (its partitions, their leaders and replicas)."""
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
        return t

    def _check_replicas(self, batch: Batch, topic: str, partitions: Sequence[int] | None
                        ) -> Any:
        """Every partition the batch writes (`partitions`; None: any) has the in-sync
        replicas the topic's min.insync.replicas asks for (at most its replication factor:
        the broker asks no more), else the broker refuses each write with acks=all
        (NOT_ENOUGH_REPLICAS, which the producer retries until its timeout, on every run).
        Replicas out of sync are waited for up to ISR_WAIT_S (a broker restarting), then
        the batch fails naming the partition, the setting and the way out. A partition
        without a leader is left to the producer, which waits for one. Returns the topic's
        metadata."""
        deadline = time.monotonic() + ISR_WAIT_S
        while True:
            t = self._partitions(batch, topic)
            need = self.settings.min_insync
            if need is None or need <= 1:
                return t
            short = sorted((p.id, len(p.isrs), len(p.replicas))
                           for p in t.partitions.values()
                           if (partitions is None or p.id in partitions) and p.leader >= 0
                           and len(p.isrs) < min(need, len(p.replicas)))
            if not short:
                return t
            pid, isr, replicas = short[0]
            if time.monotonic() > deadline:
                raise KafkaSinkError(
                    f"batch {batch.batch_id}: partition {topic}[{pid}] has {isr} in-sync "
                    f"replicas of {replicas}, fewer than the topic's min.insync.replicas="
                    f"{need}, so the broker refuses every write to it (NOT_ENOUGH_REPLICAS: a "
                    f"transactional producer writes with acks=all); nothing was produced "
                    f"(waited {ISR_WAIT_S:.0f} s for them). Bring the replicas of {topic} "
                    f"back in sync, or lower its min.insync.replicas (kafka-configs "
                    f"--bootstrap-server <broker> --alter --entity-type topics --entity-name "
                    f"{topic} --add-config min.insync.replicas={max(1, isr)}), then run the "
                    f"batch again")
            log.warning("batch %d: %s[%d] has %d in-sync replicas, fewer than its "
                        "min.insync.replicas=%d; waiting for them", batch.batch_id, topic, pid,
                        isr, need)
            time.sleep(1.0)

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
                    f" {left_out[0].error(self._mark.topic or self.sink.topic, None)}): "
                    f"too many to record in the commit; raise the limits, or make batches "
                    f"smaller")
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
                    msg = (f"batch {batch.batch_id}: {what} failed ({err.str()}); "
                           f"{self._timed_out() or aborted}")
                    if what == "commit_transaction" or self._timed_out():
                        raise KafkaSinkError(msg) from e
                    if err.code() in NOT_PASSING:
                        raise KafkaSinkError(f"{msg}. {NOT_PASSING[err.code()]}, then run the "
                                             f"batch again") from e
                    raise PassAborted(msg, err.str()) from e
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


class PassAborted(KafkaSinkError):
    """The transaction of a pass became abortable in librdkafka with no record refused in
    it (e.g. `OUT_OF_ORDER_SEQUENCE_NUMBER`, "skipped sequence numbers", after a record
    refused in the pass before left a gap in a partition's sequence numbers, or an
    in-flight request failing behind it). The transaction is aborted, nothing of it is
    visible; librdkafka bumps the producer's epoch on that abort, which resets the
    sequence numbers, so the next pass of the attempt starts clean
    (`offsetflow.sinks.kafka.sink`). Raised only while the outcome is known (never for
    commit_transaction)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def abortable_produce(e: KafkaException) -> None:
    """Raise `produce`'s error as `PassAborted` when librdkafka refused the record because
    the transaction already failed (`_STATE`: it left IN_TRANSACTION for its abortable
    state, which a refused record or an out-of-order sequence number puts it in while the
    pass still produces); any other error is the caller's to raise."""
    err: KafkaError = e.args[0]
    if err.code() == KafkaError._STATE:
        raise PassAborted(f"producing failed ({err.str()}): the transaction became "
                          f"abortable", err.str()) from e


@dataclass(frozen=True)
class Failed:
    """A message the broker (or librdkafka) did not take, as its delivery report tells it:
    no headers, so its source record is found again by key, value and timestamp."""

    code: int
    reason: str
    partition: int
    key: bytes | None
    value: bytes | None  # `value_digest` of the value
    timestamp: int


def fence(cfg: PipelineConfig, txn_id: str, timeout_s: float) -> None:
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
