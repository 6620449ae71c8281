"""`format.key: {type: avro}` on real Kafka, Spark and PostgreSQL, where a key field fills a
column over a value field of the same name that does not fit it (the value's `order_id`
2**40 in an `int` column, the key's 5): the record is a dead letter whether or not its
chunk holds another bad record. The column-wise conversion of a chunk took the key's value
without converting the value's, so such a record landed in a clean chunk and was a dead
letter (record by record) in a chunk with a bad neighbour."""

from __future__ import annotations

from typing import Any

from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    new_topic,
    plan_and_run,
    produce,
    record_pipeline,
    registry_url,
)

KEY = {"type": "record", "name": "ClashKey", "namespace": "offsetflow.test",
       "fields": [{"name": "order_id", "type": "long"}]}
VALUE = {"type": "record", "name": "ClashValue", "namespace": "offsetflow.test",
         "fields": [{"name": "order_id", "type": "long"}, {"name": "amount", "type": "long"}]}


def test_a_value_field_the_key_fills_over_still_has_to_fit(spark: Any, pg_dsn: str,
                                                          kafka_bootstrap: str) -> None:
    url = registry_url()
    topic = new_topic(kafka_bootstrap, "avro-key-over", partitions=1)
    kser, vser = avro_serializer(url, KEY), avro_serializer(url, VALUE)
    records: list[Any] = [
        (encode(vser, topic, {"order_id": 2**40, "amount": 1}),
         encode(kser, topic, {"order_id": 5}, key=True), 0),
        (encode(vser, topic, {"order_id": 6, "amount": 2}),
         encode(kser, topic, {"order_id": 6}, key=True), 0)]
    produce(kafka_bootstrap, topic, records)
    name = f"avro_key_over_{topic.rsplit('-', 1)[1]}"
    cfg = record_pipeline(name, topic, "avro", {"order_id": "int", "amount": "long"}, pg_dsn,
                          kafka_bootstrap, key={"type": "avro"})
    _, report = plan_and_run(spark, cfg, pg_dsn)
    assert report.result.status == "committed", report.result
    assert query(pg_dsn, f"SELECT order_id, amount FROM {name}") == [(6, 2)]
    dead = query(pg_dsn, f'SELECT "offset", error FROM dl_{name}')
    assert [o for o, _ in dead] == [0] and "order_id" in dead[0][1], dead
