"""A `json` field of `format.type: json` on real Kafka, Spark and PostgreSQL: nested values
land in a jsonb column exactly (numbers with every digit), NULL for a missing field or a
JSON null, and a value PostgreSQL jsonb cannot hold is a dead letter with coordinates."""

from __future__ import annotations

import json
import uuid
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import parse_pipeline
from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import query

DOCS: list[bytes] = [
    b'{"id": 0, "payload": {"user": {"id": 7, "tags": ["a", "b"]}, "n": 1.10}}',
    b'{"id": 1, "payload": [1, 12345678901234567890.123456789, null]}',
    b'{"id": 2, "payload": "text"}',
    b'{"id": 3}',
    b'{"id": 4, "payload": {"bad": "a\\u0000b"}}',
]


def test_json_fields_land_as_jsonb_value_by_value(spark: Any, pg_dsn: str,
                                                  kafka_bootstrap: str) -> None:
    topic = f"jsonf-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})  # alive until created
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for v in DOCS:
        p.produce(topic, v)
    assert p.flush(30) == 0
    table = f"jsonf_{uuid.uuid4().hex[:8]}"
    cfg = parse_pipeline({
        "name": table, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "json", "schema": {"id": "long", "payload": "json"}},
        "sink": {"connection": pg_dsn, "table": table}, "bad_records": "dead_letter",
        "dead_letter_table": f"dl_{table}", "spark": {"master": "local[2]"}},
        f"<test {table}>", {})
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert report.result.status == "committed", report.result
    types = dict(query(pg_dsn, "SELECT column_name, data_type FROM information_schema.columns "
                               "WHERE table_name = %s", (table,)))
    assert types["payload"] == "jsonb"
    rows = dict(query(pg_dsn, f"SELECT id, payload::text FROM {table}"))
    assert sorted(rows) == [0, 1, 2, 3]
    assert json.loads(rows[0]) == {"user": {"id": 7, "tags": ["a", "b"]}, "n": 1.1}
    assert rows[1] == "[1, 12345678901234567890.123456789, null]"  # every digit
    assert rows[2] == '"text"' and rows[3] is None
    dead = query(pg_dsn, f'SELECT partition, "offset", error FROM dl_{table}')
    assert [(d[0], d[1]) for d in dead] == [(0, 4)] and "'payload'" in dead[0][2] \
        and "NUL" in dead[0][2], dead
