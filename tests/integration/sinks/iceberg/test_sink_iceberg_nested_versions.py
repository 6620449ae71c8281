"""A nested record's schema changing between versions, under `format.schema_evolution:
add_columns` or without it (`sink_iceberg_nested`, `sink_iceberg_evolve`); real Kafka, Spark,
PostgreSQL (ledger and SQL catalog) and the stack's registry, one small topic per test (three
files before, each with the same set-up).

1. A nested record whose field becomes optional, or wider, in a newer schema version. The table
is made from v1, whose nested record has a required string and a float; v2 (a compatible
Avro change) makes the string optional and the float a double. The batch of v2's records
commits them all: the table's field becomes optional and the float a double in the
batch's own catalog commit, never a dead letter for a null the new schema allows, never a
double silently cut to a float.

2. A field a newer reader schema adds inside a nested record, on the stage path (a quality
suite: the driver reads the stage and writes the files) into a table whose column is a
struct (`sink_iceberg_nested`), under `format.schema_evolution: add_columns`. A Great
Expectations suite. Pipeline A (the task-files path) makes the table from v1; pipeline B,
with a quality suite and add_columns, appends v2's records (a field added inside the
record) to it: the field joins the struct in B's catalog commit and every record lands,
never a dead letter per record for a field the table's struct lacked.

3. Two topics into one Iceberg table whose `address` is a struct, when one topic's producers
move to a schema version that adds a field inside the record first (`sink_iceberg_nested`):
the batch reading both is checked against the union of their reader types, as a batch of
one topic is. The stage path (`mode: upsert`).

Before: the two topics' reader types differ, so the column had no nested type for the run,
nothing was checked or evolved, and every record of the newer version was a dead letter
("field(s) ['country'] are not in the Iceberg table's struct"), under add_columns too.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from offsetflow.errors import SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling import chaos
from tests.tooling.iceberg_rows import iceberg_table
from tests.tooling.nested_case import iceberg_pipeline
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    new_topic,
    plan_batch,
    produce,
    registry_url,
)

VER_V1 = {"type": "record", "name": "VersionedOrder", "namespace": "offsetflow.test",
          "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "address", "type": {"type": "record", "name": "VAddress", "fields": [
        {"name": "street", "type": "string"}, {"name": "w", "type": "float"}]}}]}
# v2: the nested string may be null, the nested float is a double (both compatible)
VER_V2 = {**VER_V1, "fields": [VER_V1["fields"][0], {"name": "address", "type": {
    "type": "record", "name": "VAddress", "fields": [
        {"name": "street", "type": ["null", "string"], "default": None},
        {"name": "w", "type": "double"}]}}]}


def test_a_nested_field_made_optional_or_wider_follows_in_the_batchs_commit(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Any) -> None:
    topic = new_topic(kafka_bootstrap, "icenestver", 1)
    url = registry_url()
    v1 = avro_serializer(url, VER_V1)
    produce(kafka_bootstrap, topic, [encode(v1, topic, {
        "order_id": i, "address": {"street": f"s{i}", "w": 0.5}}) for i in range(2)])
    cfg = iceberg_pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic,
                           {"order_id": "long", "address": "json"}, prefix="icenestver",
                           format={"schema_evolution": "add_columns"})
    assert run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn).result.status == "committed"
    made = str(iceberg_table(cfg, pg_dsn).schema().find_field("address").field_type)
    assert "street: required string" in made and "w: required float" in made, made

    v2 = avro_serializer(url, VER_V2)
    produce(kafka_bootstrap, topic, [
        encode(v2, topic, {"order_id": 2, "address": {"street": None, "w": 0.1}}),
        encode(v2, topic, {"order_id": 3, "address": {"street": "s3", "w": 0.1}})])
    report = run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
    assert report.result.status == "committed", report.result

    dead = chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name)
    rows = {r["order_id"]: r["address"] for r in iceberg_table(cfg, pg_dsn).scan()
            .to_arrow().to_pylist()}
    assert sorted(rows) == [0, 1, 2, 3], (sorted(rows), [(d.offset, d.error) for d in dead])
    assert rows[2] == {"street": None, "w": 0.1}, rows[2]
    assert rows[3] == {"street": "s3", "w": 0.1}, f"a double cut to a float: {rows[3]}"
    now = str(iceberg_table(cfg, pg_dsn).schema().find_field("address").field_type)
    assert "street: optional string" in now and "w: required double" in now, now


STAGE_V1 = {"type": "record", "name": "StageOrder", "namespace": "offsetflow.test", "fields": [
    {"name": "seq", "type": "long"},
    {"name": "address", "type": {"type": "record", "name": "SAddress", "fields": [
        {"name": "street", "type": "string"}]}}]}
STAGE_V2 = {**STAGE_V1, "fields": [STAGE_V1["fields"][0], {"name": "address", "type": {
    "type": "record", "name": "SAddress", "fields": [
        {"name": "street", "type": "string"},
        {"name": "country", "type": "string", "default": "NL"}]}}]}


def _stage_pipeline(tmp: Path, dsn: str, bootstrap: str, topic: str, name: str, table: str,
              **extra: Any) -> Any:
    return iceberg_pipeline(tmp, dsn, bootstrap, topic, {"seq": "long", "address": "json"},
                            name=name, table=table,
                            format={"schema_evolution": "add_columns"}, **extra)


def test_a_field_added_inside_a_record_joins_the_struct_on_the_stage_path(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, gx_root: Path,
        tmp_path: Path) -> None:
    unique = uuid.uuid4().hex[:8]
    table = f"lake.icenststage_{unique}"
    url = registry_url()
    first = new_topic(kafka_bootstrap, "icenststage_a", 1)
    v1 = avro_serializer(url, STAGE_V1)
    produce(kafka_bootstrap, first, [encode(v1, first, {"seq": 0,
                                                         "address": {"street": "a0"}})])
    a = _stage_pipeline(tmp_path, pg_dsn, kafka_bootstrap, first, f"icenststa_{unique}", table)
    assert run_batch(spark, a, plan_batch(a, pg_dsn), pg_dsn).result.status == "committed"
    assert str(iceberg_table(a, pg_dsn).schema().find_field("address").field_type) \
        .startswith("struct<")

    topic = new_topic(kafka_bootstrap, "icenststage_b", 1)
    v2 = avro_serializer(url, STAGE_V2)
    produce(kafka_bootstrap, topic, [encode(v2, topic, {
        "seq": i, "address": {"street": f"b{i}", "country": "BE"}}) for i in (1, 2)])
    b = _stage_pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, f"icenststb_{unique}", table,
                  quality={"suite": "seqs", "on_failure": "dead_letter"})
    report = run_batch(spark, b, plan_batch(b, pg_dsn), pg_dsn)
    assert report.result.status == "committed", report.result
    dead = chaos.dead_letters(pg_dsn, b.dead_letter_table, b.name)
    assert dead == [], [(d.offset, d.error) for d in dead]
    rows = {r["seq"]: r["address"] for r in iceberg_table(b, pg_dsn).scan().to_arrow()
            .to_pylist()}
    assert rows == {0: {"street": "a0", "country": None},
                    1: {"street": "b1", "country": "BE"},
                    2: {"street": "b2", "country": "BE"}}, rows


def _topics_schema(country: bool) -> dict[str, Any]:
    address: list[dict[str, Any]] = [{"name": "street", "type": "string"},
                                     {"name": "zip", "type": ["null", "int"], "default": None}]
    if country:
        address.append({"name": "country", "type": ["null", "string"], "default": None})
    return {"type": "record", "name": "TopicsOrder", "namespace": "offsetflow.test",
            "fields": [{"name": "order_id", "type": "long"},
                       {"name": "address", "type": {"type": "record", "name": "TAddress",
                                                    "fields": address}}]}


def _topics_order(i: int, country: str | None = None) -> dict[str, Any]:
    address: dict[str, Any] = {"street": f"street {i}", "zip": i}
    if country is not None:
        address["country"] = country
    return {"order_id": i, "address": address}


def _topics_pipeline(tmp: Any, dsn: str, bootstrap: str, topics: list[str],
              evolution: str | None) -> Any:
    return iceberg_pipeline(tmp, dsn, bootstrap, topics, {"order_id": "long", "address": "json"},
                            prefix="icenesttp",
                            format={"schema_evolution": evolution} if evolution else {},
                            sink={"mode": "upsert", "key": ["order_id"]})


@pytest.mark.parametrize("evolution", [None, "add_columns"])
def test_a_field_one_topic_adds_inside_a_record_is_checked_not_each_record_dead(
        pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any,
        evolution: str | None) -> None:
    a, b = new_topic(kafka_bootstrap, "icenesttpa", 1), new_topic(kafka_bootstrap,
                                                                 "icenesttpb", 1)
    v1 = avro_serializer(registry_url(), _topics_schema(False))
    produce(kafka_bootstrap, a, [encode(v1, a, _topics_order(1))])
    produce(kafka_bootstrap, b, [encode(v1, b, _topics_order(2))])
    cfg = _topics_pipeline(tmp_path, pg_dsn, kafka_bootstrap, [a, b], evolution)
    first = run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
    assert first.result.status == "committed", first.result
    assert "country" not in str(iceberg_table(cfg, pg_dsn).schema().find_field("address"))
    # topic a's producers move to v2 (address.country); topic b's stay on v1
    v2 = avro_serializer(registry_url(), _topics_schema(True))
    produce(kafka_bootstrap, a, [encode(v2, a, _topics_order(3, "BE"))])
    produce(kafka_bootstrap, b, [encode(v1, b, _topics_order(4))])
    with Ledger(pg_dsn) as ledger:
        before = ledger.positions(cfg.name)
    bid = plan_batch(cfg, pg_dsn)
    if evolution is None:  # refused by name before anything is read, as for one topic
        with pytest.raises(SchemaMismatchError, match=r"address\.country") as e:
            run_batch(spark, cfg, bid, pg_dsn)
        assert "schema_evolution: add_columns" in str(e.value)
        with Ledger(pg_dsn) as ledger:
            assert ledger.positions(cfg.name) == before
        assert chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name) == []
        return
    report = run_batch(spark, cfg, bid, pg_dsn)
    assert report.result.status == "committed", report.result
    dead = chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name)
    assert dead == [], [(d.topic, d.offset, d.error) for d in dead]
    table = iceberg_table(cfg, pg_dsn)
    assert "country: optional string" in str(table.schema().find_field("address"))
    rows = {r["order_id"]: r["address"] for r in table.scan().to_arrow().to_pylist()}
    assert rows == {1: {"street": "street 1", "zip": 1, "country": None},
                    2: {"street": "street 2", "zip": 2, "country": None},
                    3: {"street": "street 3", "zip": 3, "country": "BE"},
                    4: {"street": "street 4", "zip": 4, "country": None}}, rows
