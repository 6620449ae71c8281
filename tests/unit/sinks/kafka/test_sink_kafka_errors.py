"""The Kafka topic sink's reading of what the broker answered (review LOW items), with
stand-ins for the client objects: no broker can be made to answer this way on demand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from offsetflow.commit import CommitSpec
from offsetflow.config import parse_pipeline
from offsetflow.errors import KafkaSinkError
from offsetflow.sinks.kafka import KafkaTopicSink
from offsetflow.sinks.kafka.sink import committed_offsets
from tests.tooling.kafka_sink_config import ENV, batch, raw


@dataclass
class Answered:
    """A partition as `Consumer.committed()` returns it."""

    topic: str
    partition: int
    offset: int
    metadata: str | None
    error: KafkaError | None = None


def test_a_partition_answered_with_an_error_is_refused_not_taken_as_uncommitted() -> None:
    """A per-partition error reads as offset -1001 (none); taken as "not committed", the
    batch would be produced again."""
    ok = Answered("in", 0, 20, "offsetflow pipeline=orders batch=7")
    failed = Answered("in", 1, -1001, None, KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE))
    assert committed_offsets(batch(), "g", [ok]) == {("in", 0): (20, ok.metadata)}
    with pytest.raises(KafkaSinkError, match=r"in\[1\] in group g: .*Coordinator"):
        committed_offsets(batch(), "g", [ok, failed])


class AbortFails:
    """A producer whose abort fails the way it does after an ambiguous EndTxn."""

    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(KafkaError(KafkaError._STATE))


def failing(err: KafkaError) -> Any:
    def call(left: float) -> None:
        raise KafkaException(err)
    return call


def test_an_abortable_error_of_commit_transaction_is_an_unknown_outcome() -> None:
    """librdkafka reports an EndTxn(commit) that failed on an already failed transaction
    as abortable, but the broker may have committed it: not "nothing is visible"."""
    cfg = parse_pipeline(raw(topic="out"), "orders.yaml", ENV)
    sink = KafkaTopicSink(cfg, None, CommitSpec(columns=()), timeout_s=1.0)
    sink._producer = AbortFails()  # type: ignore[assignment]
    abortable = KafkaError(KafkaError.INVALID_TXN_STATE, txn_requires_abort=True)
    with pytest.raises(KafkaSinkError, match="outcome is unknown") as e:
        sink._retry(batch(), "commit_transaction", failing(abortable))
    assert "nothing of it is visible" not in str(e.value)
    sink._producer = AbortFails()  # type: ignore[assignment]
    with pytest.raises(KafkaSinkError, match="was aborted, nothing of it is visible"):
        sink._retry(batch(), "send_offsets_to_transaction", failing(abortable))


def test_the_fencing_producer_uses_the_sinks_producer_credentials() -> None:
    """A batch planned before the ledger identity is fenced under its old transactional.id
    by a producer of its own; on a cluster with ACLs only the sink's principal
    (`sink.producer`) may use transactional ids: the source's would be refused."""
    from offsetflow.sinks.kafka.txn import fence_settings

    cfg = parse_pipeline(raw(topic="orders.clean", producer={
        "sasl.username": "sink-writer", "sasl.password": "s3cret",
        "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN"}), "orders.yaml", ENV)
    conf = fence_settings(cfg, "offsetflow-sink-orders")
    assert conf["sasl.username"] == "sink-writer" and conf["sasl.password"] == "s3cret"
    assert conf["transactional.id"] == "offsetflow-sink-orders"
    assert conf["enable.idempotence"] is True
    assert conf["bootstrap.servers"] == "127.0.0.1:19092"


def test_the_fencing_producer_leaves_out_delivery_and_timeout_settings() -> None:
    """A sink.producer delivery.timeout.ms above 60 s (the Java client's default is 120 s)
    made librdkafka refuse to create the fencing producer (its transaction.timeout.ms is
    the 60 s default): every old-format batch failed, abandon and complete too."""
    from confluent_kafka import Producer

    from offsetflow.sinks.kafka.txn import fence_settings

    cfg = parse_pipeline(raw(topic="orders.clean", producer={
        "delivery.timeout.ms": 120000, "linger.ms": 50, "compression.type": "lz4",
        "sasl.username": "sink-writer"}), "orders.yaml", ENV)
    conf = fence_settings(cfg, "offsetflow-sink-orders")
    assert "delivery.timeout.ms" not in conf and "linger.ms" not in conf
    assert conf["sasl.username"] == "sink-writer"
    conf.pop("sasl.username")  # no SASL on a plaintext test client
    Producer(conf)  # librdkafka accepts the settings (it refused them with the timeout)


