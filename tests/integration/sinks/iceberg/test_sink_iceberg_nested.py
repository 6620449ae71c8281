"""Nested Avro values as Iceberg struct / list / map columns (`sink_iceberg_nested`), on
real Kafka, Spark, PostgreSQL (ledger and SQL catalog) and the stack's registry, records
produced by confluent-kafka's `AvroSerializer`.

One topic of orders (a record, an array of records with logical types inside, a map of
optional doubles), one Iceberg append pipeline (a module fixture, one batch):
  - the new table's columns are struct / list / map, the types inside as at top level;
  - every value read back with pyiceberg equals what was produced;
  - a record whose decimal inside the array has more digits than its schema allows (a
    producer that does not check precision) is a dead letter with its coordinates, alone;
  - a transform added later (the stage path) parses into the same columns, and routes a
    poison record to the dead-letter table in the commit;
then the subject gains a field inside the nested record:
  - without format.schema_evolution the batch is refused by name before the tasks write
    (never a field silently dropped), positions unmoved;
  - under `add_columns` (a pipeline of its own) the field joins the table's struct in the
    batch's own catalog commit, and the older rows read null there.
"""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.config import SUMMARY_BATCH, load_pipeline
from offsetflow.errors import SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling import chaos
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

ADDRESS = {"type": "record", "name": "Address", "fields": [
    {"name": "street", "type": "string"},
    {"name": "zip", "type": ["null", "int"], "default": None}]}
LINE = {"type": "record", "name": "Line", "fields": [
    {"name": "sku", "type": {"type": "enum", "name": "Sku", "symbols": ["A", "B"]}},
    {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9,
                               "scale": 2}},
    {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}}]}
V1 = {"type": "record", "name": "NestedOrder", "namespace": "offsetflow.test", "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "address", "type": ADDRESS},
    {"name": "lines", "type": {"type": "array", "items": LINE}},
    {"name": "tags", "type": {"type": "map", "values": ["null", "double"]}}]}
# v2: a field added inside the nested record (with a default: compatible)
V2 = {**V1, "fields": [V1["fields"][0], {"name": "address", "type": {**ADDRESS, "fields": [
    *ADDRESS["fields"], {"name": "country", "type": "string", "default": "NL"}]}},
    *V1["fields"][2:]]}
COLUMNS = {"order_id": "long", "address": "json", "lines": "json", "tags": "json"}
T0 = datetime(2026, 11, 27, 6, 30, 0, 123000, tzinfo=UTC)


def _order(i: int, country: str | None = None) -> dict[str, Any]:
    address: dict[str, Any] = {"street": f"street {i}", "zip": None if i % 2 else 1000 + i}
    if country is not None:
        address["country"] = country
    return {"order_id": i, "address": address,
            "lines": [{"sku": "AB"[j % 2], "price": Decimal(f"{i}{j}.{j}5"),
                       "at": T0.replace(second=j), "day": date(2026, 1, 1 + j),
                       "ref": str(uuid.UUID(int=i * 100 + j))} for j in range(i % 3)],
            "tags": {"w": i / 4, "none": None} if i % 2 else {}}


def _poison(topic: str, sid: int, i: int) -> bytes:
    """A record of schema `sid` whose price inside `lines` has 12 digits before the point,
    where the schema says decimal(9,2) (`wide_decimal`)."""
    rec = _order(i)
    rec["lines"] = [{**_order(1)["lines"][0], "price": Decimal("123456789012.50")}]
    rec["lines"][0].update(sku="A", at=T0, day=date(2026, 1, 1), ref=str(uuid.UUID(int=7)))
    return wide_decimal(V1, rec, sid)


def _pipeline(tmp: Any, pg_dsn: str, bootstrap: str, topic: str, prefix: str,
              **fmt: Any) -> Any:
    return iceberg_pipeline(tmp, pg_dsn, bootstrap, topic, COLUMNS, prefix=prefix, format=fmt)


