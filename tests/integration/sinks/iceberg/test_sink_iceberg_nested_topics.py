"""Two topics into one Iceberg table whose `address` is a struct, when one topic's producers
move to a schema version that adds a field inside the record first (`sink_iceberg_nested`):
the batch reading both is checked against the union of their reader types, as a batch of
one topic is. Real Kafka, Spark, PostgreSQL and the stack's registry; the stage path
(`mode: upsert`).

Before: the two topics' reader types differ, so the column had no nested type for the run,
nothing was checked or evolved, and every record of the newer version was a dead letter
("field(s) ['country'] are not in the Iceberg table's struct"), under add_columns too.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml

from offsetflow.config import load_pipeline
from offsetflow.errors import SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
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


def _schema(country: bool) -> dict[str, Any]:
    address: list[dict[str, Any]] = [{"name": "street", "type": "string"},
                                     {"name": "zip", "type": ["null", "int"], "default": None}]
    if country:
        address.append({"name": "country", "type": ["null", "string"], "default": None})
    return {"type": "record", "name": "TopicsOrder", "namespace": "offsetflow.test",
            "fields": [{"name": "order_id", "type": "long"},
                       {"name": "address", "type": {"type": "record", "name": "TAddress",
                                                    "fields": address}}]}


def _order(i: int, country: str | None = None) -> dict[str, Any]:
    address: dict[str, Any] = {"street": f"street {i}", "zip": i}
    if country is not None:
        address["country"] = country
    return {"order_id": i, "address": address}


def _pipeline(tmp: Any, dsn: str, bootstrap: str, topics: list[str],
              evolution: str | None) -> Any:
    name = f"icenesttp_{uuid.uuid4().hex[:8]}"
    fmt: dict[str, Any] = {"type": "avro", "schema": {"order_id": "long", "address": "json"},
                           "schema_registry": {"url": registry_url()}}
    if evolution:
        fmt["schema_evolution"] = evolution
    raw = {"name": name, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": topics, "starting": "earliest"}, "format": fmt,
           "sink": {"type": "iceberg", "connection": dsn, "table": f"lake.{name}",
                    "mode": "upsert", "key": ["order_id"],
                    "catalog": {"warehouse": f"file://{tmp / 'warehouse'}"}},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]"}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_pipeline(path)


@pytest.mark.parametrize("evolution", [None, "add_columns"])
def test_a_field_one_topic_adds_inside_a_record_is_checked_not_each_record_dead(
        pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any,
        evolution: str | None) -> None:
    a, b = new_topic(kafka_bootstrap, "icenesttpa", 1), new_topic(kafka_bootstrap,
                                                                 "icenesttpb", 1)
    v1 = avro_serializer(registry_url(), _schema(False))
    produce(kafka_bootstrap, a, [encode(v1, a, _order(1))])
    produce(kafka_bootstrap, b, [encode(v1, b, _order(2))])
    cfg = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, [a, b], evolution)
    first = run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
    assert first.result.status == "committed", first.result
    assert "country" not in str(iceberg_table(cfg, pg_dsn).schema().find_field("address"))
    # topic a's producers move to v2 (address.country); topic b's stay on v1
    v2 = avro_serializer(registry_url(), _schema(True))
    produce(kafka_bootstrap, a, [encode(v2, a, _order(3, "BE"))])
    produce(kafka_bootstrap, b, [encode(v1, b, _order(4))])
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
