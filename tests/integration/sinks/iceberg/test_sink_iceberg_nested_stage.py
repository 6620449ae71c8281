"""A field a newer reader schema adds inside a nested record, on the stage path (a quality
suite: the driver reads the stage and writes the files) into a table whose column is a
struct (`sink_iceberg_nested`), under `format.schema_evolution: add_columns`.

Real Kafka, Spark, PostgreSQL (ledger and SQL catalog), the stack's registry and a Great
Expectations suite. Pipeline A (the task-files path) makes the table from v1; pipeline B,
with a quality suite and add_columns, appends v2's records (a field added inside the
record) to it: the field joins the struct in B's catalog commit and every record lands,
never a dead letter per record for a field the table's struct lacked.
"""

from __future__ import annotations

import uuid
from pathlib import Path
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

V1 = {"type": "record", "name": "StageOrder", "namespace": "offsetflow.test", "fields": [
    {"name": "seq", "type": "long"},
    {"name": "address", "type": {"type": "record", "name": "SAddress", "fields": [
        {"name": "street", "type": "string"}]}}]}
V2 = {**V1, "fields": [V1["fields"][0], {"name": "address", "type": {
    "type": "record", "name": "SAddress", "fields": [
        {"name": "street", "type": "string"},
        {"name": "country", "type": "string", "default": "NL"}]}}]}


def _pipeline(tmp: Path, dsn: str, bootstrap: str, topic: str, name: str, table: str,
              **extra: Any) -> Any:
    raw = {"name": name, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": {"seq": "long", "address": "json"},
                      "schema_registry": {"url": registry_url()},
                      "schema_evolution": "add_columns"},
           "sink": {"type": "iceberg", "connection": dsn, "table": table,
                    "catalog": {"warehouse": f"file://{tmp / 'warehouse'}"}},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]"}, **extra}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_pipeline(path)


def test_a_field_added_inside_a_record_joins_the_struct_on_the_stage_path(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, gx_root: Path,
        tmp_path: Path) -> None:
    unique = uuid.uuid4().hex[:8]
    table = f"lake.icenststage_{unique}"
    url = registry_url()
    first = new_topic(kafka_bootstrap, "icenststage_a", 1)
    v1 = avro_serializer(url, V1)
    produce(kafka_bootstrap, first, [encode(v1, first, {"seq": 0,
                                                         "address": {"street": "a0"}})])
    a = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, first, f"icenststa_{unique}", table)
    assert run_batch(spark, a, plan_batch(a, pg_dsn), pg_dsn).result.status == "committed"
    assert str(iceberg_table(a, pg_dsn).schema().find_field("address").field_type) \
        .startswith("struct<")

    topic = new_topic(kafka_bootstrap, "icenststage_b", 1)
    v2 = avro_serializer(url, V2)
    produce(kafka_bootstrap, topic, [encode(v2, topic, {
        "seq": i, "address": {"street": f"b{i}", "country": "BE"}}) for i in (1, 2)])
    b = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, f"icenststb_{unique}", table,
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
