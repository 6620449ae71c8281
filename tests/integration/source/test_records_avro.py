"""`format.type: avro` on real Kafka, Spark and PostgreSQL, with a schema registry over HTTP
(the stack's, include/stack/schema_registry.py): records produced by confluent-kafka's own
`AvroSerializer` (Confluent wire format, schema registered by the serializer) land exactly
once, nested and logical types checked value by value; poison records (no magic byte, an
unknown schema id, a truncated payload, a value that does not fit its column) are dead
letters with their coordinates, schema id and reason; a registry that stops mid-batch fails
the batch with nothing committed, and the next run commits it once.

One topic and one batch run for the landing and the poison checks (a module fixture); the
outage test has a registry of its own, in this process, that it stops itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import parse_pipeline
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import query

ROOT = Path(__file__).resolve().parents[3]
ORDER_SCHEMA = {
    "type": "record", "name": "Order", "namespace": "offsetflow.test", "fields": [
        {"name": "order_id", "type": "long"},
        {"name": "small", "type": "long"},  # declared int: 2**40 does not fit (a dead letter)
        {"name": "customer", "type": {"type": "record", "name": "Customer", "fields": [
            {"name": "name", "type": "string"},
            {"name": "tags", "type": {"type": "array", "items": "string"}},
            {"name": "address", "type": ["null", {
                "type": "record", "name": "Address", "fields": [
                    {"name": "city", "type": "string"}]}], "default": None}]}},
        {"name": "status", "type": {"type": "enum", "name": "Status",
                                    "symbols": ["NEW", "PAID", "SHIPPED"]}},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "attrs", "type": {"type": "map", "values": "double"}},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal",
                                    "precision": 10, "scale": 2}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "at_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
    ]}
COLUMNS = {"order_id": "long", "small": "int", "customer": "json", "status": "string",
           "note": "string", "attrs": "json", "amount": "decimal(10,2)", "day": "date",
           "at_ms": "timestamp", "at_us": "timestamp", "uid": "uuid"}
GOOD = 24
PARTITIONS = 2


def _order(i: int) -> dict[str, Any]:
    return {
        "order_id": i, "small": i * 3,
        "customer": {"name": f"c{i}", "tags": [f"t{i}", "x"] if i % 3 else [],
                     "address": {"city": f"city{i}"} if i % 2 else None},
        "status": ("NEW", "PAID", "SHIPPED")[i % 3],
        "note": None if i % 4 == 0 else f"note {i} é",
        "attrs": {"w": i / 4, "h": 1.5} if i % 5 else {},
        "amount": Decimal(f"{i * 7}.{i % 100:02d}") * (-1 if i % 7 == 3 else 1),
        "day": date(2026, 1, 1 + i % 28),
        "at_ms": datetime(2026, 11, 26, 12, 0, i % 60, (i * 1000) % 1_000_000, tzinfo=UTC),
        "at_us": datetime(2026, 11, 26, 12, 0, i % 60, i * 7 + 1, tzinfo=UTC),
        "uid": uuid.UUID(int=i * 7919 + 1),
    }


def _serializer(url: str, schema: dict[str, Any]) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer

    return AvroSerializer(SchemaRegistryClient({"url": url}), json.dumps(schema),
                          conf={"auto.register.schemas": True})


def _encode(ser: Any, topic: str, record: dict[str, Any]) -> bytes:
    from confluent_kafka.serialization import MessageField, SerializationContext

    return ser(record, SerializationContext(topic, MessageField.VALUE))  # type: ignore[no-any-return]


def _topic(bootstrap: str, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(timeout=30)
    return name


def _config(topic: str, dsn: str, bootstrap: str, table: str, registry_url: str) -> Any:
    raw = {"name": table, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": dict(COLUMNS),
                      "schema_registry": {"url": registry_url}},
           "sink": {"connection": dsn, "table": table},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{table}",
           "spark": {"master": "local[2]", "max_offsets_per_task": 8}}
    return parse_pipeline(raw, f"<test {table}>", {})


@pytest.fixture(scope="module")
def registry_url() -> str:
    url = os.environ.get("OFFSETFLOW_SCHEMA_REGISTRY_URL")
    if not url:
        pytest.fail("OFFSETFLOW_SCHEMA_REGISTRY_URL is not set: start the stack's schema "
                    "registry (make up, or include/stack/stack.sh registry-start)")
    return url


@pytest.fixture(scope="module")
def avro_batch(spark: Any, pg_dsn: str, kafka_bootstrap: str, registry_url: str
               ) -> dict[str, Any]:
    """One Avro topic, good records and poison pills in both partitions, read by one batch."""
    topic = _topic(kafka_bootstrap, "avro")
    ser = _serializer(registry_url, ORDER_SCHEMA)
    good = _encode(ser, topic, _order(0))
    schema_id = int.from_bytes(good[1:5], "big")
    pills = {  # key -> (value, what its dead letter's reason must say)
        "no-magic": (b'{"order_id": 1}', "magic byte"),
        "unknown-id": (b"\x00" + (10**9).to_bytes(4, "big") + good[5:],
                       "unknown schema id 1000000000"),
        "truncated": (good[:-6], f"schema id {schema_id}: payload does not decode"),
        "too-big": (_encode(ser, topic, {**_order(99), "small": 2**40}),
                    f"schema id {schema_id}: field 'small'"),
    }
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    sent: dict[str, dict[str, Any]] = {}
    for i in range(GOOD):
        p.produce(topic, _encode(ser, topic, _order(i)), key=f"g{i}".encode(),
                  partition=i % PARTITIONS)
        if i % 6 == 1 and pills:
            k = next(iter(pills))
            value, _ = pills[k]
            p.produce(topic, value, key=k.encode(), partition=i % PARTITIONS)
            sent[k] = {"partition": i % PARTITIONS, "why": pills.pop(k)[1]}
    assert not pills and p.flush(30) == 0
    table = f"avro_{uuid.uuid4().hex[:8]}"
    cfg = _config(topic, pg_dsn, kafka_bootstrap, table, registry_url)
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    return {"cfg": cfg, "topic": topic, "report": report, "pills": sent,
            "batch_id": planned.batch.batch_id, "schema_id": schema_id}


def test_avro_records_land_exactly_once_value_by_value(avro_batch: dict[str, Any],
                                                        pg_dsn: str, spark: Any) -> None:
    cfg = avro_batch["cfg"]
    assert avro_batch["report"].result.status == "committed", avro_batch["report"].result
    cols = ", ".join(COLUMNS)
    rows = query(pg_dsn, f"SELECT {cols}, partition, \"offset\" FROM {cfg.sink.table} "
                         f"ORDER BY order_id")
    assert [r[0] for r in rows] == list(range(GOOD))  # each good record exactly once
    types = dict(query(pg_dsn, "SELECT column_name, data_type FROM information_schema.columns"
                               " WHERE table_name = %s", (cfg.sink.table,)))
    assert (types["customer"], types["attrs"], types["uid"], types["amount"], types["day"],
            types["at_us"], types["status"]) == ("jsonb", "jsonb", "uuid", "numeric", "date",
                                                 "timestamp with time zone", "text")
    for row in rows:
        got = dict(zip(COLUMNS, row, strict=False))
        want = _order(got["order_id"])
        assert got["small"] == want["small"]
        assert got["customer"] == want["customer"]  # nested record, array, union -> jsonb
        assert got["status"] == want["status"]  # enum -> text
        assert got["note"] == want["note"]  # union with null -> nullable
        assert got["attrs"] == want["attrs"]  # map -> jsonb
        assert got["amount"] == want["amount"]  # decimal -> numeric, exact
        assert got["day"] == want["day"]
        assert got["at_ms"] == want["at_ms"] and got["at_us"] == want["at_us"]  # micros kept
        assert str(got["uid"]) == str(want["uid"])
    # running the committed batch again changes nothing
    again = run_batch(spark, cfg, avro_batch["batch_id"], pg_dsn)
    assert again.result.status == "already_committed"
    assert query(pg_dsn, f"SELECT count(*) FROM {cfg.sink.table}")[0][0] == GOOD


def test_poison_avro_records_are_dead_letters_with_coordinates(avro_batch: dict[str, Any],
                                                               pg_dsn: str) -> None:
    cfg = avro_batch["cfg"]
    assert avro_batch["report"].result.status == "committed", avro_batch["report"].result
    dead = {bytes(k).decode(): (t, p, o, err) for t, p, o, k, err in query(
        pg_dsn, f'SELECT topic, partition, "offset", key, error FROM dl_{cfg.sink.table}')}
    assert set(dead) == set(avro_batch["pills"])
    for key, pill in avro_batch["pills"].items():
        topic, part, offset, err = dead[key]
        assert (topic, part) == (avro_batch["topic"], pill["partition"]) and offset >= 0
        assert pill["why"] in err, (key, err)
    with Ledger(pg_dsn) as ledger:  # the poison did not hold the positions back
        positions = ledger.positions(cfg.name)
    assert sum(positions.values()) == GOOD + len(avro_batch["pills"])


# --- a registry that stops mid-batch ----------------------------------------------------------

def _registry_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "offsetflow_test_registry", ROOT / "include" / "stack" / "schema_registry.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class StoppableRegistry:
    """The stack's registry server in a thread on a port of its own; `stop_on_first_id`
    makes it stop (the listening socket closed) when the first writer schema is asked for,
    after the run's driver has read the reader schema: the tasks find it gone."""

    def __init__(self, data: Path) -> None:
        self.mod = _registry_module()
        self.data = data
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.stop_on_first_id = False
        self.stopped = threading.Event()
        self.server: Any = None

    def start(self) -> None:
        self.server = self.mod.make_server(self.port, self.data)
        handler = self.server.RequestHandlerClass
        orig = handler.do_GET
        registry = self

        def do_get(h: Any) -> None:
            if registry.stop_on_first_id and h.path.startswith("/schemas/ids/"):
                registry.stop_on_first_id = False
                h.close_connection = True
                threading.Thread(target=registry.stop, daemon=True).start()
                return  # no answer: the connection drops, then nothing listens
            orig(h)
        handler.do_GET = do_get
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.stopped.set()


