"""`sink.value_format: avro` on the real broker, PostgreSQL, Spark and the stack's schema
registry: the output records are Confluent wire-format Avro, read back with confluent-kafka's
AvroDeserializer (read_committed) value by value against the source; a value that does not
fit the schema goes to the dead-letter table with its coordinates and the reason; the
registry down at the start fails the batch with nothing produced; the schema id a batch
pinned is the one its records carry, also after a kill between the Kafka and the ledger
commits with a newer version registered before the retry."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml
from confluent_kafka import Producer

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.errors import SchemaRegistryError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.sinks.kafka.sink import FAULT_ENV
from tests.tooling import chaos
from tests.tooling.chaos import dead_letters
from tests.tooling.registry_case import new_topic, registry_url
from tests.tooling.topic_checker import OutputRecord, read_topic

SCHEMA = {"id": "long", "amount": "decimal(10,2)", "price": "double", "at": "timestamp",
          "day": "date", "name": "string"}
N = 24
HUGE = 1e20  # a double that no decimal(10,2) holds


@dataclass(frozen=True)
class Source:
    topic: str
    values: dict[tuple[int, int], dict[str, Any]]  # (partition, offset) -> the JSON record


def source_record(i: int) -> dict[str, Any]:
    return {"id": i, "amount": f"{i * 3}.25", "price": i / 4,
            "at": f"2026-01-0{1 + i % 9}T10:00:0{i % 10}.123456Z", "day": f"2026-02-{10 + i % 9}",
            "name": None if i % 5 == 0 else f"n{i}"}


@pytest.fixture(scope="module")
def source(kafka_bootstrap: str) -> Source:
    """One source topic for the module: N records over 2 partitions (record 7's price is
    HUGE: fine as a double, not as an explicit schema's decimal(10,2))."""
    topic = new_topic(kafka_bootstrap, "kav-src", 2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for i in range(N):
        rec = source_record(i)
        if i == 7:
            rec["price"] = HUGE

        def cb(err: Any, msg: Any, rec: dict[str, Any] = rec) -> None:
            assert err is None, err
            out[(msg.partition(), msg.offset())] = rec
        p.produce(topic, json.dumps(rec).encode(), f"k{i}".encode(), partition=i % 2,
                  on_delivery=cb)
    assert p.flush(30) == 0
    return Source(topic, out)


def pipeline(name: str, src: str, out: str, dsn: str, bootstrap: str, file: Path | None = None,
             url: str | None = None, **sink: Any) -> PipelineConfig:
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [src], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"type": "kafka", "connection": dsn, "topic": out, "value_format": "avro",
                 "schema_registry": {"url": url or registry_url()}, **sink},
        "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead",
        "spark": {"master": "local[2]"}}
    if file is not None:
        file.write_text(yaml.safe_dump(raw))
    return parse_pipeline(raw, str(file or f"<test {name}>"), {})


def decoded(topic: str, records: list[OutputRecord]) -> Iterator[tuple[int, Any, int]]:
    """(schema id, the value as AvroDeserializer reads it, its source offset) per record."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    deser = AvroDeserializer(SchemaRegistryClient({"url": registry_url()}))
    ctx = SerializationContext(topic, MessageField.VALUE)
    for r in records:
        assert r.value is not None and r.value[0] == 0, r.value
        yield struct.unpack(">I", r.value[1:5])[0], deser(r.value, ctx), r


def expected(rec: dict[str, Any]) -> dict[str, Any]:
    """The source record as the derived schema's logical types read back."""
    return {"id": rec["id"], "amount": Decimal(rec["amount"]), "price": rec["price"],
            "at": datetime.fromisoformat(rec["at"]).astimezone(UTC),
            "day": datetime.fromisoformat(rec["day"]).date(), "name": rec["name"]}


def pinned(dsn: str, batch_id: int) -> tuple[str, int] | None:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT subject, schema_id FROM offsetflow.output_schemas "
                    "WHERE batch_id = %s", (batch_id,))
        row = cur.fetchone()
    conn.close()
    return None if row is None else (str(row[0]), int(row[1]))


def planned(cfg: PipelineConfig, dsn: str) -> int:
    found = plan_only(cfg, dsn)
    assert found.batch is not None
    return found.batch.batch_id