@pytest.fixture(scope="module")
def nested(spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path_factory: Any
           ) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("iceberg_nested")
    topic = new_topic(kafka_bootstrap, "icenest", 1)
    ser = avro_serializer(registry_url(), V1)
    values: list[bytes | tuple[bytes, bytes | None, int]] = [
        encode(ser, topic, _order(i)) for i in range(6)]
    sid = int.from_bytes(encode(ser, topic, _order(0))[1:5], "big")
    values.insert(3, _poison(topic, sid, 99))  # offset 3
    produce(kafka_bootstrap, topic, values)
    cfg = _pipeline(tmp, pg_dsn, kafka_bootstrap, topic, "icenest")
    bid = plan_batch(cfg, pg_dsn)
    report = run_batch(spark, cfg, bid, pg_dsn)
    return {"cfg": cfg, "topic": topic, "bid": bid, "report": report, "tmp": tmp}


def _rows(cfg: Any, dsn: str) -> dict[int, dict[str, Any]]:
    return {r["order_id"]: r for r in iceberg_table(cfg, dsn).scan().to_arrow().to_pylist()}


def _as_read(i: int, country: Any = ...) -> dict[str, Any]:
    """`_order(i)` as pyiceberg reads it back: enums and uuids as text, a map as pairs."""
    o = _order(i)
    address = dict(o["address"])
    if country is not ...:
        address["country"] = country
    return {"address": address,
            "lines": [{**ln, "price": ln["price"].quantize(Decimal("0.01"))}
                      for ln in o["lines"]],
            "tags": sorted(o["tags"].items())}


def test_nested_avro_fields_become_struct_list_and_map_columns(
        nested: dict[str, Any], pg_dsn: str) -> None:
    assert nested["report"].result.status == "committed", nested["report"].result
    fields = {f.name: str(f.field_type) for f in iceberg_table(nested["cfg"], pg_dsn)
              .schema().fields}
    assert fields["address"].startswith("struct<") and "street: required string" in \
        fields["address"] and "zip: optional int" in fields["address"], fields
    assert fields["lines"].startswith("list<struct<"), fields
    for inner in ("sku: required string", "price: required decimal(9, 2)",
                  "at: required timestamptz", "day: required date", "ref: required string"):
        assert inner in fields["lines"], fields
    assert fields["tags"] == "map<string, double>", fields


def test_every_nested_value_reads_back_as_produced(nested: dict[str, Any],
                                                   pg_dsn: str) -> None:
    rows = _rows(nested["cfg"], pg_dsn)
    assert sorted(rows) == list(range(6))  # the poison record is not there
    for i in range(6):
        got = rows[i]
        assert {"address": got["address"], "lines": got["lines"],
                "tags": sorted(got["tags"])} == _as_read(i), i


def test_a_nested_value_that_does_not_fit_is_a_dead_letter_alone(
        nested: dict[str, Any], pg_dsn: str) -> None:
    cfg = nested["cfg"]
    dead = chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(nested["topic"], 0, 3)], \
        dead
    # fastavro reads the decimal at the schema's precision (1.23456789E+11): still too wide
    assert "does not fit in decimal(9,2)" in dead[0].error, dead
    assert "lines[0].price" in dead[0].error, dead
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(nested["topic"], 0): 7}


