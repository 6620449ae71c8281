"""An Avro bytes decimal whose 16 bytes are -2**127 (0x80 then 15 zero bytes: 39 digits,
more than decimal(38,s) holds) on real Kafka, Spark and an Iceberg table: that record is a
dead letter with its coordinates, its chunk's other records land with their exact values,
the batch commits. The column-wise decoder (`source.avro_vector`) once took it: Arrow's
precision check passes -2**127 at any precision, so the chunk's table carried a value its
column cannot hold, and the Iceberg data file stored it (PostgreSQL's numeric refuses it
at COPY, where it became a dead letter anyway)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from offsetflow.config import parse_pipeline
from tests.tooling.iceberg_rows import iceberg_table
from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import (
    avro_serializer,
    encode,
    new_topic,
    plan_and_run,
    produce,
    registry_url,
)

SCHEMA = {"type": "record", "name": "Pay", "namespace": "offsetflow.test", "fields": [
    {"name": "id", "type": "long"},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 38,
                                "scale": 4}}]}


def test_a_decimal_of_minus_two_to_the_127_is_a_dead_letter(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Any) -> None:
    topic = new_topic(kafka_bootstrap, "avro-dec-edge", partitions=1)
    ser = avro_serializer(registry_url(), SCHEMA)
    amounts = [Decimal("1.2500"), Decimal("0"), Decimal("-99999.0001")]
    values: list[Any] = [encode(ser, topic, {"id": i, "amount": a}) for i, a in enumerate(amounts)]
    zero = values[1]
    assert zero.endswith(b"\x02\x00")  # amount 0: one byte
    values[1] = zero[:-2] + b"\x20" + b"\x80" + b"\x00" * 15  # 16 bytes: -2**127
    produce(kafka_bootstrap, topic, values)
    name = f"avro_dec_edge_{topic.rsplit('-', 1)[1]}"
    cfg = parse_pipeline({
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "avro", "schema": {"id": "long", "amount": "decimal(38,4)"},
                   "schema_registry": {"url": registry_url()}},
        "sink": {"type": "iceberg", "connection": pg_dsn, "table": f"lake.{name}",
                 "catalog": {"warehouse": f"file://{tmp_path / 'warehouse'}"}},
        "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
        "spark": {"master": "local[2]"}}, f"<test {name}>", {})
    _, report = plan_and_run(spark, cfg, pg_dsn)
    assert report.result.status == "committed", report.result
    rows = iceberg_table(cfg, pg_dsn).scan(selected_fields=("id", "amount")).to_arrow()
    assert sorted(rows.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 0, "amount": Decimal("1.2500")}, {"id": 2, "amount": Decimal("-99999.0001")}]
    dead = query(pg_dsn, f'SELECT partition, "offset" FROM dl_{name}')
    assert dead == [(0, 1)]
