"""A `json` field of `format.type: json` on real Kafka, Spark and PostgreSQL: nested values
land in a jsonb column exactly (numbers with every digit), NULL for a missing field or a
JSON null, and a value PostgreSQL jsonb cannot hold is a dead letter with coordinates."""

from __future__ import annotations

import json
from typing import Any

from tests.tooling.pipeline_data import query
from tests.tooling.registry_case import new_topic, plan_and_run, produce, record_pipeline

DOCS: list[bytes] = [
    b'{"id": 0, "payload": {"user": {"id": 7, "tags": ["a", "b"]}, "n": 1.10}}',
    b'{"id": 1, "payload": [1, 12345678901234567890.123456789, null]}',
    b'{"id": 2, "payload": "text"}',
    b'{"id": 3}',
    b'{"id": 4, "payload": {"bad": "a\\u0000b"}}',
]


def test_json_fields_land_as_jsonb_value_by_value(spark: Any, pg_dsn: str,
                                                  kafka_bootstrap: str) -> None:
    topic = new_topic(kafka_bootstrap, "jsonf", partitions=1)
    produce(kafka_bootstrap, topic, DOCS)
    table = f"jsonf_{topic[-8:]}"
    cfg = record_pipeline(table, topic, "json", {"id": "long", "payload": "json"}, pg_dsn,
                          kafka_bootstrap)
    _, report = plan_and_run(spark, cfg, pg_dsn)
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
