"""`format.schema_evolution` for Protobuf and JSON Schema when a registered schema is one the
evolution rules could not read although the tasks read its records (review of issue 30):

- a Protobuf message that refers to itself (a tree: `Node parent = 2`) was "not a record"
  to the rules (no message the others do not use), so as the subject's latest it stopped
  every batch, advising `reader_version`, which the config refuses for Protobuf;
- a JSON Schema whose root allows null (`"type": ["object", "null"]`) was skipped by the
  check as if its records were dead letters, while the tasks read them (they only check the
  id): under `fail` a batch holding it did not stop at its added property;
- a JSON property that cannot be a column name stopped the batch advising ways out the
  config refuses (`reader_version`) or cannot express (declaring it in format.schema).
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError, SchemaEvolutionError
from offsetflow.job import run_batch
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


def _columns(dsn: str, table: str) -> dict[str, str]:
    return dict(query(dsn, "SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_name = %s", (table,)))


def _tree_file() -> Any:
    f = descriptor_pb2.FileDescriptorProto(name="offsetflow_evo_tree.proto",
                                           package="offsetflow.tree", syntax="proto3")
    m = f.message_type.add(name="Node")
    m.field.add(name="id", number=1, type=FD.TYPE_INT64, label=FD.LABEL_OPTIONAL)
    m.field.add(name="label", number=2, type=FD.TYPE_STRING, label=FD.LABEL_OPTIONAL)
    m.field.add(name="parent", number=3, type=FD.TYPE_MESSAGE, label=FD.LABEL_OPTIONAL,
                type_name=".offsetflow.tree.Node")
    return f


def test_protobuf_self_referencing_message_adds_its_columns(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-tree", partitions=1)
    name = f"evotree_{topic[-8:]}"
    cls = dynamic_message_classes(_tree_file())["Node"]
    ser = protobuf_serializer(url, cls)
    produce(kafka_bootstrap, topic, [
        encode(ser, topic, cls(id=1, label="root")),
        encode(ser, topic, cls(id=2, label="leaf", parent=cls(id=1, label="root")))])
    cfg = record_pipeline(name, topic, "protobuf", {"id": "long"}, pg_dsn, kafka_bootstrap,
                          schema_evolution="add_columns")
    _, report = plan_and_run(spark, cfg, pg_dsn)
    assert report.result.status == "committed", report.result
    cols = _columns(pg_dsn, name)
    assert (cols["label"], cols["parent"]) == ("text", "jsonb"), cols
    rows = dict(query(pg_dsn, f"SELECT id, label FROM {name}"))
    assert rows == {1: "root", 2: "leaf"}


def _order_file(note_first: bool) -> Any:
    """Order (v1); v2 adds a field `coupon` and, first in the file, an unrelated `Note`."""
    f = descriptor_pb2.FileDescriptorProto(name="offsetflow_evo_root.proto",
                                           package="offsetflow.root", syntax="proto3")
    if note_first:
        f.message_type.add(name="Note").field.add(name="text", number=1,
                                                  type=FD.TYPE_STRING, label=1)
    m = f.message_type.add(name="Order")
    m.field.add(name="order_id", number=1, type=FD.TYPE_INT64, label=FD.LABEL_OPTIONAL)
    if note_first:
        m.field.add(name="coupon", number=2, type=FD.TYPE_STRING, label=FD.LABEL_OPTIONAL)
    return f


def test_protobuf_root_message_switched_by_a_message_added_first_stops_the_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    """The rules read a file by its first message no other uses; records name theirs by
    index. A version that adds an unrelated message before Order (records still Order,
    index [1]) must not silently evolve by the other message (a `text` column that never
    gets a value, `coupon` never added): it stops, naming both messages."""
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-root", partitions=1)
    name = f"evoroot_{topic[-8:]}"
    v1 = dynamic_message_classes(_order_file(False))["Order"]
    produce(kafka_bootstrap, topic, [encode(protobuf_serializer(url, v1), topic,
                                            v1(order_id=1))])
    v2 = dynamic_message_classes(_order_file(True))["Order"]
    produce(kafka_bootstrap, topic, [encode(protobuf_serializer(url, v2), topic,
                                            v2(order_id=2, coupon="c"))])
    cfg = record_pipeline(name, topic, "protobuf", {"order_id": "long"}, pg_dsn,
                          kafka_bootstrap, schema_evolution="add_columns")
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
    assert "the root message changed from offsetflow.root.Order to offsetflow.root.Note" \
        in str(e.value), e.value
    assert query(pg_dsn, f"SELECT to_regclass('{name}') IS NULL")[0][0] or \
        query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 0


J_V1 = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Unread",
        "type": "object", "properties": {"order_id": {"type": "integer"}},
        "required": ["order_id"]}
J_NULLABLE = {**J_V1, "type": ["object", "null"],
              "properties": {**J_V1["properties"], "coupon": {"type": "string"}}}
J_DASHED = {**J_V1, "properties": {**J_V1["properties"], "coupon-code": {"type": "string"}}}


def _produce_js(bootstrap: str, url: str, topic: str, schema: dict[str, Any],
                records: list[dict[str, Any]]) -> int:
    ser = json_serializer(url, schema)
    values = [encode(ser, topic, r) for r in records]
    produce(bootstrap, topic, values)
    return int.from_bytes(values[0][1:5], "big")


def test_json_schema_nullable_root_is_checked_not_skipped(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-jsnull", partitions=1)
    name = f"evojsnull_{topic[-8:]}"
    v1 = _produce_js(kafka_bootstrap, url, topic, J_V1, [{"order_id": 1}])
    v2 = _produce_js(kafka_bootstrap, url, topic, J_NULLABLE,
                     [{"order_id": 2, "coupon": "c2"}])
    strict = record_pipeline(name, topic, "json_schema", {"order_id": "long"}, pg_dsn,
                             kafka_bootstrap, schema_evolution="fail")
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, strict, plan_batch(strict, pg_dsn), pg_dsn)
    assert f"schema id {v2} (version 2 of {topic}-value) cannot follow schema id {v1} " \
           f"(version 1 of {topic}-value): fields added ['coupon']" in str(e.value), e.value
    assert query(pg_dsn, f"SELECT to_regclass('{name}') IS NULL")[0][0] or \
        query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 0

    # add_columns reads the nullable root as the reader: its property becomes a column
    added = record_pipeline(f"{name}_add", topic, "json_schema", {"order_id": "long"},
                            pg_dsn, kafka_bootstrap, schema_evolution="add_columns")
    _, report = plan_and_run(spark, added, pg_dsn)
    assert report.result.status == "committed", report.result
    assert dict(query(pg_dsn, f"SELECT order_id, coupon FROM {name}_add")) == {
        1: None, 2: "c2"}


def test_json_schema_property_that_is_no_column_name_names_a_way_out_the_config_takes(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-jsdash", partitions=1)
    name = f"evojsdash_{topic[-8:]}"
    _produce_js(kafka_bootstrap, url, topic, J_DASHED, [{"order_id": 1, "coupon-code": "x"}])
    cfg = record_pipeline(name, topic, "json_schema", {"order_id": "long"}, pg_dsn,
                          kafka_bootstrap, schema_evolution="add_columns")
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
    msg = str(e.value)
    assert "'coupon-code'" in msg, msg
    # each way out the message names must be one the config accepts
    assert "reader_version" not in msg, msg
    with pytest.raises(ConfigError):  # what the branch advised
        parse_pipeline({"name": "x", "kafka": {"bootstrap_servers": kafka_bootstrap},
                        "source": {"topics": [topic]}, "format": {
                            "type": "json_schema", "schema": {"order_id": "long"},
                            "schema_registry": {"url": url, "reader_version": 1}},
                        "sink": {"connection": pg_dsn, "table": name}}, "<t>", {})
    assert "remove format.schema_evolution" in msg, msg


J_MIXED = {**J_V1, "type": ["object", "string"],  # its objects are read as any object is
           "properties": {**J_V1["properties"], "coupon": {"type": "string"}}}


def test_json_schema_root_the_rules_cannot_read_stops_naming_it(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-jsmix", partitions=1)
    name = f"evojsmix_{topic[-8:]}"
    _produce_js(kafka_bootstrap, url, topic, J_V1, [{"order_id": 1}])
    v2 = _produce_js(kafka_bootstrap, url, topic, J_MIXED, [{"order_id": 2, "coupon": "c"}])
    strict = record_pipeline(name, topic, "json_schema", {"order_id": "long"}, pg_dsn,
                             kafka_bootstrap, schema_evolution="fail")
    with pytest.raises(SchemaEvolutionError) as e:
        run_batch(spark, strict, plan_batch(strict, pg_dsn), pg_dsn)
    msg = str(e.value)
    assert f"schema id {v2} (version 2 of {topic}-value) is one format.schema_evolution " \
           f"cannot read the fields of" in msg, msg
    assert f"its first record in the batch is {topic}[0]@1" in msg, msg
    assert "remove format.schema_evolution and run the batch with --accept-config-change" \
        in msg, msg
    # the way out it names: the same batch commits, each record once
    plain = record_pipeline(name, topic, "json_schema", {"order_id": "long"}, pg_dsn,
                            kafka_bootstrap)
    bid = query(pg_dsn, "SELECT max(batch_id) FROM offsetflow.batches WHERE pipeline = %s",
                (name,))[0][0]
    done = run_batch(spark, plain, bid, pg_dsn, accept_config_change=True)
    assert done.result.status == "committed", done.result
    assert sorted(r[0] for r in query(pg_dsn, f"SELECT order_id FROM {name}")) == [1, 2]


LONG = "l" * 63  # PostgreSQL's longest identifier


def test_json_schema_properties_named_as_sql_keywords_mixed_case_or_63_long_become_columns(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-jsodd", partitions=1)
    name = f"evojsodd_{topic[-8:]}"
    odd = {**J_V1, "properties": {**J_V1["properties"], "user": {"type": "string"},
                                  "order": {"type": "integer"}, "Select": {"type": "boolean"},
                                  LONG: {"type": "number"}}}
    _produce_js(kafka_bootstrap, url, topic, J_V1, [{"order_id": 1}])
    _produce_js(kafka_bootstrap, url, topic, odd, [{"order_id": 2, "user": "u", "order": 7,
                                                     "Select": True, LONG: 1.5}])
    cfg = record_pipeline(name, topic, "json_schema", {"order_id": "long"}, pg_dsn,
                          kafka_bootstrap, schema_evolution="add_columns")
    _, report = plan_and_run(spark, cfg, pg_dsn)
    assert report.result.status == "committed", report.result
    rows = query(pg_dsn, f'SELECT order_id, "user", "order", "Select", {LONG} FROM {name} '
                         f"ORDER BY order_id")
    assert rows == [(1, None, None, None, None), (2, "u", 7, True, 1.5)], rows
    # the next batch (no new schema) finds the columns there: nothing to add, commits
    _produce_js(kafka_bootstrap, url, topic, odd, [{"order_id": 3, "user": "v", "order": 8,
                                                     "Select": False, LONG: 2.5}])
    _, again = plan_and_run(spark, cfg, pg_dsn)
    assert again.result.status == "committed", again.result
    assert query(pg_dsn, f"SELECT count(*) FROM {name}")[0][0] == 3


def test_json_schema_version_registered_between_the_alter_and_the_retry_changes_nothing(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    """The batch's reader (the subject's latest at its first run) is pinned: a version
    registered while its commit waits after the ALTER, then a retry after the commit's
    connection is cut, adds no column of the new version and writes each record once."""
    import threading

    from tests.tooling import chaos

    url = registry_url()
    topic = new_topic(kafka_bootstrap, "evo-jspin", partitions=1)
    name = f"evojspin_{topic[-8:]}"
    v2_schema = {**J_V1, "properties": {**J_V1["properties"], "coupon": {"type": "string"}}}
    _produce_js(kafka_bootstrap, url, topic, J_V1, [{"order_id": 1}])
    v2 = _produce_js(kafka_bootstrap, url, topic, v2_schema, [{"order_id": 2, "coupon": "c"}])
    cfg = record_pipeline(name, topic, "json_schema", {"order_id": "long"}, pg_dsn,
                          kafka_bootstrap, schema_evolution="add_columns")
    bid = plan_batch(cfg, pg_dsn)
    errors: list[BaseException] = []

    def first_run() -> None:
        try:
            run_batch(spark, cfg, bid, pg_dsn)
        except BaseException as e:  # noqa: BLE001 - the cut commit's error, asserted below
            errors.append(e)

    with chaos.hold_positions(pg_dsn, name):
        t = threading.Thread(target=first_run)
        t.start()
        chaos.wait_for(lambda: chaos.commit_waiting(pg_dsn), 300, "the commit to wait at "
                                                                  "its fence")
        # v3 (a new property) registered while the commit holds the ALTER, not committed
        v3_schema = {**v2_schema, "properties": {**v2_schema["properties"],
                                                 "extra": {"type": "integer"}}}
        _produce_js(kafka_bootstrap, url, topic, v3_schema,
                    [{"order_id": 3, "coupon": "d", "extra": 9}])
        assert chaos.cut_commit_connection(pg_dsn) >= 1
        t.join(timeout=120)
    assert errors, "the cut commit should have failed"
    again = run_batch(spark, cfg, bid, pg_dsn)
    assert again.result.status == "committed", again.result
    assert "extra" not in _columns(pg_dsn, name)  # v3 is the next batch's reader
    assert dict(query(pg_dsn, f"SELECT order_id, coupon FROM {name}")) == {1: None, 2: "c"}
    schemas = query(pg_dsn, "SELECT schemas FROM offsetflow.batches WHERE batch_id = %s",
                    (bid,))[0][0]
    assert schemas["readers"] == {topic: v2}
    # the next batch reads v3's record with v3 as its reader: the column comes then
    _, nxt = plan_and_run(spark, cfg, pg_dsn)
    assert nxt.result.status == "committed", nxt.result
    assert dict(query(pg_dsn, f"SELECT order_id, extra FROM {name}")) == {
        1: None, 2: None, 3: 9}
