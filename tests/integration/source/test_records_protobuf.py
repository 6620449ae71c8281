"""`format.type: protobuf` on real Kafka, Spark and PostgreSQL: values produced by
confluent-kafka's real `ProtobufSerializer` (magic byte, schema id, message indexes, the
Protobuf binary; the file registered in the stack's registry) from message classes built at
run time (no protoc), the message the second of its file (message index [1]); scalars, an
enum, a Timestamp and a nested message land value by value, exactly once; poison values are
dead letters with coordinates and schema id."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from google.protobuf import descriptor_pb2

from offsetflow.job import run_batch
from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import (
    dynamic_message_classes,
    encode,
    new_topic,
    plan_and_run,
    produce,
    protobuf_serializer,
    record_pipeline,
    registry_url,
)

COLUMNS = {"order_id": "long", "status": "string", "amount": "double", "at": "timestamp",
           "address": "json", "tags": "json", "note": "string"}
GOOD = 10


def _file() -> Any:
    f = descriptor_pb2.FileDescriptorProto(name="offsetflow_test_order.proto",
                                           package="offsetflow.test", syntax="proto3")
    f.dependency.append("google/protobuf/timestamp.proto")
    addr = f.message_type.add(name="Address")
    addr.field.add(name="city", number=1, type=9, label=1)
    order = f.message_type.add(name="Order")
    fd = descriptor_pb2.FieldDescriptorProto
    order.field.add(name="order_id", number=1, type=fd.TYPE_INT64, label=fd.LABEL_OPTIONAL)
    order.field.add(name="status", number=2, type=fd.TYPE_ENUM, label=fd.LABEL_OPTIONAL,
                    type_name=".offsetflow.test.Order.Status")
    order.field.add(name="amount", number=3, type=fd.TYPE_DOUBLE, label=fd.LABEL_OPTIONAL)
    order.field.add(name="at", number=4, type=fd.TYPE_MESSAGE, label=fd.LABEL_OPTIONAL,
                    type_name=".google.protobuf.Timestamp")
    order.field.add(name="address", number=5, type=fd.TYPE_MESSAGE, label=fd.LABEL_OPTIONAL,
                    type_name=".offsetflow.test.Address")
    order.field.add(name="tags", number=6, type=fd.TYPE_STRING, label=fd.LABEL_REPEATED)
    order.field.add(name="note", number=7, type=fd.TYPE_STRING, label=fd.LABEL_OPTIONAL)
    status = order.enum_type.add(name="Status")
    for i, n in enumerate(("NEW", "PAID", "SHIPPED")):
        status.value.add(name=n, number=i)
    return f


def _order(cls: Any, i: int) -> Any:
    m = cls(order_id=i, status=i % 3, amount=i * 0.5, tags=[f"t{i}", "x"][: i % 3],
            note=f"n{i}")
    m.at.FromDatetime(datetime(2026, 11, 26, 12, 0, i, i * 1000, tzinfo=UTC))
    if i % 2:
        m.address.city = f"city{i}"
    return m


def test_protobuf_records_land_value_by_value_once_and_poison_is_dead_letters(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "protobuf")
    order = dynamic_message_classes(_file())["Order"]
    ser = protobuf_serializer(url, order)
    good0 = encode(ser, topic, _order(order, 0))
    assert good0[5] == 2  # message indexes [1] (zigzag): Order is the file's second message
    sid = int.from_bytes(good0[1:5], "big")
    pills = {
        b"no-magic": (b'{"order_id": 1}', "not in the Confluent wire format"),
        b"unknown-id": (b"\x00" + (10**9).to_bytes(4, "big") + good0[5:],
                        "schema id 1000000000: unknown schema id 1000000000"),
        b"bad-index": (good0[:5] + b"\x02\x0e" + good0[7:], f"schema id {sid}: message index"),
        b"truncated": (good0[:-3], f"schema id {sid}: payload does not decode"),
    }
    produce(kafka_bootstrap, topic, [
        *[(encode(ser, topic, _order(order, i)), None, i % 2) for i in range(GOOD)],
        *[(v, k, len(k) % 2) for k, (v, _) in pills.items()]])
    table = f"pb_{topic[-8:]}"
    cfg = record_pipeline(table, topic, "protobuf", COLUMNS, pg_dsn, kafka_bootstrap)
    bid, report = plan_and_run(spark, cfg, pg_dsn)
    assert report.result.status == "committed", report.result
    rows = query(pg_dsn, f"SELECT {', '.join(COLUMNS)} FROM {table} ORDER BY 1")
    assert [r[0] for r in rows] == list(range(GOOD))
    for r in rows:
        got = dict(zip(COLUMNS, r, strict=True))
        i = got["order_id"]
        assert got["status"] == ("NEW", "PAID", "SHIPPED")[i % 3]
        assert got["amount"] == i * 0.5
        assert got["at"] == datetime(2026, 11, 26, 12, 0, i, i * 1000, tzinfo=UTC)
        assert got["address"] == ({"city": f"city{i}"} if i % 2 else None)
        assert got["tags"] == [f"t{i}", "x"][: i % 3]
        assert got["note"] == f"n{i}"
    dead = {bytes(k): (t, pt, o, err) for t, pt, o, k, err in query(
        pg_dsn, f'SELECT topic, partition, "offset", key, error FROM dl_{table}')}
    assert set(dead) == set(pills), json.dumps({str(k): v[3] for k, v in dead.items()})
    for k, (_, why) in pills.items():
        t, pt, o, err = dead[k]
        assert (t, pt) == (topic, len(k) % 2) and o >= 0 and why in err, (k, err)
    again = run_batch(spark, cfg, bid, pg_dsn)
    assert again.result.status == "already_committed"
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == GOOD
