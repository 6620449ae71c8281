"""`format.schema_evolution: add_columns` into Iceberg beyond Avro appends: Protobuf and JSON
Schema values into an append table, and an upsert table (Avro), on real Kafka, Spark,
PostgreSQL (ledger and SQL catalog) and the stack's registry, records encoded by
confluent-kafka's real serializers (`sink_iceberg_evolve`, `sink_iceberg_upsert`).

One topic and pipeline per case (a module fixture: its first batch, schema v1 only, makes
the table with v1's undeclared field `qty` as a column), then in order:
  1. v1 and v2 records in one batch (v2 adds `coupon`; Avro and Protobuf also widen `qty`
     int -> long): its first run dies after the catalog commit, before the ledger's (the
     column and the batch's snapshot are there together, no position moved); the retry
     finds the snapshot and commits the ledger: every row once (upsert: each key's last
     record), `coupon` in the batch's own snapshot's schema;
  2. v3, a change that cannot be made: Protobuf narrows `qty` (SchemaEvolutionError, before
     the catalog commit); JSON Schema's integer -> number and Avro's long -> double are
     long -> double in Iceberg, which it cannot promote (SchemaMismatchError naming the way
     out, on the driver before the tasks read: no stage table); table and positions unmoved.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from google.protobuf import descriptor_pb2

from offsetflow.config import SUMMARY_BATCH, load_pipeline
from offsetflow.errors import SchemaEvolutionError, SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling.iceberg_case import died_between_the_commits
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import (
    avro_serializer,
    dynamic_message_classes,
    encode,
    json_serializer,
    new_topic,
    plan_batch,
    protobuf_serializer,
    registry_url,
)

PARTITIONS = 2
FD = descriptor_pb2.FieldDescriptorProto

# Avro: v2 adds coupon and widens qty; v3 makes qty a double (an Avro promotion of long)
A_V1: dict[str, Any] = {
    "type": "record", "name": "IceEvF", "namespace": "offsetflow.test",
    "fields": [{"name": "order_id", "type": "long"}, {"name": "qty", "type": "int"}]}
A_V2: dict[str, Any] = {**A_V1, "fields": [
    {"name": "order_id", "type": "long"}, {"name": "qty", "type": "long"},
    {"name": "coupon", "type": ["null", "string"], "default": None}]}
A_V3: dict[str, Any] = {**A_V1, "fields": [
    A_V2["fields"][0], {"name": "qty", "type": "double"}, A_V2["fields"][2]]}
# JSON Schema: v2 adds coupon; v3 makes qty a number (integer -> number)
J_V1: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#", "title": "IceEvF",
    "type": "object", "properties": {"order_id": {"type": "integer"},
                                     "qty": {"type": "integer"}},
    "required": ["order_id", "qty"]}
J_V2: dict[str, Any] = {**J_V1, "properties": {**J_V1["properties"],
                                               "coupon": {"type": ["null", "string"]}}}
J_V3: dict[str, Any] = {**J_V2, "properties": {**J_V2["properties"],
                                               "qty": {"type": "number"}}}


def _order_file(qty_type: int, coupon: bool) -> Any:
    f = descriptor_pb2.FileDescriptorProto(name="offsetflow_iceevf_order.proto",
                                           package="offsetflow.iceevf", syntax="proto3")
    m = f.message_type.add(name="Order")
    m.field.add(name="order_id", number=1, type=FD.TYPE_INT64, label=FD.LABEL_OPTIONAL)
    m.field.add(name="qty", number=2, type=qty_type, label=FD.LABEL_OPTIONAL)
    if coupon:
        m.field.add(name="coupon", number=3, type=FD.TYPE_STRING, label=FD.LABEL_OPTIONAL)
    return f


# Protobuf: v2 adds coupon and widens qty int32 -> int64; v3 narrows it back
P_VERSIONS = {1: (FD.TYPE_INT32, False), 2: (FD.TYPE_INT64, True), 3: (FD.TYPE_INT32, True)}


def _encoder(fmt: str, url: str, version: int) -> Callable[[str, dict[str, Any]], bytes]:
    """Records of `version` as the format's real serializer writes them (registering it)."""
    if fmt == "avro":
        ser = avro_serializer(url, {1: A_V1, 2: A_V2, 3: A_V3}[version])
        return lambda topic, r: encode(ser, topic, r)
    if fmt == "json_schema":
        ser = json_serializer(url, {1: J_V1, 2: J_V2, 3: J_V3}[version])
        return lambda topic, r: encode(ser, topic, r)
    cls = dynamic_message_classes(_order_file(*P_VERSIONS[version]))["Order"]
    ser = protobuf_serializer(url, cls)
    return lambda topic, r: encode(ser, topic, cls(**{k: v for k, v in r.items()
                                                      if v is not None}))


