"""`format.schema_evolution: add_columns` into an Iceberg table on real Kafka, Spark,
PostgreSQL (ledger and SQL catalog) and the stack's registry, records produced by
confluent-kafka's `AvroSerializer` (`sink_iceberg_evolve`).

One topic, one pipeline, batches in order (a module fixture):
  1. schema v1 only: the table is created with v1's undeclared field as a column;
  2. v1 and v2 records in one batch (v2 adds two fields with defaults and widens one):
     its first run dies after the tasks' files are written with the new field ids and the
     schema update is staged, before the catalog commit (the table is unchanged); its second
     run dies after the catalog commit, before the ledger's (the columns and the snapshot
     are there together, no position moved); the third run finds the snapshot and commits
     the ledger: every row once, the columns in the batch's own snapshot's schema;
  3. v3 narrows a field: the batch stops with SchemaEvolutionError naming the ids, their
     versions and the first offset of v3 before any catalog commit; table, schema and
     positions unmoved.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer

from offsetflow.config import SUMMARY_BATCH, load_pipeline
from offsetflow.errors import SchemaEvolutionError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from tests.tooling.iceberg_case import died_between_the_commits
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.registry_case import avro_serializer, encode, new_topic, registry_url

V1 = {"type": "record", "name": "IceEv", "namespace": "offsetflow.test", "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "qty", "type": "int"}]}
V2 = {**V1, "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "qty", "type": "long"},  # widened
    {"name": "coupon", "type": ["null", "string"], "default": None},
    {"name": "tags", "type": {"type": "array", "items": "string"}, "default": []}]}
V3 = {**V1, "fields": [*V2["fields"][:1], {"name": "qty", "type": "int"},  # narrowed
                       *V2["fields"][2:]]}
PARTITIONS = 2


def _produce(bootstrap: str, url: str, topic: str, schema: dict[str, Any],
             records: list[dict[str, Any]]) -> int:
    """`records` encoded with `schema` (registered by the serializer); its schema id."""
    ser = avro_serializer(url, schema)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    sid = 0
    for r in records:
        value = encode(ser, topic, r)
        sid = int.from_bytes(value[1:5], "big")
        p.produce(topic, value, partition=r["order_id"] % PARTITIONS)
    assert p.flush(30) == 0
    return sid


def _positions(dsn: str, name: str) -> dict[tuple[str, int], int]:
    with Ledger(dsn) as ledger:
        return ledger.positions(name)


def _plan(cfg: Any, dsn: str) -> int:
    planned = plan_only(cfg, dsn, started_by="test")
    assert planned.batch is not None
    return int(planned.batch.batch_id)


def _rows(cfg: Any, dsn: str) -> list[dict[str, Any]]:
    return iceberg_table(cfg, dsn).scan().to_arrow().to_pylist()


def _die(spark: Any, cfg: Any, bid: int, dsn: str, after: str) -> None:
    """Stop the batch in this process where a killed driver would (no job JVM of its own:
    seconds, not a minute); the sinks' SIGKILL at those points is
    `sinks/iceberg/test_sink_iceberg.py`'s."""
    died_between_the_commits(spark, cfg, bid, dsn, after)


@pytest.fixture(scope="module")
def evolving(spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path_factory: Any
             ) -> dict[str, Any]:
    url = registry_url()
    tmp = tmp_path_factory.mktemp("iceberg_evolution")
    topic = new_topic(kafka_bootstrap, "iceevo", PARTITIONS)
    name = f"iceevo_{uuid.uuid4().hex[:8]}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": {"order_id": "long"},
                      "schema_evolution": "add_columns", "schema_registry": {"url": url}},
           "sink": {"type": "iceberg", "connection": pg_dsn, "table": f"lake.{name}",
                    "catalog": {"warehouse": f"file://{tmp / 'warehouse'}"},
                    "partition_by": ["partition"]},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]", "max_offsets_per_task": 4}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_pipeline(path)
    v1 = _produce(kafka_bootstrap, url, topic, V1,
                  [{"order_id": i, "qty": i} for i in range(6)])
    first = _plan(cfg, pg_dsn)
    report = run_batch(spark, cfg, first, pg_dsn)
    return {"cfg": cfg, "path": path, "topic": topic, "name": name, "url": url, "v1": v1,
            "first": first, "report": report, "tmp": tmp}