def test_avro_values_read_back_value_by_value_and_carry_the_pinned_schema_id(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        source: Source) -> None:
    out = make_topic("kav-out", 2)
    name = f"kav_{unique}"
    cfg = pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap)
    bid = planned(cfg, pg_dsn)
    res = run_batch(spark, cfg, bid, pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", N, 0)
    subject, sid = pinned(pg_dsn, bid) or ("", 0)
    assert subject == f"{out}-value"
    seen: dict[tuple[int, int], int] = {}
    for schema_id, value, rec in decoded(out, read_topic(kafka_bootstrap, out)):
        src_topic, part, off = rec.source
        assert src_topic == source.topic and schema_id == sid
        seen[(part, off)] = seen.get((part, off), 0) + 1
        assert value == expected(source.values[(part, off)]), (part, off)
    # the checker's verdict: 0 lost, 0 duplicated
    assert {k for k, n in seen.items() if n > 1} == set()
    assert set(source.values) - set(seen) == set()
    schema = json.loads(_registry_schema(sid))
    types = {f["name"]: f["type"][1] for f in schema["fields"]}
    assert types["amount"] == {"type": "bytes", "logicalType": "decimal", "precision": 10,
                               "scale": 2}
    assert types["at"]["logicalType"] == "timestamp-micros"
    assert types["day"]["logicalType"] == "date"


def _registry_schema(sid: int) -> str:
    from offsetflow.source import RegistryClient

    found = RegistryClient(registry_url()).schema_by_id(sid)
    assert found is not None
    return found.schema


def test_a_value_the_avro_schema_cannot_hold_goes_to_dead_letters_with_the_reason(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        source: Source) -> None:
    out = make_topic("kav-bad", 2)
    name = f"kavb_{unique}"
    explicit = {"type": "record", "name": "priced", "fields": [
        {"name": "id", "type": "long"},
        {"name": "price", "type": {"type": "bytes", "logicalType": "decimal",
                                   "precision": 10, "scale": 2}}]}
    cfg = pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap,
                   value_schema=json.dumps(explicit))
    res = run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", N - 1, 1)
    bad = next(k for k, v in source.values.items() if v["price"] == HUGE)
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(source.topic, *bad)]
    assert "'price'" in dead[0].error and "decimal(10,2)" in dead[0].error, dead[0].error
    got = {r.source[1:]: v for _, v, r in decoded(out, read_topic(kafka_bootstrap, out))}
    assert set(got) == set(source.values) - {bad}
    assert all(v["price"] == Decimal(str(source.values[k]["price"])) for k, v in got.items())


def test_the_registry_down_at_the_start_fails_the_batch_before_anything_is_produced(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        source: Source) -> None:
    out = make_topic("kav-down", 2)
    name = f"kavd_{unique}"
    down = pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap,
                    url="http://127.0.0.1:1")  # nothing listens there
    bid = planned(down, pg_dsn)
    with pytest.raises(SchemaRegistryError) as e:
        run_batch(spark, down, bid, pg_dsn)
    assert e.value.retriable and "127.0.0.1:1" in str(e.value)
    assert read_topic(kafka_bootstrap, out, "read_uncommitted") == []
    assert pinned(pg_dsn, bid) is None
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(bid).status != "committed"
    # the registry back (the URL is not part of the output): the same batch commits
    res = run_batch(spark, pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap), bid,
                    pg_dsn).result
    assert (res.status, res.rows_written) == ("committed", N)


@pytest.mark.slow  # a batch process of its own (its Spark session): ~80 s on a loaded 2-core box
def test_killed_after_the_kafka_commit_the_retry_keeps_the_pinned_schema_id(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        source: Source, tmp_path: Path) -> None:
    """A newer version registered under the subject between the kill and the retry changes
    nothing: the retry finds the Kafka commit, produces nothing, and every record carries the
    id the batch pinned."""
    out = make_topic("kav-kill", 2)
    name = f"kavk_{unique}"
    file = tmp_path / f"{name}.yaml"
    cfg = pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap, file=file)
    bid = planned(cfg, pg_dsn)
    proc = chaos.run_batch_process(file, bid, tmp_path / "job.log",
                                   env={FAULT_ENV: "kill_after_commit"})
    try:
        assert proc.wait(timeout=600) == -9, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            chaos.kill(proc)
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(bid).status != "committed"
    subject, sid = pinned(pg_dsn, bid) or ("", 0)
    newer = json.loads(_registry_schema(sid))
    newer["fields"].append({"name": "extra", "type": ["null", "string"], "default": None})
    from offsetflow.source import RegistryClient

    newer_id = RegistryClient(registry_url()).register(subject, json.dumps(newer))
    assert newer_id is not None and newer_id != sid
    res = run_batch(spark, cfg, bid, pg_dsn).result
    assert (res.status, res.rows_written) == ("committed", N)
    records = read_topic(kafka_bootstrap, out, "read_uncommitted")
    assert len(records) == N  # not produced again
    assert {s for s, _, _ in decoded(out, records)} == {sid}
    assert pinned(pg_dsn, bid) == (subject, sid)