@pytest.fixture
def stoppable_registry(tmp_path: Path) -> Iterator[StoppableRegistry]:
    reg = StoppableRegistry(tmp_path / "schemas.json")
    reg.start()
    yield reg
    if not reg.stopped.is_set():
        reg.stop()


def test_registry_stopped_mid_batch_fails_it_cleanly_and_the_next_run_commits_once(
        spark: Any, pg_dsn: str, kafka_bootstrap: str,
        stoppable_registry: StoppableRegistry) -> None:
    reg = stoppable_registry
    topic = _topic(kafka_bootstrap, "avro-outage")
    ser = _serializer(reg.url, ORDER_SCHEMA)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    n = 12
    for i in range(n):
        p.produce(topic, _encode(ser, topic, _order(i)), partition=i % PARTITIONS)
    assert p.flush(30) == 0
    table = f"avro_out_{uuid.uuid4().hex[:8]}"
    cfg = _config(topic, pg_dsn, kafka_bootstrap, table, reg.url)
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    batch_id = planned.batch.batch_id

    reg.stop_on_first_id = True
    with pytest.raises(Exception) as failed:
        run_batch(spark, cfg, batch_id, pg_dsn)
    assert reg.stopped.is_set()
    assert "SchemaRegistryError" in str(failed.value) or "schema registry" in str(failed.value)
    assert f"schema registry {reg.url}" in str(failed.value)
    with Ledger(pg_dsn) as ledger:
        batch = ledger.get_batch(batch_id)
        assert batch.status == "failed"
        assert (batch.error or "").startswith("SchemaRegistryError (in a Spark task): schema "
                                              f"registry {reg.url}: schema id "), batch.error
        assert sum(ledger.positions(cfg.name).values()) == 0  # nothing committed
    exists = query(pg_dsn, "SELECT to_regclass(%s)", (table,))[0][0]
    if exists:
        assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 0

    reg.stopped.clear()
    reg.start()  # back, same schemas and ids
    report = run_batch(spark, cfg, batch_id, pg_dsn)
    assert report.result.status == "committed", report.result
    rows = query(pg_dsn, f"SELECT order_id, count(*) FROM {table} GROUP BY 1 ORDER BY 1")
    assert rows == [(i, 1) for i in range(n)]
    with Ledger(pg_dsn) as ledger:
        assert sum(ledger.positions(cfg.name).values()) == n