def _produce(case: dict[str, Any], version: int, records: list[dict[str, Any]]) -> None:
    """`records` of schema `version` to the case's topic (partition: order_id % 2); each
    is remembered as produced, in order."""
    from confluent_kafka import Producer

    enc = _encoder(case["fmt"], case["url"], version)
    p = Producer({"bootstrap.servers": case["bootstrap"], "linger.ms": 5})
    for r in records:
        p.produce(case["topic"], enc(case["topic"], r), partition=r["order_id"] % PARTITIONS)
    assert p.flush(30) == 0
    case["produced"].extend(records)


def _positions(dsn: str, name: str) -> dict[tuple[str, int], int]:
    with Ledger(dsn) as ledger:
        return ledger.positions(name)


def _rows(cfg: Any, dsn: str) -> list[dict[str, Any]]:
    return iceberg_table(cfg, dsn).scan().to_arrow().to_pylist()


def _values(cfg: Any, dsn: str) -> list[tuple[int, int, str | None]]:
    return sorted((r["order_id"], r["qty"], r["coupon"]) for r in _rows(cfg, dsn))


CASES = ["protobuf-append", "json_schema-append", "avro-upsert"]


@pytest.fixture(scope="module", params=CASES)
def case(request: Any, spark: Any, pg_dsn: str, kafka_bootstrap: str,
         tmp_path_factory: Any) -> dict[str, Any]:
    fmt, mode = request.param.split("-")
    url = registry_url()
    tmp = tmp_path_factory.mktemp(f"iceberg_evolution_{fmt}_{mode}")
    topic = new_topic(kafka_bootstrap, f"iceevf-{fmt[:4]}-{mode[:2]}", PARTITIONS)
    name = f"iceevf_{fmt[:4]}_{mode[:2]}_{uuid.uuid4().hex[:8]}"
    sink: dict[str, Any] = {"type": "iceberg", "connection": pg_dsn, "table": f"lake.{name}",
                            "catalog": {"warehouse": f"file://{tmp / 'warehouse'}"},
                            "partition_by": ["partition"]}
    if mode == "upsert":
        sink.update(mode="upsert", key=["order_id"])
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": fmt, "schema": {"order_id": "long"},
                      "schema_evolution": "add_columns", "schema_registry": {"url": url}},
           "sink": sink, "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]", "max_offsets_per_task": 4}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_pipeline(path)  # main: refused here, by name
    c: dict[str, Any] = {"fmt": fmt, "mode": mode, "cfg": cfg, "name": name, "topic": topic,
                         "url": url, "bootstrap": kafka_bootstrap, "produced": []}
    # qty from 1: proto3 does not write a zero, which reads back as no value
    _produce(c, 1, [{"order_id": i, "qty": i} for i in range(1, 7)])
    c["first"] = plan_batch(cfg, pg_dsn)
    report = run_batch(spark, cfg, c["first"], pg_dsn)
    assert report.result.status == "committed", report.result
    table = iceberg_table(cfg, pg_dsn)
    assert str(table.schema().find_field("qty").field_type) == \
        ("int" if fmt in ("avro", "protobuf") else "long")
    assert "coupon" not in table.schema().column_names
    return c


