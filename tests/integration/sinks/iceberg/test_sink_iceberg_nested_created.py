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
"""

from __future__ import annotations

import io
import json
import uuid
from decimal import Decimal
from typing import Any

import pytest
import yaml

from offsetflow.config import SUMMARY_BATCH, load_pipeline
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling import chaos
from tests.tooling.iceberg_case import died_between_the_commits
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
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
    says decimal(9,2) (written with the precision raised: a careless producer's)."""
    import fastavro

    wide = json.loads(json.dumps(SCHEMA).replace('"precision": 9', '"precision": 20'))
    rec = {**_order(2, 9), "lines": [{"sku": "x", "price": Decimal("123456789012.50")}]}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(wide), rec)
    return b"\x00" + sid.to_bytes(4, "big") + buf.getvalue()


def _pipeline(tmp: Any, dsn: str, bootstrap: str, topic: str, prefix: str,
              fmt: dict[str, Any] | None = None, **extra: Any) -> Any:
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    raw = {"name": name, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": dict(COLUMNS),
                      "schema_registry": {"url": registry_url()}, **(fmt or {})},
           "sink": {"type": "iceberg", "connection": dsn, "table": f"lake.{name}",
                    "catalog": {"warehouse": f"file://{tmp / 'warehouse'}"}},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]"}}
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(raw.get(k), dict):
            raw[k] = {**raw[k], **v}
        else:
            raw[k] = v
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_pipeline(path)


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
