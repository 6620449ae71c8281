"""Nested Avro values in Iceberg tables the STAGE PATH creates (a transform, `mode:
upsert`: the tasks stage into PostgreSQL and the driver writes the files), and a `json`
field that `format.schema_evolution: add_columns` adds to an existing table
(`sink_iceberg_nested`, `sink_iceberg_evolve`).

Real Kafka, Spark, PostgreSQL (ledger and SQL catalog) and the stack's registry; records
from confluent-kafka's `AvroSerializer`. One topic (a module fixture) read by two pipelines
that each create their table: an append through a transform, and an upsert on `order_id`
whose driver dies after its catalog commit, before the ledger's, and is retried. Both
tables get struct / list / map columns (the key stays a plain column), every value reads
back as produced, and the record whose decimal does not fit is a dead letter alone (the
upsert's key keeps its previous version): 0 lost, 0 duplicated across the kill.

And (a file of its own before): nested values on the stage path (a transform, a quality
suite: the driver reads the stage and writes the files) into a table whose columns are
struct / list / map, across a kill between the Iceberg commit and the ledger commit
(`sink_iceberg_nested`). Real Kafka, Spark, PostgreSQL (ledger and SQL catalog) and the
stack's registry. Pipeline A (the task-files path) makes the table from the Avro reader
schema, so its nested columns are typed; pipeline B appends to the same table through a
transform. B's batch holds a record whose decimal inside a list does not fit its column: the
commit makes it a dead letter. B's driver dies after the catalog commit, before the
ledger's: the retry finds the snapshot and must route that record again (the first attempt's
dead letter rolled back with the ledger), else it is in neither the table nor the dead
letters.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import pytest

from offsetflow.config import SUMMARY_BATCH
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling import chaos
from tests.tooling.iceberg_case import died_between_the_commits
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.nested_case import iceberg_pipeline, wide_decimal
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    new_topic,
    plan_batch,
    produce,
    registry_url,
)

ADDRESS = {"type": "record", "name": "CAddress", "fields": [
    {"name": "street", "type": "string"},
    {"name": "zip", "type": ["null", "int"], "default": None}]}
LINE = {"type": "record", "name": "CLine", "fields": [
    {"name": "sku", "type": "string"},
    {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9,
                               "scale": 2}}]}
SCHEMA = {"type": "record", "name": "CreatedOrder", "namespace": "offsetflow.test",
          "fields": [{"name": "order_id", "type": "long"},
                     {"name": "address", "type": ADDRESS},
                     {"name": "lines", "type": {"type": "array", "items": LINE}},
                     {"name": "tags", "type": {"type": "map", "values": ["null", "double"]}}]}
COLUMNS = {"order_id": "long", "address": "json", "lines": "json", "tags": "json"}
# (order_id, version) per offset; offset 3 is the poison record (order 2's latest)
OFFSETS = [(1, 0), (2, 0), (1, 1), (2, 9), (3, 0)]
POISON = 3


def _order(i: int, v: int) -> dict[str, Any]:
    return {"order_id": i, "address": {"street": f"street {i}.{v}", "zip": None if i % 2
                                       else 1000 + i},
            "lines": [{"sku": f"s{i}{j}", "price": Decimal(f"{i}{j}.{v}5")}
                      for j in range(i)],
            "tags": {"w": i / 4 + v, "none": None} if i % 2 else {}}


def _as_read(i: int, v: int) -> dict[str, Any]:
    """`_order` as pyiceberg reads it back (a map as its pairs)."""
    o = _order(i, v)
    return {**o, "tags": sorted(o["tags"].items())}


def _read(row: dict[str, Any]) -> dict[str, Any]:
    return {"order_id": row["order_id"], "address": row["address"], "lines": row["lines"],
            "tags": sorted(row["tags"])}


def _poison(sid: int) -> bytes:
    """Order 2 of schema `sid` whose price has 12 digits before the point where the schema
    says decimal(9,2) (`wide_decimal`)."""
    return wide_decimal(SCHEMA, {**_order(2, 9), "lines": [
        {"sku": "x", "price": Decimal("123456789012.50")}]}, sid)


def _pipeline(tmp: Any, dsn: str, bootstrap: str, topic: str, prefix: str,
              fmt: dict[str, Any] | None = None, **extra: Any) -> Any:
    return iceberg_pipeline(tmp, dsn, bootstrap, topic, COLUMNS, prefix=prefix,
                            format=fmt or {}, **extra)


@pytest.fixture(scope="module")
def created(spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path_factory: Any
            ) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("iceberg_nested_created")
    topic = new_topic(kafka_bootstrap, "icenestcr", 1)
    ser = avro_serializer(registry_url(), SCHEMA)
    sid = int.from_bytes(encode(ser, topic, _order(1, 0))[1:5], "big")
    produce(kafka_bootstrap, topic, [_poison(sid) if n == POISON else
                                     encode(ser, topic, _order(i, v))
                                     for n, (i, v) in enumerate(OFFSETS)])
    transform = _pipeline(tmp, pg_dsn, kafka_bootstrap, topic, "icenestcrt",
                          transform="tests.tooling.chaos.maybe_fail_task")  # rows pass
    t_report = run_batch(spark, transform, plan_batch(transform, pg_dsn), pg_dsn)
    upsert = _pipeline(tmp, pg_dsn, kafka_bootstrap, topic, "icenestcru",
                       sink={"mode": "upsert", "key": ["order_id"]})
    bid = plan_batch(upsert, pg_dsn)
    died_between_the_commits(spark, upsert, bid, pg_dsn, "iceberg")
    u_report = run_batch(spark, upsert, bid, pg_dsn)  # the retry: `find` sees the snapshot
    return {"topic": topic, "transform": transform, "t_report": t_report,
            "upsert": upsert, "u_report": u_report, "u_bid": bid}


def _types(cfg: Any, dsn: str) -> dict[str, str]:
    return {f.name: str(f.field_type) for f in iceberg_table(cfg, dsn).schema().fields}


@pytest.mark.parametrize("which", ["transform", "upsert"])
def test_a_table_the_stage_path_creates_has_struct_list_and_map_columns(
        created: dict[str, Any], pg_dsn: str, which: str) -> None:
    report = created["t_report" if which == "transform" else "u_report"]
    assert report.result.status == "committed", report.result
    fields = _types(created[which], pg_dsn)
    assert fields["order_id"] == "long", fields  # the upsert's key: never nested
    assert fields["address"].startswith("struct<") and "street: required string" in \
        fields["address"] and "zip: optional int" in fields["address"], fields
    assert fields["lines"].startswith("list<struct<") and \
        "price: required decimal(9, 2)" in fields["lines"], fields
    assert fields["tags"] == "map<string, double>", fields


def test_every_value_of_the_created_tables_reads_back_as_produced(
        created: dict[str, Any], pg_dsn: str) -> None:
    def by_version(r: dict[str, Any]) -> tuple[int, str]:
        return r["order_id"], r["address"]["street"]

    appended = sorted((_read(r) for r in iceberg_table(created["transform"], pg_dsn).scan()
                       .to_arrow().to_pylist()), key=by_version)
    assert appended == sorted((_as_read(i, v) for n, (i, v) in enumerate(OFFSETS)
                               if n != POISON), key=by_version)
    # the upsert: each key's latest record that fits (order 2's poison one never wins)
    upserted = {r["order_id"]: _read(r) for r in iceberg_table(created["upsert"], pg_dsn)
                .scan().to_arrow().to_pylist()}
    assert upserted == {1: _as_read(1, 1), 2: _as_read(2, 0), 3: _as_read(3, 0)}, upserted


@pytest.mark.parametrize("which", ["transform", "upsert"])
def test_a_misfit_is_a_dead_letter_alone_across_a_kill_between_the_commits(
        created: dict[str, Any], pg_dsn: str, which: str) -> None:
    """The upsert's driver died after its catalog commit: the retry's `find` routed the
    record again (its first dead letter rolled back with the ledger) before the winners,
    and committed nothing twice (one snapshot, positions once)."""
    cfg, topic = created[which], created["topic"]
    report = created["t_report" if which == "transform" else "u_report"]
    dead = chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(topic, 0, POISON)], dead
    assert "does not fit in decimal(9,2)" in dead[0].error, dead
    assert "lines[0].price" in dead[0].error, dead
    assert report.result.bad_records == 1, report.result
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): len(OFFSETS)}
    assert len(snapshot_batches(cfg, pg_dsn)) == 1
    if which == "upsert":
        assert snapshot_batches(cfg, pg_dsn) == [created["u_bid"]]
        with Ledger(pg_dsn) as ledger:
            assert ledger.get_batch(created["u_bid"]).attempts == 2


V1 = {"type": "record", "name": "EvolvedOrder", "namespace": "offsetflow.test",
      "fields": [{"name": "order_id", "type": "long"}]}
# v2 adds a top-level record field (optional, default null): compatible
V2 = {**V1, "fields": [*V1["fields"], {"name": "address", "type": ["null", ADDRESS],
                                       "default": None}]}


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_json_field_evolution_adds_is_added_as_its_struct(
        pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any, mode: str) -> None:
    """Under add_columns, a v2 field whose reader schema is a record joins the table as a
    struct column in the batch's own catalog commit (the snapshot's schema has it, the
    previous one not), its values parsed into it; the older rows read null there."""
    topic = new_topic(kafka_bootstrap, "icenestadd", 1)
    url = registry_url()
    v1, v2 = avro_serializer(url, V1), avro_serializer(url, V2)
    produce(kafka_bootstrap, topic, [encode(v1, topic, {"order_id": 1})])
    cfg = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, f"icenestadd{mode[0]}",
                    fmt={"schema": {"order_id": "long"}, "schema_evolution": "add_columns"},
                    sink={"mode": mode, **({"key": ["order_id"]} if mode == "upsert"
                                           else {})})
    first = plan_batch(cfg, pg_dsn)
    assert run_batch(spark, cfg, first, pg_dsn).result.status == "committed"
    produce(kafka_bootstrap, topic, [
        encode(v2, topic, {"order_id": 2, "address": {"street": "s2", "zip": 2}}),
        encode(v2, topic, {"order_id": 3, "address": None})])
    bid = plan_batch(cfg, pg_dsn)
    report = run_batch(spark, cfg, bid, pg_dsn)
    assert report.result.status == "committed", report.result
    table = iceberg_table(cfg, pg_dsn)
    address = table.schema().find_field("address")
    assert str(address.field_type).startswith("struct<"), address
    assert "street: required string" in str(address.field_type), address
    assert "zip: optional int" in str(address.field_type), address
    assert not address.required
    snaps = {int(s.summary.additional_properties[SUMMARY_BATCH]): s
             for s in table.snapshots() if s.summary and
             SUMMARY_BATCH in s.summary.additional_properties}
    schemas = table.schemas()
    assert "address.street" in schemas[snaps[bid].schema_id].column_names
    assert "address" not in schemas[snaps[first].schema_id].column_names
    rows = {r["order_id"]: r["address"] for r in table.scan().to_arrow().to_pylist()}
    assert rows == {1: None, 2: {"street": "s2", "zip": 2}, 3: None}, rows
    assert chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name) == []


RETRY_LINE = {"type": "record", "name": "Line", "fields": [
    {"name": "sku", "type": "string"},
    {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9,
                               "scale": 2}}]}
RETRY_SCHEMA = {"type": "record", "name": "RetryOrder", "namespace": "offsetflow.test",
                "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "lines", "type": {"type": "array", "items": RETRY_LINE}}]}
RETRY_COLUMNS = {"order_id": "long", "lines": "json"}


def _retry_order(i: int) -> dict[str, Any]:
    return {"order_id": i, "lines": [{"sku": f"s{i}", "price": Decimal(f"{i}.25")}]}


def _retry_poison(sid: int, i: int) -> bytes:
    """A record of schema `sid` whose price has 12 digits before the point where the schema
    says decimal(9,2) (`wide_decimal`)."""
    return wide_decimal(RETRY_SCHEMA, {"order_id": i, "lines": [
        {"sku": "x", "price": Decimal("123456789012.50")}]}, sid)


def _retry_pipeline(tmp: Any, dsn: str, bootstrap: str, topic: str, name: str, table: str,
              **extra: Any) -> Any:
    return iceberg_pipeline(tmp, dsn, bootstrap, topic, RETRY_COLUMNS, name=name, table=table,
                            **extra)


def test_a_nested_dead_letter_of_the_stage_path_survives_a_kill_between_the_commits(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Any) -> None:
    unique = uuid.uuid4().hex[:8]
    table = f"lake.icenestretry_{unique}"
    ser = avro_serializer(registry_url(), RETRY_SCHEMA)
    first = new_topic(kafka_bootstrap, "icenestretry_a", 1)
    produce(kafka_bootstrap, first, [encode(ser, first, _retry_order(100))])
    a = _retry_pipeline(tmp_path, pg_dsn, kafka_bootstrap, first, f"icenestra_{unique}", table)
    assert run_batch(spark, a, plan_batch(a, pg_dsn), pg_dsn).result.status == "committed"
    assert str(iceberg_table(a, pg_dsn).schema().find_field("lines").field_type) \
        .startswith("list<struct<"), "pipeline A's table has a typed nested column"

    topic = new_topic(kafka_bootstrap, "icenestretry_b", 1)
    sid = int.from_bytes(encode(ser, topic, _retry_order(0))[1:5], "big")
    produce(kafka_bootstrap, topic, [encode(ser, topic, _retry_order(0)), _retry_poison(sid, 1),
                                     encode(ser, topic, _retry_order(2))])
    b = _retry_pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, f"icenestrb_{unique}", table,
                  transform="tests.tooling.chaos.maybe_fail_task")  # rows pass unchanged
    bid = plan_batch(b, pg_dsn)
    died_between_the_commits(spark, b, bid, pg_dsn, "iceberg")
    report = run_batch(spark, b, bid, pg_dsn)  # the retry: `find` sees the snapshot
    assert report.result.status == "committed", report.result

    got = sorted(r["order_id"] for r in iceberg_table(b, pg_dsn).scan().to_arrow()
                 .to_pylist())
    assert got == [0, 2, 100]
    dead = chaos.dead_letters(pg_dsn, b.dead_letter_table, b.name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(topic, 0, 1)], (
        f"the record at offset 1 is in neither the table nor the dead letters: {dead}")
    assert "does not fit in decimal(9,2)" in dead[0].error, dead
    assert report.result.bad_records == 1, report.result
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(b.name) == {(topic, 0): 3}