def test_two_schema_versions_in_one_batch_commit_the_column_with_the_snapshot_once(
        case: dict[str, Any], pg_dsn: str, spark: Any) -> None:
    cfg, name, topic, mode = (case[k] for k in ("cfg", "name", "topic", "mode"))
    _produce(case, 1, [{"order_id": i, "qty": i} for i in (7, 8)])
    # upsert: v2 records replace keys of the first batch (4, 5) and of this one's v1 (8)
    v2_ids = [4, 5, 8, 9] if mode == "upsert" else [9, 10, 11, 12]
    _produce(case, 2, [{"order_id": i, "qty": 2**40 + i, "coupon": f"c{i}"} for i in v2_ids])
    bid = plan_batch(cfg, pg_dsn)
    before = _positions(pg_dsn, name)

    # dies after the catalog commit (schema update and snapshot in one), before the
    # ledger's: both are there, no position moved
    died_between_the_commits(spark, cfg, bid, pg_dsn, "iceberg")
    table = iceberg_table(cfg, pg_dsn)
    assert snapshot_batches(cfg, pg_dsn) == [case["first"], bid]
    assert "coupon" in table.schema().column_names
    assert table.current_snapshot().schema_id == table.schema().schema_id
    assert _positions(pg_dsn, name) == before
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(bid).status != "committed"

    # the retry finds the batch's snapshot and commits the ledger: nothing written again
    again = run_batch(spark, cfg, bid, pg_dsn)
    assert again.result.status == "committed", again.result
    assert snapshot_batches(cfg, pg_dsn) == [case["first"], bid]
    table = iceberg_table(cfg, pg_dsn)
    fields = {f.name: str(f.field_type) for f in table.schema().fields}
    assert (fields["qty"], fields["coupon"]) == ("long", "string"), fields
    snaps = {int(s.summary.additional_properties[SUMMARY_BATCH]): s
             for s in table.snapshots() if s.summary and
             SUMMARY_BATCH in s.summary.additional_properties}
    schemas = {s.schema_id: s for s in table.schemas().values()}
    assert "coupon" in schemas[snaps[bid].schema_id].column_names
    assert "coupon" not in schemas[snaps[case["first"]].schema_id].column_names

    rows = _rows(cfg, pg_dsn)
    got = _values(cfg, pg_dsn)
    want: dict[int, tuple[int, int, str | None]] = {}
    for r in case["produced"]:  # upsert: a key's last record wins (one partition per key)
        want[r["order_id"]] = (r["order_id"], r["qty"], r.get("coupon"))
    assert got == sorted(want.values())  # 0 lost, 0 duplicated
    if mode == "append":
        assert len(rows) == len(case["produced"])
    assert _positions(pg_dsn, name) == {(topic, p): sum(
        1 for r in case["produced"] if r["order_id"] % PARTITIONS == p)
        for p in range(PARTITIONS)}
    case["second"] = bid


def test_a_change_iceberg_or_the_format_cannot_make_stops_with_nothing_moved(
        case: dict[str, Any], pg_dsn: str, spark: Any) -> None:
    if "second" not in case:
        pytest.skip("needs the v2 batch of the test before")
    cfg, name, topic, fmt = (case[k] for k in ("cfg", "name", "topic", "fmt"))
    produced = len(case["produced"])
    _produce(case, 3, [{"order_id": i, "qty": i if fmt == "protobuf" else i + 0.5,
                        "coupon": None} for i in (20, 21)])
    bid = plan_batch(cfg, pg_dsn)
    before = _positions(pg_dsn, name)
    table = iceberg_table(cfg, pg_dsn)
    schema, snapshot = table.schema(), table.current_snapshot().snapshot_id
    rows = _values(cfg, pg_dsn)
    want: type[Exception] = SchemaEvolutionError if fmt == "protobuf" else SchemaMismatchError
    with pytest.raises(want) as e:
        run_batch(spark, cfg, bid, pg_dsn)
    msg = str(e.value)
    if fmt == "protobuf":  # the format's rule, checked once the records' ids are known
        assert "field 'qty' changed from int64 to int32 (not a widening)" in msg, msg
        assert f"its first record in the batch is {topic}[" in msg, msg
    else:  # long -> double: Iceberg's rule, on the driver before the tasks read
        assert f"Iceberg table lake.{name} has column 'qty' of type long, but the reader " \
               f"schema's field 'qty' needs double" in msg, msg
        assert "rename or drop the column" in msg, msg
        assert query(pg_dsn, "SELECT to_regclass(%s)", (f"offsetflow_stage.b{bid}",)
                     )[0][0] is None  # the stage is made after this check
    table = iceberg_table(cfg, pg_dsn)
    assert table.schema() == schema and table.current_snapshot().snapshot_id == snapshot
    assert _positions(pg_dsn, name) == before
    assert _values(cfg, pg_dsn) == rows
    del case["produced"][produced:]
