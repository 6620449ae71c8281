"""The Kafka sink's JSON value bytes do not depend on the PostgreSQL session that builds them:
PostgreSQL renders a value's JSON (`row_to_json`) with the session's output settings, which a
role or database default (`ALTER ROLE ... SET extra_float_digits = 0`), PGOPTIONS or the
DSN's `options` can change under the pipeline."""

from __future__ import annotations

import json
from typing import Any

import psycopg2.extensions
from confluent_kafka import Producer

from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from tests.tooling.kafka_case import kafka_sink_pipeline
from tests.tooling.topic_checker import read_topic

# doubles whose shortest round-trip text has 16 or 17 significant digits
AMOUNTS = [0.30000000000000004, 1.0000000000000002, 123.45678901234568, 2.2250738585072014e-308]


def test_float_values_keep_every_bit_whatever_the_sessions_float_output_setting(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A session whose extra_float_digits is 0 (PostgreSQL's default before 12, a common
    role setting of older clients) renders a double with 15 significant digits: 0.3 for
    0.30000000000000004. The output must carry the staged double exactly, as it does with
    the default setting, in the JSON value and in a key made of it (`key_column`)."""
    src = make_topic("kb-src", 1)
    out = make_topic("kb-out", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for i, amount in enumerate(AMOUNTS):
        body = {"event_id": f"kb{unique}-{i}", "seq": i, "amount": amount, "checksum": "c"}
        p.produce(src, json.dumps(body).encode(), partition=0)
    assert p.flush(30) == 0
    dsn = psycopg2.extensions.make_dsn(pg_dsn, options=(
        "-c extra_float_digits=0 -c bytea_output=escape -c IntervalStyle=iso_8601"))
    cfg = kafka_sink_pipeline(f"kb_{unique}", src, dsn, kafka_bootstrap, topic=out,
                              headers="none", key_column="amount")
    planned = plan_only(cfg, dsn)
    assert planned.batch is not None
    rep = run_batch(spark, cfg, planned.batch.batch_id, dsn)
    assert rep.result.status == "committed", rep.result
    records = read_topic(kafka_bootstrap, out)
    values = [r.value or b"" for r in records]
    got = [json.loads(v)["amount"] for v in values]
    assert got == AMOUNTS, values
    for v, amount in zip(values, AMOUNTS, strict=True):
        assert f'"amount":{amount!r}'.encode() in v, v
    # a key_column's text (`to_json`) is rendered by the same session
    assert [r.key for r in records] == [repr(a).encode() for a in AMOUNTS]


def test_text_keeps_its_characters_whatever_the_sessions_client_encoding(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A session whose client_encoding is not UTF8 (a role or database default, or the DSN's
    options): the staged text and the JSON the commit reads back must still be the source's
    characters, one that encoding cannot hold included, not mojibake nor an error on every
    run."""
    src = make_topic("ke-src", 1)
    out = make_topic("ke-out", 1)
    ids = [f"ke{unique}-caf\u00e9", f"ke{unique}-\U0001f600", f"ke{unique}-\u4e2d"]
    p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for i, event_id in enumerate(ids):
        body = {"event_id": event_id, "seq": i, "amount": 1.5, "checksum": "c"}
        p.produce(src, json.dumps(body, ensure_ascii=False).encode(), partition=0)
    assert p.flush(30) == 0
    dsn = psycopg2.extensions.make_dsn(pg_dsn, options="-c client_encoding=LATIN1")
    cfg = kafka_sink_pipeline(f"ke_{unique}", src, dsn, kafka_bootstrap, topic=out,
                              headers="none", key_column="event_id")
    planned = plan_only(cfg, dsn)
    assert planned.batch is not None
    rep = run_batch(spark, cfg, planned.batch.batch_id, dsn)
    assert rep.result.status == "committed", rep.result
    records = read_topic(kafka_bootstrap, out)
    assert [json.loads(r.value or b"")["event_id"] for r in records] == ids
    assert [r.key for r in records] == [i.encode() for i in ids]
