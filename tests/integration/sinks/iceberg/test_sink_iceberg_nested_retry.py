"""Nested values on the stage path (a transform, a quality suite: the driver reads the
stage and writes the files) into a table whose columns are struct / list / map, across a
kill between the Iceberg commit and the ledger commit (`sink_iceberg_nested`).

Real Kafka, Spark, PostgreSQL (ledger and SQL catalog) and the stack's registry. Pipeline
A (the task-files path) makes the table from the Avro reader schema, so its nested
columns are typed; pipeline B appends to the same table through a transform. B's batch
holds a record whose decimal inside a list does not fit its column: the commit makes it
a dead letter. B's driver dies after the catalog commit, before the ledger's: the retry
finds the snapshot and must route that record again (the first attempt's dead letter
rolled back with the ledger), else it is in neither the table nor the dead letters.
"""

from __future__ import annotations

import io
import json
import uuid
from decimal import Decimal
from typing import Any

import yaml

from offsetflow.config import load_pipeline
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling import chaos
from tests.tooling.iceberg_case import died_between_the_commits
from tests.tooling.iceberg_rows import iceberg_table
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    new_topic,
    plan_batch,
    produce,
    registry_url,
)

LINE = {"type": "record", "name": "Line", "fields": [
    {"name": "sku", "type": "string"},
    {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9,
                               "scale": 2}}]}
SCHEMA = {"type": "record", "name": "RetryOrder", "namespace": "offsetflow.test", "fields": [
    {"name": "order_id", "type": "long"},
    {"name": "lines", "type": {"type": "array", "items": LINE}}]}
COLUMNS = {"order_id": "long", "lines": "json"}


def _order(i: int) -> dict[str, Any]:
    return {"order_id": i, "lines": [{"sku": f"s{i}", "price": Decimal(f"{i}.25")}]}


def _poison(sid: int, i: int) -> bytes:
    """A record of schema `sid` whose price has 12 digits before the point where the schema
    says decimal(9,2) (written with the precision raised: a careless producer's)."""
    import fastavro

    wide = json.loads(json.dumps(SCHEMA).replace('"precision": 9', '"precision": 20'))
    rec = {"order_id": i, "lines": [{"sku": "x", "price": Decimal("123456789012.50")}]}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(wide), rec)
    return b"\x00" + sid.to_bytes(4, "big") + buf.getvalue()


def _pipeline(tmp: Any, dsn: str, bootstrap: str, topic: str, name: str, table: str,
              **extra: Any) -> Any:
    raw = {"name": name, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": dict(COLUMNS),
                      "schema_registry": {"url": registry_url()}},
           "sink": {"type": "iceberg", "connection": dsn, "table": table,
                    "catalog": {"warehouse": f"file://{tmp / 'warehouse'}"}},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]"}, **extra}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_pipeline(path)


def test_a_nested_dead_letter_of_the_stage_path_survives_a_kill_between_the_commits(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Any) -> None:
    unique = uuid.uuid4().hex[:8]
    table = f"lake.icenestretry_{unique}"
    ser = avro_serializer(registry_url(), SCHEMA)
    first = new_topic(kafka_bootstrap, "icenestretry_a", 1)
    produce(kafka_bootstrap, first, [encode(ser, first, _order(100))])
    a = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, first, f"icenestra_{unique}", table)
    assert run_batch(spark, a, plan_batch(a, pg_dsn), pg_dsn).result.status == "committed"
    assert str(iceberg_table(a, pg_dsn).schema().find_field("lines").field_type) \
        .startswith("list<struct<"), "pipeline A's table has a typed nested column"

    topic = new_topic(kafka_bootstrap, "icenestretry_b", 1)
    sid = int.from_bytes(encode(ser, topic, _order(0))[1:5], "big")
    produce(kafka_bootstrap, topic, [encode(ser, topic, _order(0)), _poison(sid, 1),
                                     encode(ser, topic, _order(2))])
    b = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, f"icenestrb_{unique}", table,
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
