"""`format.key: {type: avro}` on real Kafka, Spark and PostgreSQL: upsert keys come from the
fields of a Confluent wire-format Avro key (subject `<topic>-key`), records and keys both
produced by confluent-kafka's real `AvroSerializer`. The key's fields are not in the value:
only the key can key the rows. Two batches: the first inserts, the second updates, inserts
and deletes with a tombstone whose only key is the Avro one; the final rows are right, each
once, and running a committed batch again changes nothing. Poison keys (not in the wire
format, an unknown id, truncated) are dead letters with their coordinates, like poison
values. A retry reads the keys with the key reader schema its first run pinned, not a key
version registered since."""

from __future__ import annotations

import json
from typing import Any

import psycopg2
import pytest
from confluent_kafka import Producer

from offsetflow.config import parse_pipeline
from offsetflow.errors import SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import avro_serializer, encode, new_topic, registry_url

KEY_SCHEMA = {"type": "record", "name": "OrderKey", "namespace": "offsetflow.test",
              "fields": [{"name": "order_id", "type": "long"},
                         {"name": "region", "type": "string"}]}
VALUE_SCHEMA = {"type": "record", "name": "OrderState", "namespace": "offsetflow.test",
                "fields": [{"name": "status", "type": "string"},
                           {"name": "amount", "type": "long"}]}
COLUMNS = {"order_id": "long", "region": "string", "status": "string", "amount": "long"}


def _config(topic: str, dsn: str, bootstrap: str, table: str, url: str) -> Any:
    return parse_pipeline({
        "name": table, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "avro", "key": {"type": "avro"}, "schema": dict(COLUMNS),
                   "schema_registry": {"url": url}},
        "sink": {"connection": dsn, "table": table, "mode": "upsert",
                 "key": ["order_id", "region"]},
        "bad_records": "dead_letter", "dead_letter_table": f"dl_{table}",
        "spark": {"master": "local[2]", "max_offsets_per_task": 4}}, f"<test {table}>", {})


def _batch(spark: Any, cfg: Any, dsn: str) -> int:
    planned = plan_only(cfg, dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, dsn)
    assert report.result.status == "committed", report.result
    return planned.batch.batch_id


@pytest.fixture(scope="module")
def keyed(spark: Any, pg_dsn: str, kafka_bootstrap: str) -> dict[str, Any]:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "avro-keys")
    kser, vser = avro_serializer(url, KEY_SCHEMA), avro_serializer(url, VALUE_SCHEMA)

    def key(order_id: int, region: str) -> bytes:
        return encode(kser, topic, {"order_id": order_id, "region": region}, key=True)

    def value(status: str, amount: int) -> bytes:
        return encode(vser, topic, {"status": status, "amount": amount})

    good_key = key(7, "eu")
    key_id = int.from_bytes(good_key[1:5], "big")
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})

    def send(records: list[tuple[bytes, bytes | None]]) -> None:
        for k, v in records:  # one key, one partition: its records keep their order
            p.produce(topic, v, key=k, partition=k[-1] % 2)
        assert p.flush(30) == 0

    table = f"avro_keys_{topic[-8:]}"
    cfg = _config(topic, pg_dsn, kafka_bootstrap, table, url)
    send([(key(1, "eu"), value("NEW", 10)), (key(2, "eu"), value("NEW", 20)),
          (key(1, "us"), value("NEW", 30))])
    _batch(spark, cfg, pg_dsn)
    first = query(pg_dsn, f"SELECT order_id, region, status, amount FROM {table} ORDER BY 1, 2")
    poison = {  # key -> what its dead letter's reason must say
        b"plain-key": "key: not in the Confluent wire format",
        b"\x00" + (10**9).to_bytes(4, "big") + good_key[5:]:
            "key: schema id 1000000000: unknown schema id 1000000000",
        good_key[:-3]: f"key: schema id {key_id}: payload does not decode",
    }
    send([(key(1, "eu"), value("PAID", 11)), (key(2, "eu"), None),  # a tombstone
          (key(3, "eu"), value("NEW", 40)), (key(3, "eu"), value("SHIPPED", 41)),
          *((k, value("POISON", -1)) for k in poison),
          (b"\x00" + (10**9).to_bytes(4, "big") + good_key[5:] + b"!", None)])  # poison tomb
    poison[b"\x00" + (10**9).to_bytes(4, "big") + good_key[5:] + b"!"] = \
        "key: schema id 1000000000: unknown schema id"
    second = _batch(spark, cfg, pg_dsn)
    return {"cfg": cfg, "table": table, "first": first, "second": second, "poison": poison,
            "topic": topic}


