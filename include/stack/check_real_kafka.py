"""Prove the local broker is real Apache Kafka with working transactions.

Creates a fresh topic, writes one committed and one aborted transaction with a transactional
producer, then reads the partition with isolation.level=read_committed and checks that only
the committed records are visible (and that read_uncommitted does see the aborted ones).

    .venv/bin/python include/stack/check_real_kafka.py [--bootstrap 127.0.0.1:19092]

Exit 0 on success, 1 with a message otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def fail(msg: str) -> None:
    print(f"check_real_kafka: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def read_all(bootstrap: str, topic: str, isolation: str) -> list[str]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4().hex}",
                  "isolation.level": isolation, "enable.auto.commit": False,
                  "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        out: list[str] = []
        deadline = time.monotonic() + 30
        while True:
            if time.monotonic() > deadline:
                fail(f"timed out reading {topic} with {isolation}")
            m = c.poll(5)
            if m is None:
                continue
            if m.error():
                if m.error().code() == -191:  # KafkaError._PARTITION_EOF
                    return out
                fail(f"consumer error: {m.error()}")
            out.append(m.value().decode())
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap",
                    default=os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP", "127.0.0.1:19092"))
    ap.add_argument("--keep-topic", action="store_true")
    bootstrap = ap.parse_args().bootstrap
    keep = ap.parse_args().keep_topic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        md = admin.list_topics(timeout=10)
    except KafkaException as e:
        fail(f"cannot reach Kafka at {bootstrap}: {e}")
    topic = f"offsetflow-check-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(30)

    try:
        p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"check-{topic}",
                      "enable.idempotence": True})
        p.init_transactions(30)
        p.begin_transaction()
        for i in range(3):
            p.produce(topic, f"committed-{i}".encode(), partition=0)
        p.commit_transaction(30)
        p.begin_transaction()
        for i in range(3):
            p.produce(topic, f"aborted-{i}".encode(), partition=0)
        p.flush(30)  # the aborted records really reach the log before the abort
        p.abort_transaction(30)

        committed = read_all(bootstrap, topic, "read_committed")
        expected = [f"committed-{i}" for i in range(3)]
        if committed != expected:
            fail(f"read_committed saw {committed}, expected {expected}")
        uncommitted = read_all(bootstrap, topic, "read_uncommitted")
        aborted = [v for v in uncommitted if v.startswith("aborted-")]
        if aborted != [f"aborted-{i}" for i in range(3)]:
            fail(f"read_uncommitted should expose the aborted records, saw {uncommitted}")

        wm = Consumer({"bootstrap.servers": bootstrap, "group.id": "check-wm"})
        lo, hi = wm.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        print(f"check_real_kafka: OK: broker {bootstrap} (cluster {md.cluster_id}); topic {topic}: "
              f"read_committed={committed}; aborted records hidden; log end offset {hi} "
              f"(includes transaction markers)")
    finally:
        if not keep:
            admin.delete_topics([topic])[topic].result(30)


if __name__ == "__main__":
    main()