def test_first_schema_creates_the_table_with_its_undeclared_field(
        evolving: dict[str, Any], pg_dsn: str) -> None:
    assert evolving["report"].result.status == "committed", evolving["report"].result
    table = iceberg_table(evolving["cfg"], pg_dsn)
    assert str(table.schema().find_field("qty").field_type) == "int"
    assert sorted((r["order_id"], r["qty"]) for r in _rows(evolving["cfg"], pg_dsn)) == \
        [(i, i) for i in range(6)]


def test_new_schema_mid_batch_commits_its_columns_with_the_snapshot_once_across_kills(
        evolving: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    cfg, name, topic, url = (evolving[k] for k in ("cfg", "name", "topic", "url"))
    _produce(kafka_bootstrap, url, topic, V1, [{"order_id": i, "qty": i} for i in range(6, 10)])
    v2 = _produce(kafka_bootstrap, url, topic, V2,
                  [{"order_id": i, "qty": 2**40 + i, "coupon": f"c{i}" if i % 2 else None,
                    "tags": [f"t{i}"]} for i in range(10, 16)])
    evolving["v2"] = v2
    bid = _plan(cfg, pg_dsn)
    before = _positions(pg_dsn, name)
    schema_before = iceberg_table(cfg, pg_dsn).schema()

    # 1. dies with the files written (new field ids) and the schema update staged, before
    # the catalog commit: the table is as it was
    _die(spark, cfg, bid, pg_dsn, "files")
    table = iceberg_table(cfg, pg_dsn)
    assert table.schema() == schema_before
    assert snapshot_batches(cfg, pg_dsn) == [evolving["first"]]
    assert _positions(pg_dsn, name) == before

    # 2. dies after the catalog commit (schema update and snapshot in one), before the
    # ledger's: both are there, no position moved
    _die(spark, cfg, bid, pg_dsn, "iceberg")
    table = iceberg_table(cfg, pg_dsn)
    assert snapshot_batches(cfg, pg_dsn) == [evolving["first"], bid]
    assert str(table.schema().find_field("qty").field_type) == "long"
    assert table.current_snapshot().schema_id == table.schema().schema_id
    assert _positions(pg_dsn, name) == before
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(bid).status != "committed"

    # 3. the retry finds the batch's snapshot and commits the ledger: nothing appended again
    again = run_batch(spark, cfg, bid, pg_dsn)
    assert again.result.status == "committed", again.result
    assert snapshot_batches(cfg, pg_dsn) == [evolving["first"], bid]
    table = iceberg_table(cfg, pg_dsn)
    fields = {f.name: str(f.field_type) for f in table.schema().fields}
    # tags (an Avro array of strings declared nowhere): added as its list type
    assert (fields["qty"], fields["coupon"], fields["tags"]) == ("long", "string",
                                                                 "list<string>")
    # the batch's own snapshot has the schema with the columns; batch 1's has not
    snaps = {int(s.summary.additional_properties[SUMMARY_BATCH]): s
             for s in table.snapshots() if s.summary and
             SUMMARY_BATCH in s.summary.additional_properties}
    schemas = {s.schema_id: s for s in table.schemas().values()}
    assert "coupon" in schemas[snaps[bid].schema_id].column_names
    assert "coupon" not in schemas[snaps[evolving["first"]].schema_id].column_names
    rows = {r["order_id"]: r for r in _rows(cfg, pg_dsn)}
    assert sorted(rows) == list(range(16))  # 0 lost
    assert len(_rows(cfg, pg_dsn)) == 16  # 0 duplicated
    for i in range(6):  # batch 1's rows: Iceberg v2 has no initial default, so null
        assert (rows[i]["qty"], rows[i]["coupon"], rows[i]["tags"]) == (i, None, None)
    for i in range(6, 10):  # v1 records read with the v2 reader: its defaults
        assert (rows[i]["qty"], rows[i]["coupon"], rows[i]["tags"]) == (i, None, [])
        assert rows[i]["_offsetflow_batch_id"] == bid
    for i in range(10, 16):
        assert (rows[i]["qty"], rows[i]["coupon"], rows[i]["tags"]) == \
            (2**40 + i, f"c{i}" if i % 2 else None, [f"t{i}"])
    assert _positions(pg_dsn, name) == {(topic, p): sum(
        1 for i in range(16) if i % PARTITIONS == p) for p in range(PARTITIONS)}


def test_narrowed_type_stops_the_batch_before_the_catalog_commit(
        evolving: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    if "v2" not in evolving:
        pytest.skip("needs the v2 batch of the test before")
    cfg, name, topic, url = (evolving[k] for k in ("cfg", "name", "topic", "url"))
    v3 = _produce(kafka_bootstrap, url, topic, V3,
                  [{"order_id": i, "qty": i, "coupon": None, "tags": []} for i in (16, 17)])
    bid = _plan(cfg, pg_dsn)
    before = _positions(pg_dsn, name)
    table = iceberg_table(cfg, pg_dsn)
    schema, snapshot = table.schema(), table.current_snapshot().snapshot_id
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, cfg, bid, pg_dsn)
    msg = str(e.value)
    assert f"schema id {v3} (version 3 of {topic}-value) cannot follow schema id " \
           f"{evolving['v2']} (version 2 of {topic}-value)" in msg, msg
    assert "field 'qty' changed from long to int (not a widening)" in msg, msg
    assert f"its first record in the batch is {topic}[0]@8" in msg, msg
    table = iceberg_table(cfg, pg_dsn)
    assert table.schema() == schema and table.current_snapshot().snapshot_id == snapshot
    assert _positions(pg_dsn, name) == before
    assert len(_rows(cfg, pg_dsn)) == 16


def test_audited_replay_never_changes_mains_schema(
        pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any) -> None:
    """An Iceberg schema is table-wide: a schema update committed with the audit branch's
    snapshot would be main's current schema at once (seen by readers and the live pipeline
    before publish, kept after a discard). The audited window whose reader schema would
    evolve the table stops before its tasks write; main's schema and rows are untouched."""
    from offsetflow.ops import kafka_for, plan_window, submit_window
    from offsetflow.plan import parse_request

    url = registry_url()
    topic = new_topic(kafka_bootstrap, "iceevoaud", 1)
    name = f"iceevoaud_{uuid.uuid4().hex[:8]}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": {"order_id": "long"},
                      "schema_evolution": "add_columns", "schema_registry": {"url": url}},
           "sink": {"type": "iceberg", "connection": pg_dsn, "table": f"lake.{name}",
                    "catalog": {"warehouse": f"file://{tmp_path / 'warehouse'}"}},
           "spark": {"master": "local[2]"}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_pipeline(path)
    ser = avro_serializer(url, V1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(4):
        p.produce(topic, encode(ser, topic, {"order_id": i, "qty": i}), partition=0)
    assert p.flush(30) == 0
    live = run_batch(spark, cfg, _plan(cfg, pg_dsn), pg_dsn)
    assert live.result.status == "committed", live.result
    # v2 registered (its records not read yet): the audited window's reader schema
    ser2 = avro_serializer(url, V2)
    p.produce(topic, encode(ser2, topic, {"order_id": 9, "qty": 9, "coupon": "c",
                                          "tags": []}), partition=0)
    assert p.flush(30) == 0
    table = iceberg_table(cfg, pg_dsn)
    schema, head = table.schema(), table.current_snapshot().snapshot_id
    req = parse_request("replay", {"pipeline": name, "topic": topic, "from_offset": 0,
                                   "until_offset": 4, "audit": True})
    with Ledger(pg_dsn) as ledger:
        [bid] = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req),
                              "test")
    err: Exception | None = None
    try:
        run_batch(spark, cfg, bid, pg_dsn)
    except SchemaEvolutionError as e:
        err = e
    table = iceberg_table(cfg, pg_dsn)
    assert [f.name for f in table.schema().fields] == [f.name for f in schema.fields], \
        f"main's schema changed by an audited window: {table.schema()}"
    assert table.current_snapshot().snapshot_id == head
    assert err is not None and "table-wide" in str(err) and "'coupon'" in str(err), err
