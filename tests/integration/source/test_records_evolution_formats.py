"""`format.schema_evolution: add_columns` for Protobuf and JSON Schema on real Kafka, Spark,
PostgreSQL and the stack's registry: records produced by confluent-kafka's real
`ProtobufSerializer` / `JSONSerializer` whose schema gains fields mid-range.

Protobuf (one topic, batches in order, a module fixture):
  1. v1 only: the table gets v1's undeclared field as a column;
  2. v1 and v2 records in one batch (v2 adds a string and a repeated field): its commit's
     connection cut after the ALTER TABLE and before COMMIT (in-process: no second Spark
     JVM; the process kill is the Avro test's), nothing is visible (no column, no row, no
     position); the retry commits both versions' rows once, the columns added in
     its own transaction; the ledger records the reader and writer ids, and `offsetflow
     status` and the lag page show each id's subject and version;
  3. v3 narrows a field (int64 -> int32): the batch stops with SchemaEvolutionError naming
     the ids, their versions and the first offset of v3; nothing written, positions unmoved.
JSON Schema: v1 and v2 (an optional property added) commit in one batch with the column;
v3 removes a required property and stops the same way; with the registry down the status
shows the ids and says the versions are unknown; a second pipeline under `fail` stops at
v1 -> v2.
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import UTC, datetime
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from offsetflow.config import PipelineConfig
from offsetflow.errors import SchemaEvolutionError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import format_status, pipeline_status
from tests.tooling import chaos
from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import (
    dynamic_message_classes,
    encode,
    json_serializer,
    new_topic,
    plan_and_run,
    plan_batch,
    produce,
    protobuf_serializer,
    record_pipeline,
    registry_url,
)

FD = descriptor_pb2.FieldDescriptorProto


def _order_file(qty_type: int, v2: bool) -> Any:
    f = descriptor_pb2.FileDescriptorProto(name="offsetflow_evo_order.proto",
                                           package="offsetflow.evo", syntax="proto3")
    m = f.message_type.add(name="Order")
    m.field.add(name="order_id", number=1, type=FD.TYPE_INT64, label=FD.LABEL_OPTIONAL)
    m.field.add(name="qty", number=2, type=qty_type, label=FD.LABEL_OPTIONAL)
    if v2:
        m.field.add(name="coupon", number=3, type=FD.TYPE_STRING, label=FD.LABEL_OPTIONAL)
        m.field.add(name="tags", number=4, type=FD.TYPE_STRING, label=FD.LABEL_REPEATED)
    return f


P_V1 = (FD.TYPE_INT64, False)
P_V2 = (FD.TYPE_INT64, True)
P_V3 = (FD.TYPE_INT32, True)  # qty narrowed


def _produce_pb(bootstrap: str, url: str, topic: str, version: tuple[int, bool],
                records: list[dict[str, Any]]) -> int:
    """`records` as Order messages of `version` (its file registered by the serializer):
    its schema id."""
    cls = dynamic_message_classes(_order_file(*version))["Order"]
    ser = protobuf_serializer(url, cls)
    values = [encode(ser, topic, cls(**r)) for r in records]
    produce(bootstrap, topic, values)
    return int.from_bytes(values[0][1:5], "big")


def _columns(dsn: str, table: str) -> dict[str, str]:
    return dict(query(dsn, "SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_name = %s", (table,)))


def _positions(dsn: str, name: str) -> dict[tuple[str, int], int]:
    with Ledger(dsn) as ledger:
        return ledger.positions(name)


def _altered_in_open_transaction(dsn: str, table: str) -> bool:
    """An OffsetFlow backend holds the ACCESS EXCLUSIVE lock an ALTER TABLE takes."""
    rows = query(dsn, """SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                          WHERE a.application_name = 'offsetflow'
                            AND l.relation = to_regclass(%s)
                            AND l.mode = 'AccessExclusiveLock' AND l.granted""", (table,))
    return bool(rows[0][0])


def _stops(spark: Any, cfg: PipelineConfig, dsn: str) -> tuple[str, int]:
    """Plan and run the next batch, which must stop with SchemaEvolutionError: its
    message and the batch id; nothing moved."""
    before = _positions(dsn, cfg.name)
    rows = query(dsn, f"SELECT count(*) FROM {cfg.name}")[0][0]
    bid = plan_batch(cfg, dsn)
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, cfg, bid, dsn)
    assert _positions(dsn, cfg.name) == before
    assert query(dsn, f"SELECT count(*) FROM {cfg.name}")[0][0] == rows
    with Ledger(dsn) as ledger:
        batch = ledger.get_batch(bid)
    assert batch.status == "failed" and "cannot follow" in (batch.error or "")
    return str(e.value), bid


@pytest.fixture(scope="module")
def pb(spark: Any, pg_dsn: str, kafka_bootstrap: str) -> dict[str, Any]:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-pb", partitions=1)
    name = f"evopb_{topic[-8:]}"
    cfg = record_pipeline(name, topic, "protobuf", {"order_id": "long"}, pg_dsn,
                          kafka_bootstrap, schema_evolution="add_columns")
    v1 = _produce_pb(kafka_bootstrap, url, topic, P_V1,
                     [{"order_id": i, "qty": i} for i in range(3)])
    _, first = plan_and_run(spark, cfg, pg_dsn)
    return {"cfg": cfg, "topic": topic, "name": name, "url": url, "v1": v1, "first": first}


def test_protobuf_field_added_mid_batch_cut_between_alter_and_commit_commits_once(
        pb: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    name, topic, url = pb["name"], pb["topic"], pb["url"]
    assert pb["first"].result.status == "committed", pb["first"].result
    assert _columns(pg_dsn, name)["qty"] == "bigint"
    _produce_pb(kafka_bootstrap, url, topic, P_V1, [{"order_id": i, "qty": i} for i in (3, 4)])
    v2 = _produce_pb(kafka_bootstrap, url, topic, P_V2,
                     [{"order_id": i, "qty": i, "coupon": f"c{i}", "tags": [f"t{i}"]}
                      for i in (5, 6, 7)])
    pb["v2"] = v2
    bid = plan_batch(pb["cfg"], pg_dsn)
    before = _positions(pg_dsn, name)
    errors: list[BaseException] = []

    def first_run() -> None:
        try:
            run_batch(spark, pb["cfg"], bid, pg_dsn)
        except BaseException as e:  # noqa: BLE001 - the cut commit's error, asserted below
            errors.append(e)

    with chaos.hold_positions(pg_dsn, name):  # the commit blocks at its fence
        t = threading.Thread(target=first_run)
        t.start()
        chaos.wait_for(lambda: chaos.commit_waiting(pg_dsn), 300, "the commit to wait at "
                                                                  "its fence")
        # the ALTER ran in the commit's transaction, which waits at its fence now
        assert _altered_in_open_transaction(pg_dsn, name)
        assert chaos.cut_commit_connection(pg_dsn) >= 1
        t.join(timeout=120)
    assert errors, "the cut commit should have failed"
    assert "coupon" not in _columns(pg_dsn, name)  # the ALTER went with the transaction
    assert query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 3
    assert _positions(pg_dsn, name) == before

    again = run_batch(spark, pb["cfg"], bid, pg_dsn)
    assert again.result.status == "committed", again.result
    cols = _columns(pg_dsn, name)
    assert (cols["coupon"], cols["tags"]) == ("text", "jsonb")
    rows = {r[0]: r[1:] for r in query(pg_dsn, f"SELECT order_id, qty, coupon, tags FROM "
                                               f"{name}")}
    assert sorted(rows) == list(range(8))  # 0 lost
    assert query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 8  # 0 duplicated
    for i in range(5):  # v1 records: their schema has no such fields
        assert rows[i] == (i, None, None)
    for i in (5, 6, 7):
        assert rows[i] == (i, f"c{i}", [f"t{i}"])
    assert _positions(pg_dsn, name) == {(topic, 0): 8}
    schemas = query(pg_dsn, "SELECT schemas FROM offsetflow.batches WHERE batch_id = %s",
                    (bid,))[0][0]
    assert schemas["readers"] == {topic: v2}
    assert schemas["writers"][topic] == {str(pb["v1"]): [0, 3], str(v2): [0, 5]}

    # the versions, not only the ids: on `offsetflow status` and the lag page
    st = pipeline_status(pb["cfg"], pg_dsn)
    text = format_status(st)
    assert f"{topic}: read as {v2} ({topic}-value v2), written {pb['v1']} ({topic}-value " \
           f"v1, from [0]@3), {v2} ({topic}-value v2, from [0]@5)" in text, text
    from offsetflow.orchestration.plugin import render_page

    page = render_page([st])
    assert f"{v2} ({topic}-value v2, from [0]@5)" in page


def test_protobuf_narrowed_field_stops_naming_ids_versions_and_first_offset(
        pb: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    if "v2" not in pb:
        pytest.skip("needs the v2 batch of the test before")
    topic = pb["topic"]
    v3 = _produce_pb(kafka_bootstrap, pb["url"], topic, P_V3,
                     [{"order_id": i, "qty": i} for i in (8, 9)])
    msg, _ = _stops(spark, pb["cfg"], pg_dsn)
    assert f"schema id {v3} (version 3 of {topic}-value) cannot follow schema id " \
           f"{pb['v2']} (version 2 of {topic}-value)" in msg, msg
    assert "field 'qty' changed from int64 to int32 (not a widening)" in msg, msg
    assert f"its first record in the batch is {topic}[0]@8" in msg, msg


J_V1 = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Evo",
        "type": "object", "properties": {"order_id": {"type": "integer"},
                                         "qty": {"type": "integer"}},
        "required": ["order_id", "qty"]}
J_V2 = {**J_V1, "properties": {**J_V1["properties"], "coupon": {"type": ["null", "string"]},
                               "at": {"type": "string", "format": "date-time"}}}
J_V3 = {**J_V2, "properties": {k: v for k, v in J_V2["properties"].items() if k != "qty"},
        "required": ["order_id"]}  # a required property removed


def _produce_js(bootstrap: str, url: str, topic: str, schema: dict[str, Any],
                records: list[dict[str, Any]]) -> int:
    ser = json_serializer(url, schema)
    values = [encode(ser, topic, r) for r in records]
    produce(bootstrap, topic, values)
    return int.from_bytes(values[0][1:5], "big")


def test_json_schema_property_added_then_required_one_removed(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-js", partitions=1)
    name = f"evojs_{topic[-8:]}"
    v1 = _produce_js(kafka_bootstrap, url, topic, J_V1,
                     [{"order_id": i, "qty": i} for i in range(3)])
    v2 = _produce_js(kafka_bootstrap, url, topic, J_V2,
                     [{"order_id": i, "qty": i, "coupon": f"c{i}",
                       "at": f"2026-11-27T03:00:0{i}Z"} for i in (3, 4, 5)])
    cfg = record_pipeline(name, topic, "json_schema", {"order_id": "long"}, pg_dsn,
                          kafka_bootstrap, schema_evolution="add_columns")
    bid, report = plan_and_run(spark, cfg, pg_dsn)
    assert report.result.status == "committed", report.result
    cols = _columns(pg_dsn, name)
    assert (cols["qty"], cols["coupon"], cols["at"]) == (
        "bigint", "text", "timestamp with time zone")
    rows = {r[0]: r[1:] for r in query(pg_dsn, f"SELECT order_id, qty, coupon, at FROM {name}")}
    assert rows == {**{i: (i, None, None) for i in range(3)},
                    **{i: (i, f"c{i}", datetime(2026, 11, 27, 3, 0, i, tzinfo=UTC))
                       for i in (3, 4, 5)}}
    schemas = query(pg_dsn, "SELECT schemas FROM offsetflow.batches WHERE batch_id = %s",
                    (bid,))[0][0]
    assert schemas == {"readers": {topic: v2},
                       "writers": {topic: {str(v1): [0, 0], str(v2): [0, 3]}}}

    v3 = _produce_js(kafka_bootstrap, url, topic, J_V3, [{"order_id": i} for i in (6, 7)])
    msg, _ = _stops(spark, cfg, pg_dsn)
    assert f"schema id {v3} (version 3 of {topic}-value) cannot follow schema id {v2} " \
           f"(version 2 of {topic}-value): required field 'qty' removed" in msg, msg
    assert f"its first record in the batch is {topic}[0]@6" in msg, msg

    # a registry that does not answer: the status still shows the ids, versions unknown
    assert cfg.registry is not None
    down = dataclasses.replace(cfg, registry=dataclasses.replace(
        cfg.registry, url="http://127.0.0.1:9"))
    st = pipeline_status(down, pg_dsn)
    text = format_status(st)
    assert f"{topic}: read as {v2} (version unknown: registry not answering), written " \
           f"{v1} (version unknown: registry not answering, from [0]@0)" in text, text
    assert "schema versions unknown: " in text and "127.0.0.1:9" in text, text
    from offsetflow.orchestration.plugin import render_page

    assert "Schema versions unknown" in render_page([st])

    # schema_evolution: fail on the same topic stops at the first change of the fields
    strict = record_pipeline(f"{name}_fail", topic, "json_schema", {"order_id": "long"},
                             pg_dsn, kafka_bootstrap, schema_evolution="fail")
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, strict, plan_batch(strict, pg_dsn), pg_dsn)
    assert f"schema id {v2} (version 2 of {topic}-value) cannot follow schema id {v1} " \
           f"(version 1 of {topic}-value): fields added ['coupon', 'at']" in str(e.value)
    assert f"its first record in the batch is {topic}[0]@3" in str(e.value)
    assert set(_positions(pg_dsn, strict.name).values()) <= {0}