def test_an_abortable_pass_is_told_apart_from_an_unknown_commit() -> None:
    """An abortable error before the commit (send_offsets_to_transaction, or produce()
    refused with _STATE once the transaction failed) is `PassAborted`: nothing of the pass is
    visible and the pass loop produces the batch once more (the abort bumps the epoch: a
    gap in the sequence numbers a refused record left is gone). An abortable commit is not:
    its outcome is unknown, and another pass could produce the batch twice."""
    from offsetflow.sinks.kafka.txn import PassAborted, abortable_produce

    cfg = parse_pipeline(raw(topic="out"), "orders.yaml", ENV)
    sink = KafkaTopicSink(cfg, None, CommitSpec(columns=()), timeout_s=1.0)
    sink._producer = AbortFails()  # type: ignore[assignment]
    skipped = KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "skipped sequence numbers",
                         txn_requires_abort=True)
    with pytest.raises(PassAborted) as e:
        sink._retry(batch(), "send_offsets_to_transaction", failing(skipped))
    assert e.value.reason == "skipped sequence numbers"
    with pytest.raises(KafkaSinkError) as c:
        sink._retry(batch(), "commit_transaction", failing(skipped))
    assert not isinstance(c.value, PassAborted)
    with pytest.raises(PassAborted):
        abortable_produce(KafkaException(KafkaError(KafkaError._STATE)))
    abortable_produce(KafkaException(KafkaError(KafkaError._UNKNOWN_TOPIC)))  # the caller's


@dataclass
class Report:
    """A delivery report's message."""

    n: int

    def timestamp(self) -> tuple[int, int]:
        return (0, -1)

    def partition(self) -> int:
        return 0

    def key(self) -> bytes:
        return f"k{self.n}".encode()

    def value(self) -> bytes:
        return b"v"


def test_purged_reports_leave_room_for_the_refused_ones() -> None:
    """librdkafka purges every queued message when a transaction becomes abortable: a run of
    purged reports must not fill the kept reports before the refused record's arrives (the
    pass would then look failed for no record, again on every pass)."""
    from offsetflow.sinks.kafka.txn import MAX_FAILED

    cfg = parse_pipeline(raw(topic="out"), "orders.yaml", ENV)
    sink = KafkaTopicSink(cfg, None, CommitSpec(columns=()), timeout_s=1.0)
    purged, refused = KafkaError(KafkaError._PURGE_QUEUE), KafkaError(
        KafkaError.MSG_SIZE_TOO_LARGE)
    for i in range(MAX_FAILED + 5):
        sink._on_delivery(purged, Report(i))
    sink._on_delivery(refused, Report(-1))
    sink._on_delivery(KafkaError(KafkaError._PURGE_INFLIGHT), Report(-2))
    assert [f.code for f in sink._failed] == [KafkaError._PURGE_QUEUE,
                                              KafkaError.MSG_SIZE_TOO_LARGE,
                                              KafkaError._PURGE_INFLIGHT]
    assert sink._failed[1].key == b"k-1"


def test_a_new_producer_for_the_next_pass_keeps_the_attempts_topic_settings() -> None:
    """Each pass after an aborted one has a new producer (`_reopen`). The output topic's
    settings are the attempt's (its record limit and timestamp bounds were computed from
    them): read again, a broker that does not answer the DescribeConfigs (one restarting
    between passes; here none listens) left the pass with none known, so its producer's
    batches were no longer capped by the topic's max.message.bytes, nor keyless records
    checked for a compacted topic."""
    from offsetflow.sinks.kafka.limits import TopicSettings
    from offsetflow.sinks.kafka.mark import CommitMark

    nobody = raw(topic="out", producer={"transaction.timeout.ms": 5000})
    # a port no broker listens on (the stack's broker may well be up on the default one)
    nobody["kafka"]["bootstrap_servers"] = "127.0.0.1:9"
    cfg = parse_pipeline(nobody, "orders.yaml", ENV)
    sink = KafkaTopicSink(cfg, None, CommitSpec(columns=()), timeout_s=1.0)
    sink._mark = CommitMark(cfg.name, "ledger-1", "out")
    known = TopicSettings.parse("out", {"max.message.bytes": "2000",
                                        "cleanup.policy": "compact"})
    sink.settings = known
    with pytest.raises(KafkaSinkError, match="init_transactions"):
        sink._reopen(batch())
    assert sink.settings == known


def test_an_abortable_authorization_error_is_no_new_pass() -> None:
    """librdkafka makes a group ACL missing at send_offsets_to_transaction abortable: as
    `PassAborted` it produced the whole batch 4 times over, then failed naming no way out
    ("the next run produces the batch again", which fails the same). An error the cluster's
    settings decide fails the batch at once, naming the ACL to grant."""
    from offsetflow.sinks.kafka.txn import PassAborted

    cfg = parse_pipeline(raw(topic="out"), "orders.yaml", ENV)
    sink = KafkaTopicSink(cfg, None, CommitSpec(columns=()), timeout_s=1.0)
    sink._producer = AbortFails()  # type: ignore[assignment]
    denied = KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "Group authorization failed",
                        txn_requires_abort=True)
    with pytest.raises(KafkaSinkError, match="grant the sink's principal") as e:
        sink._retry(batch(), "send_offsets_to_transaction", failing(denied))
    assert not isinstance(e.value, PassAborted)
