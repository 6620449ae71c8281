"""The Kafka topic sink on the three-broker cluster: an output partition with fewer in-sync
replicas than its topic's `min.insync.replicas` (a broker down) refuses every acks=all
write (NOT_ENOUGH_REPLICAS), which the producer retries until its timeout, every run. The
batch fails before producing, naming the partition, the setting and the way out, and
commits once the replicas are back."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import parse_pipeline
from offsetflow.errors import KafkaSinkError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from tests.tooling import chaos, cluster
from tests.tooling.topic_checker import read_topic

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def topic_on(bootstrap: str, prefix: str, config: dict[str, str]) -> str:
    """Two partitions led by broker 1, replicas on all three."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=2,
                                  replica_assignment=[[1, 2, 3], [1, 3, 2]],
                                  config=config)])[name].result(timeout=60)
    chaos.wait_for(lambda: {p.leader for p in admin.list_topics(name, timeout=10).topics[
        name].partitions.values()} == {1}, 60, f"{name}'s partitions to have a leader")
    return name


def in_sync(bootstrap: str, topic: str) -> set[int]:
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=10)
    return {len(p.isrs) for p in md.topics[topic].partitions.values()}


def test_an_output_partition_short_of_min_insync_replicas_fails_naming_the_way_out(
        spark: Any, pg_dsn: str, kafka3: str, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("offsetflow.sinks.kafka.txn.ISR_WAIT_S", 3.0, raising=False)
    src = topic_on(kafka3, "kir-src", {"min.insync.replicas": "1"})
    out = topic_on(kafka3, "kir-out", {"min.insync.replicas": "3"})
    p = Producer({"bootstrap.servers": kafka3, "enable.idempotence": True})
    for i in range(20):
        p.produce(src, f"v{i}".encode(), f"k{i}".encode(), partition=i % 2)
    assert p.flush(30) == 0
    name = f"kir_{unique}"
    cfg = parse_pipeline({
        "name": name, "kafka": {"bootstrap_servers": kafka3},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        # main's producer retried NOT_ENOUGH_REPLICAS until this timeout, then failed
        # naming neither record nor setting (`record of source ?: Local: Message timed out`)
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": out, "value_format": "raw",
                 "producer": {"message.timeout.ms": "15000"}}}, f"<test {name}>", {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    cluster.stack("kafka-cluster-kill", "3")
    try:
        chaos.wait_for(lambda: in_sync(kafka3, out) == {2}, 90,
                       "broker 3 to drop out of the output topic's in-sync replicas")
        t = time.monotonic()
        with pytest.raises(KafkaSinkError) as e:
            run_batch(spark, cfg, bid, pg_dsn)
        msg = str(e.value)
        assert "min.insync.replicas=3" in msg and f"{out}[" in msg, msg
        assert "kafka-configs" in msg and "2 in-sync replicas of 3" in msg, msg
        assert time.monotonic() - t < 60
        with Ledger(pg_dsn) as ledger:
            assert ledger.get_batch(bid).status != "committed"
    finally:
        cluster.stack("kafka-cluster-node-start", "3")
    chaos.wait_for(lambda: in_sync(kafka3, out) == {3}, 120,
                   "broker 3 back in the output topic's in-sync replicas")
    res = run_batch(spark, cfg, bid, pg_dsn).result
    assert (res.status, res.rows_written) == ("committed", 20)
    assert len(read_topic(kafka3, out, "read_uncommitted")) == 20