def test_avro_keys_drive_upsert_and_a_tombstone_deletes_by_them(
        keyed: dict[str, Any], spark: Any, pg_dsn: str) -> None:
    table = keyed["table"]
    assert keyed["first"] == [(1, "eu", "NEW", 10), (1, "us", "NEW", 30), (2, "eu", "NEW", 20)]
    final = [(1, "eu", "PAID", 11), (1, "us", "NEW", 30), (3, "eu", "SHIPPED", 41)]
    got = query(pg_dsn, f"SELECT order_id, region, status, amount FROM {table} ORDER BY 1, 2")
    assert got == final
    again = run_batch(spark, keyed["cfg"], keyed["second"], pg_dsn)  # a no-op
    assert again.result.status == "already_committed"
    assert query(pg_dsn, f"SELECT order_id, region, status, amount FROM {table} "
                         f"ORDER BY 1, 2") == final


def test_poison_avro_keys_are_dead_letters_with_coordinates(keyed: dict[str, Any],
                                                            pg_dsn: str) -> None:
    dead = {bytes(k): (t, p, o, err) for t, p, o, k, err in query(
        pg_dsn, f'SELECT topic, partition, "offset", key, error FROM dl_{keyed["table"]}')}
    assert set(dead) == set(keyed["poison"])
    for k, why in keyed["poison"].items():
        topic, part, offset, err = dead[k]
        assert (topic, part) == (keyed["topic"], k[-1] % 2) and offset >= 0
        assert why in err, (k, err)
    assert not query(pg_dsn, f"SELECT 1 FROM {keyed['table']} WHERE status = 'POISON'")


KEY_V1 = {"type": "record", "name": "PinKey", "namespace": "offsetflow.test",
          "fields": [{"name": "order_id", "type": "long"}]}
# a key version registered between a failed run and its retry: read with it, every key
# would fill `region` with its default, over the value's
KEY_V2 = {**KEY_V1, "fields": [*KEY_V1["fields"],
                               {"name": "region", "type": "string", "default": "zz"}]}
PIN_VALUE = {"type": "record", "name": "PinValue", "namespace": "offsetflow.test",
             "fields": [{"name": "region", "type": "string"},
                        {"name": "status", "type": "string"}]}


def test_a_retry_reads_keys_with_the_key_schema_its_first_run_pinned(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    url = registry_url()
    topic = new_topic(kafka_bootstrap, "avro-keypin")
    kser, vser = avro_serializer(url, KEY_V1), avro_serializer(url, PIN_VALUE)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for oid, region in ((1, "eu"), (2, "us")):
        k = encode(kser, topic, {"order_id": oid}, key=True)
        p.produce(topic, encode(vser, topic, {"region": region, "status": "NEW"}), key=k,
                  partition=oid % 2)
    assert p.flush(30) == 0
    v1 = int.from_bytes(k[1:5], "big")
    table = f"avro_keypin_{topic[-8:]}"
    cfg = parse_pipeline({
        "name": table, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "avro", "key": {"type": "avro"},
                   "schema": {"order_id": "long", "region": "string", "status": "string"},
                   "schema_registry": {"url": url}},
        "sink": {"connection": pg_dsn, "table": table, "mode": "upsert",
                 "key": ["order_id", "region"]},
        "spark": {"master": "local[2]"}}, f"<test {table}>", {})
    # the first run resolves (and pins) its reader schemas, then stops before reading:
    # the target holds rows its upsert key index cannot be built over
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"""CREATE TABLE public.{table} (topic text, partition int,
                        "offset" bigint, "timestamp" timestamptz, timestamp_type int,
                        key bytea, value bytea, headers jsonb, order_id bigint, region text,
                        status text, _offsetflow_batch_id bigint NOT NULL)""")
        cur.execute(f"""INSERT INTO public.{table} (order_id, region, _offsetflow_batch_id)
                        VALUES (9, 'x', 0), (9, 'x', 0)""")
    conn.close()
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    bid = planned.batch.batch_id
    with pytest.raises(SchemaMismatchError, match="no unique index"):
        run_batch(spark, cfg, bid, pg_dsn)

    SchemaRegistryClient({"url": url}).register_schema(f"{topic}-key",
                                                       Schema(json.dumps(KEY_V2), "AVRO"))
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"DELETE FROM public.{table}")
    conn.close()
    report = run_batch(spark, cfg, bid, pg_dsn)
    assert report.result.status == "committed", report.result
    # read as the first run would have: the region is the value's, not KEY_V2's default
    assert query(pg_dsn, f"SELECT order_id, region, status FROM {table} ORDER BY 1") == \
        [(1, "eu", "NEW"), (2, "us", "NEW")]
    assert query(pg_dsn, "SELECT key_reader_schemas FROM offsetflow.batches "
                         "WHERE batch_id = %s", (bid,))[0][0] == {topic: v1}
