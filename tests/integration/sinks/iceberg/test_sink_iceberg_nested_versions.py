"""A nested record whose field becomes optional, or wider, in a newer schema version
(`sink_iceberg_nested`, under `format.schema_evolution: add_columns`).

Real Kafka, Spark, PostgreSQL (ledger and SQL catalog) and the stack's registry. The table
is made from v1, whose nested record has a required string and a float; v2 (a compatible
Avro change) makes the string optional and the float a double. The batch of v2's records
commits them all: the table's field becomes optional and the float a double in the
batch's own catalog commit, never a dead letter for a null the new schema allows, never a
double silently cut to a float.
"""

from __future__ import annotations

import uuid
from typing import Any

import yaml

from offsetflow.config import load_pipeline
from offsetflow.job import run_batch
from tests.tooling import chaos
from tests.tooling.iceberg_rows import iceberg_table
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    new_topic,
    plan_batch,
    produce,
    registry_url,
)

V1 = {"type": "record", "name": "VersionedOrder", "namespace": "offsetflow.test", "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "address", "type": {"type": "record", "name": "VAddress", "fields": [
        {"name": "street", "type": "string"}, {"name": "w", "type": "float"}]}}]}
# v2: the nested string may be null, the nested float is a double (both compatible)
V2 = {**V1, "fields": [V1["fields"][0], {"name": "address", "type": {
    "type": "record", "name": "VAddress", "fields": [
        {"name": "street", "type": ["null", "string"], "default": None},
        {"name": "w", "type": "double"}]}}]}


def test_a_nested_field_made_optional_or_wider_follows_in_the_batchs_commit(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Any) -> None:
    topic = new_topic(kafka_bootstrap, "icenestver", 1)
    url = registry_url()
    v1 = avro_serializer(url, V1)
    produce(kafka_bootstrap, topic, [encode(v1, topic, {
        "order_id": i, "address": {"street": f"s{i}", "w": 0.5}}) for i in range(2)])
    name = f"icenestver_{uuid.uuid4().hex[:8]}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": {"order_id": "long", "address": "json"},
                      "schema_registry": {"url": url},
                      "schema_evolution": "add_columns"},
           "sink": {"type": "iceberg", "connection": pg_dsn, "table": f"lake.{name}",
                    "catalog": {"warehouse": f"file://{tmp_path / 'warehouse'}"}},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]"}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_pipeline(tmp_path / "p.yaml")
    assert run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn).result.status == "committed"
    made = str(iceberg_table(cfg, pg_dsn).schema().find_field("address").field_type)
    assert "street: required string" in made and "w: required float" in made, made

    v2 = avro_serializer(url, V2)
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
