"""`format.schema_evolution: add_columns` into an Iceberg upsert table, on its commit path:
a conflict round (another writer changes the schema and appends between the upsert's load of
the table and its catalog commit), and a retry after a kill between the catalog commit and
the ledger's when the table's schema was changed meanwhile (`sink_iceberg_evolve`,
`sink_iceberg_upsert`). Real Kafka, Spark, PostgreSQL (ledger and SQL catalog) and the
stack's registry; Avro records from confluent-kafka's serializer.

Each case: a topic and pipeline of its own; its first batch (schema v1: `order_id`, `qty`)
makes the table, the second (v2 adds `coupon`) replaces keys 4 and 5 (their data files are
rewritten: the rows kept there are 1, 2, 3, 6) and adds key 9.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml

from offsetflow.config import load_pipeline
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling.iceberg_case import died_between_the_commits
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    new_topic,
    plan_batch,
    registry_url,
)

PARTITIONS = 2
V1: dict[str, Any] = {
    "type": "record", "name": "IceEvU", "namespace": "offsetflow.test",
    "fields": [{"name": "order_id", "type": "long"}, {"name": "qty", "type": "long"}]}
V2: dict[str, Any] = {**V1, "fields": [
    *V1["fields"], {"name": "coupon", "type": ["null", "string"], "default": None}]}


def _produce(case: dict[str, Any], schema: dict[str, Any], records: list[dict[str, Any]]
             ) -> None:
    from confluent_kafka import Producer

    ser = avro_serializer(case["url"], schema)
    p = Producer({"bootstrap.servers": case["bootstrap"], "linger.ms": 5})
    for r in records:
        p.produce(case["topic"], encode(ser, case["topic"], r),
                  partition=r["order_id"] % PARTITIONS)
    assert p.flush(30) == 0


@pytest.fixture
def case(request: Any, spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Any
         ) -> dict[str, Any]:
    """A pipeline (mode upsert, or `request.param`) whose first batch (v1, keys 1..6)
    made the table; v2 records produced (keys 4, 5 replaced with a coupon, key 9 new) and
    their batch planned."""
    topic = new_topic(kafka_bootstrap, "iceevu", PARTITIONS)
    name = f"iceevu_{uuid.uuid4().hex[:8]}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "avro", "schema": {"order_id": "long"},
                      "schema_evolution": "add_columns",
                      "schema_registry": {"url": registry_url()}},
           "sink": {"type": "iceberg", "connection": pg_dsn, "table": f"lake.{name}",
                    "catalog": {"warehouse": f"file://{tmp_path / 'warehouse'}"},
                    "partition_by": ["partition"]},
           "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
           "spark": {"master": "local[2]", "max_offsets_per_task": 4}}
    if getattr(request, "param", "upsert") == "upsert":
        raw["sink"].update(mode="upsert", key=["order_id"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_pipeline(path)
    c: dict[str, Any] = {"cfg": cfg, "name": name, "topic": topic, "url": registry_url(),
                         "bootstrap": kafka_bootstrap,
                         "mode": getattr(request, "param", "upsert")}
    _produce(c, V1, [{"order_id": i, "qty": i} for i in range(1, 7)])
    c["first"] = plan_batch(cfg, pg_dsn)
    assert run_batch(spark, cfg, c["first"], pg_dsn).result.status == "committed"
    _produce(c, V2, [{"order_id": i, "qty": 100 + i, "coupon": f"c{i}"} for i in (4, 5, 9)])
    c["second"] = plan_batch(cfg, pg_dsn)
    return c


WANT = [(1, 1, None), (2, 2, None), (3, 3, None), (4, 104, "c4"), (5, 105, "c5"),
        (6, 6, None), (9, 109, "c9")]


def _values(cfg: Any, dsn: str) -> list[tuple[Any, ...]]:
    rows = iceberg_table(cfg, dsn).scan().to_arrow().to_pylist()
    return sorted((r["order_id"], r["qty"], r.get("coupon")) for r in rows)


def test_a_schema_change_and_an_append_between_load_and_commit_decide_again(
        case: dict[str, Any], pg_dsn: str, spark: Any) -> None:
    """Round 1 stages `coupon` with the next field id; another writer adds a column of its
    own (taking that id) and commits a snapshot before round 1's catalog commit: the
    commit conflicts, round 2 decides on the table as it is then (coupon gets the next id
    after the other's), and every winner keeps its coupon, every kept row its qty."""
    from pyiceberg.types import StringType

    from offsetflow.sinks.iceberg import commit

    cfg = case["cfg"]
    rounds: list[int] = []

    def other_writer(point: str) -> None:
        if point != "after-files":
            return
        rounds.append(1)
        if len(rounds) > 1:
            return
        t = iceberg_table(cfg, pg_dsn)
        with t.update_schema() as u:
            u.add_column("note", StringType())
        t = iceberg_table(cfg, pg_dsn)
        # a live writer's snapshot (no rows): main moves on
        with t.transaction() as txn, txn.update_snapshot().fast_append():
            pass

    with pytest.MonkeyPatch.context() as m:
        m.setattr(commit, "_fault", other_writer)
        report = run_batch(spark, cfg, case["second"], pg_dsn)
    assert report.result.status == "committed", report.result
    assert len(rounds) == 2  # conflicted once, decided again
    table = iceberg_table(cfg, pg_dsn)
    assert {"note", "coupon"} <= set(table.schema().column_names)
    assert _values(cfg, pg_dsn) == WANT
    assert snapshot_batches(cfg, pg_dsn) == [case["first"], case["second"]]


@pytest.mark.parametrize("case", ["upsert", "append"], indirect=True)
def test_retry_after_the_catalog_commit_completes_though_the_column_was_retyped_by_hand(
        case: dict[str, Any], pg_dsn: str, spark: Any) -> None:
    """The second batch dies between its catalog commit (coupon added, rows there) and the
    ledger's; then `coupon` is dropped and added again as a long by hand (or another
    pipeline's schema). Upsert (the stage path) and append (the tasks write the files).
    The batch is in the table: its retry completes it from its
    snapshot (the ledger commits, positions move), never refuses it as a change it would
    make (`Nothing was written` would be false) nor asks to drop a column to go on."""
    from pyiceberg.types import LongType

    cfg = case["cfg"]
    died_between_the_commits(spark, cfg, case["second"], pg_dsn, "iceberg")
    assert snapshot_batches(cfg, pg_dsn) == [case["first"], case["second"]]
    t = iceberg_table(cfg, pg_dsn)
    with t.update_schema() as u:
        u.delete_column("coupon")
    t = iceberg_table(cfg, pg_dsn)
    with t.update_schema() as u:
        u.add_column("coupon", LongType())

    report = run_batch(spark, cfg, case["second"], pg_dsn)
    assert report.result.status == "committed", report.result
    assert snapshot_batches(cfg, pg_dsn) == [case["first"], case["second"]]
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(case["second"]).status == "committed"
        pos = ledger.positions(case["name"])
    assert pos == {(case["topic"], 0): 4, (case["topic"], 1): 5}
    ids = sorted(r["order_id"] for r in
                 iceberg_table(cfg, pg_dsn).scan().to_arrow().to_pylist())
    assert ids == ([1, 2, 3, 4, 5, 6, 9] if case["mode"] == "upsert"
                   else [1, 2, 3, 4, 4, 5, 5, 6, 9])  # once each: nothing appended again
