"""`format.type: json_schema` on real Kafka, Spark and PostgreSQL: values produced by
confluent-kafka's real `JSONSerializer` (magic byte, schema id, JSON text; the schema
registered in the stack's registry) land exactly once through the json format's path after
the 5-byte header; a value not in the wire format, an unknown id, an id of an Avro schema
and a value that does not fit its column are dead letters with coordinates and schema id."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from offsetflow.job import run_batch
from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    json_serializer,
    new_topic,
    plan_and_run,
    produce,
    record_pipeline,
    registry_url,
)

ORDER = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Order",
         "type": "object", "properties": {
             "order_id": {"type": "integer"}, "status": {"type": "string"},
             "amount": {"type": "number"}, "at": {"type": "string", "format": "date-time"}},
         "required": ["order_id", "status"]}
LOOSE = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "Loose",
         "type": "object"}
COLUMNS = {"order_id": "long", "status": "string", "amount": "decimal(10,2)",
           "at": "timestamp"}
GOOD = 10


def _order(i: int) -> dict[str, Any]:
    return {"order_id": i, "status": ("NEW", "PAID")[i % 2], "amount": i * 1.25,
            "at": f"2026-11-26T12:00:{i:02d}Z"}


def test_json_schema_records_land_once_and_poison_is_dead_letters(
        spark: Any, pg_dsn: str, kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "json-schema")
    ser = json_serializer(url, ORDER)
    good0 = encode(ser, topic, _order(0))
    sid = int.from_bytes(good0[1:5], "big")
    loose = encode(json_serializer(url, LOOSE), f"{topic}-loose", {"order_id": "x"})
    avro = encode(avro_serializer(url, {"type": "record", "name": "A", "fields": [
        {"name": "order_id", "type": "long"}]}), f"{topic}-avro", {"order_id": 1})
    pills = {  # key -> (value, what its dead letter's reason must say)
        b"no-magic": (b'{"order_id": 1}', "not in the Confluent wire format"),
        b"unknown-id": (b"\x00" + (10**9).to_bytes(4, "big") + good0[5:],
                        "schema id 1000000000: unknown schema id 1000000000"),
        b"avro-id": (avro, f"schema id {int.from_bytes(avro[1:5], 'big')}: schema id "),
        b"not-fit": (loose, f"schema id {int.from_bytes(loose[1:5], 'big')}: field "
                            f"'order_id'"),
        b"bad-json": (good0[:-3], f"schema id {sid}: "),
    }
    produce(kafka_bootstrap, topic, [
        *[(encode(ser, topic, _order(i)), None, i % 2) for i in range(GOOD)],
        *[(v, k, len(k) % 2) for k, (v, _) in pills.items()]])
    table = f"js_{topic[-8:]}"
    cfg = record_pipeline(table, topic, "json_schema", COLUMNS, pg_dsn, kafka_bootstrap)
    bid, report = plan_and_run(spark, cfg, pg_dsn)
    assert report.result.status == "committed", report.result
    rows = query(pg_dsn, f"SELECT order_id, status, amount, at FROM {table} ORDER BY 1")
    assert [(r[0], r[1], float(r[2]), r[3]) for r in rows] == [
        (i, _order(i)["status"], i * 1.25, datetime(2026, 11, 26, 12, 0, i, tzinfo=UTC))
        for i in range(GOOD)]
    dead = {bytes(k): (t, pt, o, err) for t, pt, o, k, err in query(
        pg_dsn, f'SELECT topic, partition, "offset", key, error FROM dl_{table}')}
    assert set(dead) == set(pills)
    for k, (_, why) in pills.items():
        t, pt, o, err = dead[k]
        assert (t, pt) == (topic, len(k) % 2) and o >= 0 and why in err, (k, err)
    again = run_batch(spark, cfg, bid, pg_dsn)
    assert again.result.status == "already_committed"
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == GOOD
