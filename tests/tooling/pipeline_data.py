"""Test data: producers (records that remember what they wrote, keyed records with their own
timestamps, amounts the quality suites refuse), pipeline configs for a topic, and reading back
(rows of a query, a topic's end offsets, a ledger database of its own)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg2
from confluent_kafka import Producer
from psycopg2 import sql

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.ledger import Ledger

SCHEMA = {"event_id": "string", "seq": "long", "amount": "double", "checksum": "string"}


def record(event_id: str, seq: int) -> dict[str, Any]:
    amount = round(random.Random(seq).uniform(0, 1000), 2)
    body = f"{event_id}|{seq}|{amount}"
    return {"event_id": event_id, "seq": seq, "amount": amount,
            "checksum": hashlib.sha1(body.encode()).hexdigest()}


@dataclass
class Produced:
    """What a test wrote: committed records by id, and ids of aborted ones."""

    committed: dict[str, dict[str, Any]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)


def produce_plain(bootstrap: str, topic: str, n: int, prefix: str, partitions: int,
                  produced: Produced | None = None, start_seq: int = 0) -> Produced:
    produced = produced or Produced()
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True,
                  "batch.num.messages": 10000})
    for i in range(start_seq, start_seq + n):
        rec = record(f"{prefix}-{i}", i)
        p.produce(topic, json.dumps(rec).encode(), key=rec["event_id"].encode(),
                  partition=i % partitions)
        produced.committed[rec["event_id"]] = rec
        if i % 5000 == 0:
            p.poll(0)
    assert p.flush(60) == 0, "not all records were delivered"
    return produced


def produce_transactional(bootstrap: str, topic: str, txns: list[tuple[int, bool]], prefix: str,
                          partitions: int, produced: Produced | None = None) -> Produced:
    """`txns`: (records, commit?) per transaction, in order."""
    produced = produced or Produced()
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"tx-{prefix}",
                  "linger.ms": 5})
    p.init_transactions(30)
    seq = 0
    for n, commit in txns:
        p.begin_transaction()
        ids = []
        for _ in range(n):
            rec = record(f"{prefix}-{seq}", seq)
            p.produce(topic, json.dumps(rec).encode(), key=rec["event_id"].encode(),
                      partition=seq % partitions)
            ids.append(rec)
            seq += 1
        if commit:
            p.commit_transaction(30)
            produced.committed.update({r["event_id"]: r for r in ids})
        else:
            p.flush(30)  # the aborted records really reach the log
            p.abort_transaction(30)
            produced.aborted.update(r["event_id"] for r in ids)
    return produced


def produce(bootstrap: str, topic: str, records: list[tuple[Any, Any, int | None]],
            partition: int = 0) -> None:
    """(key, value, timestamp ms or None) in order to one partition; dict values as JSON."""
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for key, value, ts in records:
        v = json.dumps(value).encode() if isinstance(value, dict) else value
        k = key.encode() if isinstance(key, str) else key
        if ts:
            p.produce(topic, v, key=k, partition=partition, timestamp=ts)
        else:
            p.produce(topic, v, key=k, partition=partition)
    assert p.flush(30) == 0


def ev(event_id: str | None, amount: float) -> dict[str, Any]:
    d: dict[str, Any] = {"seq": 0, "amount": amount, "checksum": "x"}
    if event_id is not None:
        d["event_id"] = event_id
    return d


def produce_with_negative_amounts(bootstrap: str, topic: str) -> list[int]:
    p = Producer({"bootstrap.servers": bootstrap})
    bad = []
    for i in range(100):
        amount = -5.0 if i % 25 == 7 else float(i)
        if amount < 0:
            bad.append(i)
        p.produce(topic, json.dumps({"event_id": f"e{i}", "seq": i, "amount": amount,
                                     "checksum": "x"}).encode(), partition=0)
    p.flush(30)
    return bad  # offsets of the rows that break the suite (one partition, one per offset)


def pipeline_for(topic: str, dsn: str, bootstrap: str, table: str, **over: Any) -> PipelineConfig:
    raw: dict[str, Any] = {
        "name": over.pop("name", table.replace(".", "_")),
        "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest",
                   "max_records_per_partition": over.pop("max_records_per_partition", 100_000)},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": dsn, "table": table, "mode": over.pop("mode", "append")},
        "spark": {"master": "local[2]",
                  "max_offsets_per_task": over.pop("max_offsets_per_task", 100_000)},
    }
    if "key" in over:
        raw["sink"]["key"] = over.pop("key")
    for k in ("data_loss", "starting", "max_records_per_batch"):
        if k in over:
            raw["source"][k] = over.pop(k)
    if "source_rate" in over:  # source.rate (adaptive batch sizing)
        raw["source"]["rate"] = over.pop("source_rate")
    raw.update(over)
    return parse_pipeline(raw, f"<test {table}>", {})


def query(dsn: str, q: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(q, args)
            return cur.fetchall() if cur.description else []
    finally:
        conn.close()


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[tuple[str, int], int]:
    from offsetflow.source import KafkaMetadata

    km = KafkaMetadata({"bootstrap.servers": bootstrap})
    offs = km.partition_offsets([(topic, p) for p in range(partitions)])
    return {tp: o.latest for tp, o in offs.items()}


@contextlib.contextmanager
def ledger_database(admin_dsn: str, name: str, *settings: str) -> Iterator[str]:
    """A database of its own with the ledger migrated (`settings`: ALTER DATABASE ... SET
    clauses applied first), dropped afterwards: another ledger, or one on an odd server."""
    conn = psycopg2.connect(admin_dsn, connect_timeout=10)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        for s in settings:
            cur.execute(sql.SQL("ALTER DATABASE {} SET ").format(sql.Identifier(name))
                        + sql.SQL(s))
    dsn = psycopg2.extensions.make_dsn(admin_dsn, dbname=name)
    with Ledger(dsn) as ledger:
        ledger.upgrade()
    try:
        yield dsn
    finally:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
        conn.close()