def test_a_retry_writes_the_schema_id_the_batch_pinned_not_the_subjects_latest(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        source: Source) -> None:
    """An earlier attempt pinned id X (a pin is committed before anything is produced, so
    it outlives a failed attempt); a newer version is registered after it: the batch writes
    X, registers nothing, and its values read back with X."""
    from offsetflow.source import RegistryClient

    out = make_topic("kav-pin", 2)
    name = f"kavp_{unique}"
    cfg = pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap)
    bid = planned(cfg, pg_dsn)
    client = RegistryClient(registry_url())
    subject = f"{out}-value"
    first = {"type": "record", "name": "first", "fields": [
        {"name": "id", "type": ["null", "long"], "default": None},
        {"name": "name", "type": ["null", "string"], "default": None}]}
    pinned_id = client.register(subject, json.dumps(first))
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO offsetflow.output_schemas (batch_id, subject, schema_id) "
                    "VALUES (%s, %s, %s)", (bid, subject, pinned_id))
    conn.close()
    newer = {**first, "fields": [*first["fields"],
                                 {"name": "extra", "type": ["null", "int"], "default": None}]}
    newer_id = client.register(subject, json.dumps(newer))
    assert pinned_id is not None and newer_id not in (None, pinned_id)
    res = run_batch(spark, cfg, bid, pg_dsn).result
    assert (res.status, res.rows_written) == ("committed", N)
    got = list(decoded(out, read_topic(kafka_bootstrap, out)))
    assert {s for s, _, _ in got} == {pinned_id}
    assert {r.source[1:]: v for _, v, r in got} == {
        k: {"id": v["id"], "name": v["name"]} for k, v in source.values.items()}
    latest = client.subject_version(subject, None)
    assert latest is not None and latest.schema_id == newer_id  # nothing registered since


def test_a_config_change_accepted_after_a_pinned_attempt_writes_the_new_columns(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, unique: str, source: Source) -> None:
    """Attempt 1 pins the schema of value_columns [id, name] and fails before producing
    (its output topic is missing); the topic is created and value_columns widened, accepted
    with --accept-config-change: the records carry `price` under a schema that has it (the
    old pin would drop it from every record), the pin is the new schema's, and the old one
    is never written."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from offsetflow.errors import KafkaSinkError

    out = f"kav-cfg-{unique}"
    name = f"kavc_{unique}"
    narrow = pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap,
                      value_columns=["id", "name"])
    bid = planned(narrow, pg_dsn)
    with pytest.raises(KafkaSinkError, match="create it before"):
        run_batch(spark, narrow, bid, pg_dsn)
    first = pinned(pg_dsn, bid)
    assert first is not None  # committed on its own, before the topic was looked at
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(out, 2, 1)])[out].result(timeout=30)
    try:
        wide = pipeline(name, source.topic, out, pg_dsn, kafka_bootstrap,
                        value_columns=["id", "name", "price"])
        res = run_batch(spark, wide, bid, pg_dsn, accept_config_change=True).result
        assert (res.status, res.rows_written) == ("committed", N)
        got = list(decoded(out, read_topic(kafka_bootstrap, out)))
        assert {r.source[1:]: v for _, v, r in got} == {
            k: {"id": v["id"], "name": v["name"], "price": v["price"]}
            for k, v in source.values.items()}
        now = pinned(pg_dsn, bid)
        assert now is not None and now[1] != first[1]
        assert {s for s, _, _ in got} == {now[1]}
    finally:
        for f in admin.delete_topics([out]).values():
            f.result(timeout=30)


def test_two_attempts_offering_different_schemas_each_pin_and_write_their_own(
        pg_dsn: str, unique: str) -> None:
    """A zombie of the old config and a run of the new one pin at once (the pin is written
    outside the commit transaction): each gets its own schema's id, never the other's (the
    other's schema would null or drop its columns); the same schema pinned again keeps the
    first id."""
    from offsetflow.sinks.kafka.output_schema import pin_schema

    bid = -int(unique, 16) - 1  # no batch's: the pin has no foreign key (migration 0016)
    assert pin_schema(pg_dsn, bid, "s-value", 7, "old") == 7
    assert pin_schema(pg_dsn, bid, "s-value", 9, "new") == 9  # another schema: replaced
    assert pin_schema(pg_dsn, bid, "s-value", 11, "new") == 9  # the same schema: the first id
    assert pin_schema(pg_dsn, bid, "s-value", 7, "old") == 7  # the zombie again: its own
    assert pinned(pg_dsn, bid) == ("s-value", 7)
