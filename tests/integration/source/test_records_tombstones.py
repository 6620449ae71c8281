"""Tombstones, reader side, on real Kafka and PostgreSQL: a record with a null value reaches
the stage as a row whose `value` IS NULL and whose schema columns are null, except those the
key fills when it is a JSON object with fields of the schema's names. What the commit does
with such a row (delete, dead letter, null row) is the sink's decision."""

from __future__ import annotations

import json
from typing import Any

from confluent_kafka import Producer

from offsetflow.commit import create_stage_tables
from offsetflow.config import parse_pipeline
from offsetflow.job.tasks import ReadContext, read_subrange, stage_columns
from offsetflow.ledger import stage_part_table
from offsetflow.ops import plan_only
from offsetflow.ranges import split_ranges
from offsetflow.stage import BadRows, TaskClock, binary_encoder, stage_rows
from tests.tooling.pipeline_data import query

SCHEMA = {"event_id": "string", "seq": "long", "note": "string"}


def _stage(cfg: Any, dsn: str) -> int:
    planned = plan_only(cfg, dsn, started_by="test")
    assert planned.batch is not None
    batch = planned.batch
    specs = [r.to_dict() for r in split_ranges(batch.ranges, 1000)]
    assert len(specs) == 1
    columns = stage_columns(cfg)
    create_stage_tables(dsn, batch.batch_id, columns, parts=1)
    rc = ReadContext.of(cfg, batch.batch_id, dsn, specs)
    clock = TaskClock()
    stage_rows(dsn, batch.batch_id, 0, read_subrange(rc, 0, clock), clock,
               binary_encoder([t for _, t in columns]),
               table=stage_part_table(batch.batch_id, 0), bad=BadRows(cfg.name, True))
    return batch.batch_id


def _config(topic: str, dsn: str, bootstrap: str, table: str, fmt: str) -> Any:
    f: dict[str, Any] = {"type": fmt}
    if fmt == "json":
        f["schema"] = dict(SCHEMA)
    return parse_pipeline({
        "name": table, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest"}, "format": f,
        "sink": {"connection": dsn, "table": table}, "bad_records": "dead_letter",
        "spark": {"master": "local[2]"}}, f"<test {table}>", {})


def test_tombstones_reach_the_stage_as_rows_with_a_null_value(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("tomb", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    records: list[tuple[bytes | None, bytes | None]] = [
        (b'{"event_id":"a","seq":1}', json.dumps({"event_id": "a", "seq": 1,
                                                   "note": "live"}).encode()),
        (b'{"event_id":"a","seq":"x"}', None),  # JSON key; seq does not fit: null
        (b"plain-key", None),                    # not a JSON object: fields null
        (None, None),                            # no key at all
        (b'{"event_id":"b","seq":2}', json.dumps({"event_id": "b", "seq": 2}).encode()),
    ]
    for key, value in records:
        p.produce(topic, value, key=key, partition=0)
    assert p.flush(30) == 0

    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"tomb_{unique}", "json")
    batch_id = _stage(cfg, pg_dsn)
    rows = query(pg_dsn, f'SELECT "offset", value IS NULL, event_id, seq, note FROM '
                         f'offsetflow_stage.b{batch_id}_p0 ORDER BY "offset"')
    assert rows == [(0, False, "a", 1, "live"), (1, True, "a", None, None),
                    (2, True, None, None, None), (3, True, None, None, None),
                    (4, False, "b", 2, None)]
    assert query(pg_dsn, f"SELECT count(*) FROM offsetflow_stage.b{batch_id}_dead")[0][0] == 0
    assert query(pg_dsn, "SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s "
                         "AND kind = 'bad'", (batch_id,))[0][0] == 0

    raw = _config(topic, pg_dsn, kafka_bootstrap, f"tombraw_{unique}", "raw")
    batch_id = _stage(raw, pg_dsn)
    rows = query(pg_dsn, f'SELECT "offset", value IS NULL FROM '
                         f'offsetflow_stage.b{batch_id}_p0 ORDER BY "offset"')
    assert rows == [(0, False), (1, True), (2, True), (3, True), (4, False)]
