"""The local stack is the real thing: Apache Kafka with transactions, PostgreSQL, Airflow."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KTP


def test_broker_is_real_kafka_read_committed_hides_aborted(kafka_bootstrap: str,
                                                          make_topic: Any) -> None:
    topic = make_topic("txcheck", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"check-{topic}"})
    p.init_transactions(30)
    p.begin_transaction()
    for i in range(5):
        p.produce(topic, f"committed-{i}".encode(), partition=0)
    p.commit_transaction(30)
    p.begin_transaction()
    for i in range(5):
        p.produce(topic, f"aborted-{i}".encode(), partition=0)
    p.flush(30)
    p.abort_transaction(30)
    p.begin_transaction()
    p.produce(topic, b"committed-last", partition=0)
    p.commit_transaction(30)

    def read(isolation: str) -> list[str]:
        c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{isolation}",
                      "isolation.level": isolation, "enable.auto.commit": False,
                      "enable.partition.eof": True})
        c.assign([KTP(topic, 0, 0)])
        out: list[str] = []
        while True:
            m = c.poll(10)
            assert m is not None, "timed out reading the topic"
            if m.error():
                break  # partition EOF
            out.append(m.value().decode())
        c.close()
        return out

    committed = read("read_committed")
    assert committed == [f"committed-{i}" for i in range(5)] + ["committed-last"]
    uncommitted = read("read_uncommitted")
    assert [v for v in uncommitted if v.startswith("aborted")] == [f"aborted-{i}"
                                                                   for i in range(5)]


def test_spark_connection_is_percent_encoded_local_mode() -> None:
    out = subprocess.run(["airflow", "connections", "get", "spark_default", "-o", "json"],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy(),
                         check=True).stdout
    data = json.loads(out)
    conn = data[0] if isinstance(data, list) else data
    assert conn["host"] == "local[2]", conn
