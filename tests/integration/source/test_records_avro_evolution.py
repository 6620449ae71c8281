"""`format.schema_evolution` on real Kafka, Spark, PostgreSQL and the stack's registry:
records produced by confluent-kafka's `AvroSerializer` whose schema gains fields mid-range.

One topic, one pipeline (add_columns), batches in order (a module fixture):
  1. schema v1 only: the table gets v1's undeclared field as a column;
  2. v1 and v2 records in one batch (v2 adds two fields with defaults and widens one): its
     job is killed inside its commit, after the ALTER TABLE and before COMMIT; nothing is
     visible (no column, no row, no position); a version registered before the retry is
     not read (the batch's reader was pinned by its first run), and the retry commits both
     versions' rows once with the columns added (and widened) in its own transaction; the
     ledger records the reader and writer schema ids of the batch;
  3. v3 narrows a field: the batch stops with SchemaEvolutionError naming the ids, their
     versions and the first offset of v3; nothing written, positions unmoved; the way out
     it names (schema_evolution removed, the config change accepted) commits it once.
A second pipeline on the same topic with `schema_evolution: fail` stops on v1 -> v2.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import load_pipeline
from offsetflow.errors import SchemaEvolutionError, SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import format_status, pipeline_status, plan_only
from tests.tooling import chaos
from tests.tooling.pipeline_data import query

V1 = {"type": "record", "name": "Ev", "namespace": "offsetflow.test", "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "qty", "type": "int"}]}
V2 = {**V1, "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "qty", "type": "long"},  # widened
    {"name": "coupon", "type": ["null", "string"], "default": None},
    {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []}]}
V2B = {**V1, "fields": [*V2["fields"], {"name": "late", "type": ["null", "long"],
                                        "default": None}]}
V3 = {**V1, "fields": [*V2["fields"][:1], {"name": "qty", "type": "int"},  # narrowed
                       *V2["fields"][2:]]}
PARTITIONS = 2


def _serializer(url: str, schema: dict[str, Any]) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer

    return AvroSerializer(SchemaRegistryClient({"url": url}), json.dumps(schema),
                          conf={"auto.register.schemas": True})


def _register(url: str, topic: str, schema: dict[str, Any]) -> int:
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    return int(SchemaRegistryClient({"url": url}).register_schema(
        f"{topic}-value", Schema(json.dumps(schema), "AVRO")))


def _produce(bootstrap: str, url: str, topic: str, schema: dict[str, Any],
             records: list[dict[str, Any]]) -> int:
    """Produce `records` with `schema` (registered by the serializer); its schema id."""
    from confluent_kafka.serialization import MessageField, SerializationContext

    ser = _serializer(url, schema)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    sid = 0
    for r in records:
        value = ser(r, SerializationContext(topic, MessageField.VALUE))
        sid = int.from_bytes(value[1:5], "big")
        p.produce(topic, value, key=str(r["order_id"]).encode(),
                  partition=r["order_id"] % PARTITIONS)
    assert p.flush(30) == 0
    return sid


def _pipeline(tmp: Path, name: str, topic: str, dsn: str, bootstrap: str, url: str,
              policy: str) -> Path:
    raw = {"name": name, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": {"order_id": "long"},
                      "schema_evolution": policy, "schema_registry": {"url": url}},
           "sink": {"connection": dsn, "table": name},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]", "max_offsets_per_task": 4}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _columns(dsn: str, table: str) -> dict[str, str]:
    return dict(query(dsn, "SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_name = %s", (table,)))


def _positions(dsn: str, name: str) -> dict[tuple[str, int], int]:
    with Ledger(dsn) as ledger:
        return ledger.positions(name)


def _altered_in_open_transaction(dsn: str, table: str) -> bool:
    """An OffsetFlow backend holds the ACCESS EXCLUSIVE lock an ALTER TABLE takes on
    `table`, in a transaction not committed yet."""
    rows = query(dsn, """SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                          WHERE a.application_name = 'offsetflow'
                            AND l.relation = to_regclass(%s)
                            AND l.mode = 'AccessExclusiveLock' AND l.granted""", (table,))
    return bool(rows[0][0])


@pytest.fixture(scope="module")
def evolving(spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path_factory: Any
             ) -> dict[str, Any]:
    import os

    url = os.environ.get("OFFSETFLOW_SCHEMA_REGISTRY_URL")
    if not url:
        pytest.fail("OFFSETFLOW_SCHEMA_REGISTRY_URL is not set: start the stack's registry")
    tmp = tmp_path_factory.mktemp("evolution")
    topic = f"evo-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(timeout=30)
    name = f"evo_{uuid.uuid4().hex[:8]}"
    path = _pipeline(tmp, name, topic, pg_dsn, kafka_bootstrap, url, "add_columns")
    cfg = load_pipeline(path)
    v1 = _produce(kafka_bootstrap, url, topic, V1,
                  [{"order_id": i, "qty": i} for i in range(6)])
    first = plan_only(cfg, pg_dsn, started_by="test")
    assert first.batch is not None
    report = run_batch(spark, cfg, first.batch.batch_id, pg_dsn)
    return {"cfg": cfg, "path": path, "topic": topic, "name": name, "url": url, "v1": v1,
            "first": report, "tmp": tmp, "produced": {i: "v1" for i in range(6)}}


def test_first_schema_lands_its_undeclared_field_as_a_column(evolving: dict[str, Any],
                                                               pg_dsn: str) -> None:
    assert evolving["first"].result.status == "committed", evolving["first"].result
    cols = _columns(pg_dsn, evolving["name"])
    assert cols["order_id"] == "bigint" and cols["qty"] == "integer"
    assert sorted(query(pg_dsn, f"SELECT order_id, qty FROM {evolving['name']}")) == \
        [(i, i) for i in range(6)]


def test_new_schema_mid_batch_killed_between_alter_and_commit_then_commits_once(
        evolving: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    name, topic, url = evolving["name"], evolving["topic"], evolving["url"]
    # mid-range: v1 records, then v2 ones, in both partitions of one batch
    _produce(kafka_bootstrap, url, topic, V1, [{"order_id": i, "qty": i} for i in range(6, 10)])
    v2 = _produce(kafka_bootstrap, url, topic, V2,
                  [{"order_id": i, "qty": 2**40 + i, "coupon": f"c{i}" if i % 2 else None,
                    "tags": [f"t{i}"]} for i in range(10, 16)])
    evolving["v2"] = v2
    cfg = load_pipeline(evolving["path"])
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    bid = planned.batch.batch_id
    before = _positions(pg_dsn, name)
    log = evolving["tmp"] / "job.log"
    with chaos.hold_positions(pg_dsn, name):
        proc = chaos.run_batch_process(evolving["path"], bid, log)
        try:
            chaos.wait_for(lambda: chaos.commit_waiting(pg_dsn), 300,
                           "the commit to wait at its fence")
            # the ALTER ran in the commit's transaction, which waits at step 3 now
            assert _altered_in_open_transaction(pg_dsn, name), log.read_text()[-3000:]
        finally:
            chaos.kill(proc)
    # killed between the ALTER and the COMMIT: no column, no row, no position moved
    assert "coupon" not in _columns(pg_dsn, name)
    assert _columns(pg_dsn, name)["qty"] == "integer"
    assert query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 6
    assert _positions(pg_dsn, name) == before

    # a version registered between the kill and the retry does not change what the batch
    # reads: its first run pinned the reader schema (the stage it left is reused as is)
    _register(url, topic, V2B)
    again = run_batch(spark, cfg, bid, pg_dsn)
    assert again.result.status == "committed", again.result
    cols = _columns(pg_dsn, name)
    assert (cols["qty"], cols["coupon"], cols["tags"]) == ("bigint", "text", "jsonb")
    assert "late" not in cols
    rows = {r[0]: r[1:] for r in query(
        pg_dsn, f"SELECT order_id, qty, coupon, tags, _offsetflow_batch_id FROM {name}")}
    assert sorted(rows) == list(range(16))  # 0 lost
    assert query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 16  # 0 duplicated
    for i in range(6, 10):  # v1 records read with the v2 reader: its defaults
        assert rows[i][:3] == (i, None, []) and rows[i][3] == bid
    for i in range(10, 16):
        assert rows[i][:3] == (2**40 + i, f"c{i}" if i % 2 else None, [f"t{i}"])
    for i in range(6):  # batch 1's rows (v1, before the columns): as v2 reads v1, its defaults
        assert rows[i][:3] == (i, None, [])
    assert _positions(pg_dsn, name) == {(topic, p): n for p, n in (
        (p, sum(1 for i in range(16) if i % PARTITIONS == p)) for p in range(PARTITIONS))}
    # the ledger records the schema ids the batch read: the reader, each writer's first
    schemas = query(pg_dsn, "SELECT schemas FROM offsetflow.batches WHERE batch_id = %s",
                    (bid,))[0][0]
    assert schemas["readers"] == {topic: v2}
    writers = schemas["writers"][topic]
    assert set(writers) == {str(evolving["v1"]), str(v2)}
    assert writers[str(evolving["v1"])] == [0, 3]  # order 6 is partition 0's 4th record
    assert writers[str(v2)] == [0, 5]  # order 10: partition 0 after 0,2,4,6,8
    text = format_status(pipeline_status(cfg, pg_dsn))
    assert f"{topic}: read as {v2} ({topic}-value v2), written {evolving['v1']} " \
           f"({topic}-value v1, from [0]@3), {v2} ({topic}-value v2, from [0]@5)" in text, text


def test_narrowed_type_stops_the_batch_naming_ids_versions_and_first_offset(
        evolving: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    if "v2" not in evolving:
        pytest.skip("needs the v2 batch of the test before")
    name, topic, url = evolving["name"], evolving["topic"], evolving["url"]
    v3 = _produce(kafka_bootstrap, url, topic, V3,
                  [{"order_id": i, "qty": i, "coupon": None, "tags": []} for i in (16, 17)])
    cfg = load_pipeline(evolving["path"])
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    before = _positions(pg_dsn, name)
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    msg = str(e.value)
    assert f"schema id {v3} (version 4 of {topic}-value) cannot follow schema id " \
           f"{evolving['v2']} (version 2 of {topic}-value)" in msg, msg
    assert "field 'qty' changed from long to int (not a widening)" in msg, msg
    assert f"its first record in the batch is {topic}[0]@8" in msg, msg
    assert _positions(pg_dsn, name) == before
    assert query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 16
    with Ledger(pg_dsn) as ledger:
        batch = ledger.get_batch(planned.batch.batch_id)
    assert batch.status == "failed" and "cannot follow" in (batch.error or "")
    # the way out the error names: without schema_evolution, accepting the config change,
    # the batch commits once (the declared columns only; the evolved ones stay NULL)
    raw = yaml.safe_load(evolving["path"].read_text())
    del raw["format"]["schema_evolution"]
    plain = evolving["tmp"] / f"{name}_plain.yaml"
    plain.write_text(yaml.safe_dump(raw))
    out = run_batch(spark, load_pipeline(plain), planned.batch.batch_id, pg_dsn,
                    accept_config_change=True)
    assert out.result.status == "committed", out.result
    assert sorted(r[0] for r in query(pg_dsn, f"SELECT order_id FROM {name}")) == \
        list(range(18))
    assert query(pg_dsn, f"SELECT qty FROM {name} WHERE order_id = 16") == [(None,)]


def test_fail_policy_stops_on_an_added_field(evolving: dict[str, Any], pg_dsn: str,
                                             kafka_bootstrap: str, spark: Any) -> None:
    name = f"evofail_{uuid.uuid4().hex[:8]}"
    path = _pipeline(evolving["tmp"], name, evolving["topic"], pg_dsn, kafka_bootstrap,
                     evolving["url"], "fail")
    raw = yaml.safe_load(path.read_text())
    raw["source"]["max_records_per_partition"] = 6  # v1, then v2 from partition 0's @5
    path.write_text(yaml.safe_dump(raw))
    cfg = load_pipeline(path)
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    msg = str(e.value)
    assert "fields added ['coupon', 'tags']" in msg and "format.schema_evolution is fail" \
        in msg, msg
    assert f"its first record in the batch is {evolving['topic']}[0]@5" in msg, msg
    assert set(_positions(pg_dsn, name).values()) <= {0}  # unmoved from the start
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s)", (name,))
        row = cur.fetchone()
    # the table may exist (created empty before the read), but holds nothing
    if row and row[0]:
        assert query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 0


def test_a_column_added_by_hand_with_another_type_is_refused_before_reading(
        evolving: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    name = f"evohand_{uuid.uuid4().hex[:8]}"
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:  # public: the sink's schema
        cur.execute(f"""CREATE TABLE public.{name} (topic text, partition int, "offset" bigint,
                        "timestamp" timestamptz, timestamp_type int, key bytea, value bytea,
                        headers jsonb, order_id bigint, coupon bigint,
                        _offsetflow_batch_id bigint NOT NULL)""")
    conn.close()
    path = _pipeline(evolving["tmp"], name, evolving["topic"], pg_dsn, kafka_bootstrap,
                     evolving["url"], "add_columns")
    cfg = load_pipeline(path)
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    with pytest.raises(SchemaMismatchError) as e:
        run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert f"target table {name} has column 'coupon' of type bigint, but the reader " \
           f"schema's field 'coupon' needs text" in str(e.value), e.value
    assert query(pg_dsn, f"SELECT count(*) FROM public.{name}")[0][0] == 0
    assert "tags" not in _columns(pg_dsn, name)  # nothing of the evolution applied
    assert set(_positions(pg_dsn, name).values()) <= {0}
