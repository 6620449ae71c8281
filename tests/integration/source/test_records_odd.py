"""One odd record among good ones, judged on its own (review s27-hotpath).

The deserializer reads a clean chunk through pyarrow's JSON reader and a chunk with a bad
record record by record in Python. A record must come out the same either way, so each case
here puts one kind of odd record in a topic of its own among good records only: the chunk
it lands in has nothing else to send it down the slow path. Every odd record must be a dead
letter naming why, every good record a row whose fields are its own, and the batch must
commit. Before the fixes: two JSON objects in one value next to an empty value shifted every
row between them by one with no dead letter; a JSON `null` first in a chunk crashed the
Python worker (pyarrow segfault) on every attempt; NaN, Infinity and decimals past their
precision were stored; a CreateTime before year 1 failed the batch on every attempt.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka import Producer

from offsetflow.config import parse_pipeline
from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import query

SCHEMA = {"event_id": "string", "seq": "long", "amount": "double", "price": "decimal(6,2)",
          "note": "string"}
GOOD = 12  # good records per case, the odd ones among them
BEFORE_YEAR_1_MS = -70_000_000_000_000  # ~ 248 BC
BEYOND_INT64_US_MS = -(2**62)  # in milliseconds fine, in microseconds past int64

# case -> [(position among the good records, event id, value, Kafka timestamp, reason)]
ODD: dict[str, list[tuple[int, str, bytes | None, int | None, str]]] = {
    "two_objects_and_an_empty_value": [
        (2, "two", b'{"event_id":"two-a","seq":1}{"event_id":"two-b","seq":2}', None,
         "invalid JSON"),
        (7, "empty", b"", None, "invalid JSON")],
    "json_null_first": [(0, "null", b"null", None, "expected a JSON object")],
    "json_null_in_the_middle": [(5, "null", b"null", None, "expected a JSON object")],
    "nan_and_infinity": [(3, "nan", b'{"event_id":"nan","seq":3,"amount":NaN}', None, "NaN"),
                         (6, "inf", b'{"event_id":"inf","seq":6,"amount":-Infinity}', None,
                          "Infinity")],
    "decimal_past_its_precision": [
        (4, "price", b'{"event_id":"price","seq":4,"price":123456}', None, "decimal(6,2)")],
    "byte_order_mark_first": [(0, "bom", b'\xef\xbb\xbf{"event_id":"bom","seq":0}', None,
                               "BOM")],
    "timestamp_before_year_1": [
        (3, "old-good", b'{"event_id":"old-good","seq":3}', BEFORE_YEAR_1_MS, "timestamp"),
        (5, "old-bad", b"not json", BEFORE_YEAR_1_MS, "invalid JSON")],
    "timestamp_beyond_microseconds": [
        (4, "ancient", b'{"event_id":"ancient","seq":4}', BEYOND_INT64_US_MS, "timestamp")],
}


def _produce(bootstrap: str, topic: str, odd: list[tuple[int, str, bytes | None, int | None,
                                                         str]]) -> dict[str, int]:
    """Good records g-0.. with the odd ones at their positions; key = event id. Returns
    event id -> offset (one partition, so offsets follow the order produced)."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    at = {pos: (eid, value, ts) for pos, eid, value, ts, _ in odd}
    offsets: dict[str, int] = {}
    n = 0
    for i in range(GOOD + 1):
        if i in at:
            eid, value, ts = at[i]
            kw: dict[str, Any] = {"timestamp": ts} if ts is not None else {}
            p.produce(topic, value, key=eid.encode(), partition=0, **kw)
            offsets[eid] = n
            n += 1
        if i < GOOD:
            rec = {"event_id": f"g-{i}", "seq": 100 + i, "amount": i / 4, "price": f"{i}.25",
                   "note": f"n{i}"}
            p.produce(topic, json.dumps(rec).encode(), key=f"g-{i}".encode(), partition=0)
            offsets[f"g-{i}"] = n
            n += 1
    assert p.flush(30) == 0
    return offsets


@pytest.mark.parametrize("case", sorted(ODD))
def test_an_odd_record_among_good_ones_is_a_dead_letter_and_every_row_is_its_own(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        case: str) -> None:
    topic = make_topic("odd", 1, config={"message.timestamp.before.max.ms": str(2**63 - 1)})
    offsets = _produce(kafka_bootstrap, topic, ODD[case])
    table = f"odd_{unique}"
    cfg = parse_pipeline({
        "name": table, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": table},
        "bad_records": "dead_letter", "dead_letter_table": f"dl_{table}",
        "spark": {"master": "local[2]"}}, f"<test {table}>", {})
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert report.result.status == "committed", report.result

    # every row is the record at its own offset: its key, its fields
    rows = query(pg_dsn, f'SELECT "offset", convert_from(key, \'UTF8\'), event_id, seq, '
                         f"amount FROM {table} ORDER BY 1")
    good = {f"g-{i}" for i in range(GOOD)}
    assert {r[1] for r in rows} == good, rows
    for off, key, event_id, seq, amount in rows:
        i = int(key[2:])
        assert (off, event_id, seq, amount) == (offsets[key], key, 100 + i, i / 4), \
            f"row at offset {off} (key {key}) holds another record's fields: {event_id}, {seq}"
    dead = {int(o): err for o, err in query(
        pg_dsn, f'SELECT "offset", error FROM dl_{table} WHERE topic = %s', (topic,))}
    want = {offsets[eid]: why for _, eid, _, _, why in ODD[case]}
    assert set(dead) == set(want), (dead, want)
    for off, why in want.items():
        assert why in dead[off], (off, dead[off])
    assert report.result.rows_written == GOOD
    assert report.result.bad_records == len(ODD[case])