def test_the_stage_path_parses_into_the_tables_structs_and_routes_what_does_not_fit(
        nested: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    """A transform added later (the stage path: the driver writes the files from the
    PostgreSQL stage, where the nested values are text) keeps the table's struct, list and
    map columns: each value parsed, a poison one its record's dead letter in the commit."""
    cfg, topic = nested["cfg"], nested["topic"]
    ser = avro_serializer(registry_url(), V1)
    sid = int.from_bytes(encode(ser, topic, _order(0))[1:5], "big")
    produce(kafka_bootstrap, topic, [encode(ser, topic, _order(10)), _poison(topic, sid, 98),
                                     encode(ser, topic, _order(11))])  # offsets 7, 8, 9
    raw = yaml.safe_load(Path(cfg.source_file).read_text())
    raw["transform"] = "tests.tooling.chaos.maybe_fail_task"  # rows pass through
    path = nested["tmp"] / f"{cfg.name}_transform.yaml"
    path.write_text(yaml.safe_dump(raw))
    staged = load_pipeline(path)
    report = run_batch(spark, staged, plan_batch(staged, pg_dsn), pg_dsn)
    assert report.result.status == "committed", report.result
    rows = _rows(cfg, pg_dsn)
    assert sorted(rows) == [*range(6), 10, 11]
    for i in (10, 11):
        got = rows[i]
        assert {"address": got["address"], "lines": got["lines"],
                "tags": sorted(got["tags"])} == _as_read(i), i
    dead = {d.offset: d for d in chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name)}
    assert sorted(dead) == [3, 8], dead
    assert "does not fit in decimal(9,2)" in dead[8].error, dead[8]
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 10}


def test_a_field_added_inside_a_record_is_refused_by_name_without_evolution(
        nested: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    cfg, topic = nested["cfg"], nested["topic"]
    ser = avro_serializer(registry_url(), V2)
    produce(kafka_bootstrap, topic, [encode(ser, topic, _order(7, "BE"))])
    table = iceberg_table(cfg, pg_dsn)
    schema, head = table.schema(), table.current_snapshot().snapshot_id
    with Ledger(pg_dsn) as ledger:
        before = ledger.positions(cfg.name)
    bid = plan_batch(cfg, pg_dsn)
    with pytest.raises(SchemaMismatchError, match=r"address\.country") as e:
        run_batch(spark, cfg, bid, pg_dsn)
    assert "schema_evolution: add_columns" in str(e.value)
    table = iceberg_table(cfg, pg_dsn)
    assert table.schema() == schema and table.current_snapshot().snapshot_id == head
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == before


def test_a_field_added_inside_a_record_joins_the_struct_in_the_batchs_commit(
        pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any) -> None:
    topic = new_topic(kafka_bootstrap, "icenestevo", 1)
    url = registry_url()
    v1, v2 = avro_serializer(url, V1), avro_serializer(url, V2)
    produce(kafka_bootstrap, topic, [encode(v1, topic, _order(i)) for i in range(3)])
    cfg = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, "icenestevo",
                    schema_evolution="add_columns")
    first = plan_batch(cfg, pg_dsn)
    assert run_batch(spark, cfg, first, pg_dsn).result.status == "committed"
    produce(kafka_bootstrap, topic, [encode(v1, topic, _order(3)),
                                     encode(v2, topic, _order(4, "BE"))])
    bid = plan_batch(cfg, pg_dsn)
    report = run_batch(spark, cfg, bid, pg_dsn)
    assert report.result.status == "committed", report.result
    table = iceberg_table(cfg, pg_dsn)
    assert "country: optional string" in str(table.schema().find_field("address").field_type)
    snaps = {int(s.summary.additional_properties[SUMMARY_BATCH]): s
             for s in table.snapshots() if s.summary and
             SUMMARY_BATCH in s.summary.additional_properties}
    schemas = table.schemas()
    assert "address.country" in schemas[snaps[bid].schema_id].column_names
    assert "address.country" not in schemas[snaps[first].schema_id].column_names
    assert snapshot_batches(cfg, pg_dsn) == [first, bid]
    rows = _rows(cfg, pg_dsn)
    assert sorted(rows) == list(range(5))
    for i in range(3):  # batch 1's rows: no initial default in Iceberg v2
        assert rows[i]["address"] == _as_read(i, None)["address"], i
    # v1's record read with the v2 reader: its default; v2's: its own value
    assert rows[3]["address"] == _as_read(3, "NL")["address"]
    assert rows[4]["address"] == _as_read(4, "BE")["address"]
