"""`offsetflow reset-position` against what else the pipeline has written or will write, on
real Kafka, PostgreSQL and Spark: open backfills, mixed-case sink tables, dead letters."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Producer

from offsetflow.errors import BatchStateError, PositionResetError
from offsetflow.ledger import Ledger
from offsetflow.ops import (
    kafka_for,
    plan_window,
    reset_positions,
    run_until_caught_up,
    submit_window,
)
from offsetflow.ops.runner import run_cycle
from offsetflow.plan import parse_request
from tests.tooling.pipeline_data import pipeline_for, produce_plain, query


def _reset(cfg: Any, dsn: str, topic: str, offset: int, archive_to: str | None = None) -> int:
    topic_id = kafka_for(cfg).topic_ids([topic])[topic]
    with Ledger(dsn) as ledger:
        return reset_positions(ledger, cfg.name, topic, [0], offset, "test", topic_id=topic_id,
                               target_table=cfg.sink.table, archive_to=archive_to,
                               dead_letter_table=cfg.dead_letter_table)


def test_reset_position_refuses_under_an_open_backfill_reaching_past_it(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A backfill into the pipeline's own table [10, 20), accepted while the position was
    100: after a reset to 0 it would commit rows the live batch then collides with."""
    topic = make_topic("rpb", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"a{unique}", 1)
    table = f"rpb_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table)
    run_cycle(cfg, pg_dsn, spark)
    req = parse_request("backfill", {"pipeline": cfg.name, "topic": topic,
                                     "from_offset": 10, "until_offset": 20})
    with Ledger(pg_dsn) as ledger:
        [backfill] = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req),
                                   "test")
    with pytest.raises(BatchStateError, match=rf"batch {backfill} \(backfill, planned\).*"
                                              rf"{topic}\[0\] \[10, 20\).*offsetflow abandon "
                                              rf"--batch-id {backfill}"):
        _reset(cfg, pg_dsn, topic, 0, archive_to=f"rpb_arch_{unique}")
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 100}
    assert query(pg_dsn, f"SELECT count(*) FROM {table}") == [(100,)]
    _reset(cfg, pg_dsn, topic, 20, archive_to=f"rpb_arch_{unique}")  # not past it: fine


def test_reset_position_guards_a_mixed_case_sink_table(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("rpm", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"a{unique}", 1)
    table = f"Orders_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, name=f"rpm_{unique}")
    run_cycle(cfg, pg_dsn, spark)
    with pytest.raises(PositionResetError, match=rf"{table} holds 50 rows of {topic} at "
                                                 rf"offsets >= 50"):
        _reset(cfg, pg_dsn, topic, 50)
    moved = _reset(cfg, pg_dsn, topic, 50, archive_to=f"Orders_arch_{unique}")
    assert moved == 50
    assert query(pg_dsn, f'SELECT count(*) FROM "Orders_arch_{unique}"') == [(50,)]


def test_reset_position_guards_dead_letters(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Dead letters at or beyond the new position would be written again by the re-run:
    refused, or archived with the sink rows in the same transaction."""
    topic = make_topic("rpd", 1)
    produce_plain(kafka_bootstrap, topic, 50, f"a{unique}", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(10):  # offsets 50..59: not JSON
        p.produce(topic, f"not json {i}".encode(), partition=0)
    assert p.flush(30) == 0
    table = f"rpd_{unique}"
    dlt = f"rpd_dl_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, bad_records="dead_letter",
                       dead_letter_table=dlt)
    run_cycle(cfg, pg_dsn, spark)
    assert query(pg_dsn, f"SELECT count(*) FROM {dlt}") == [(10,)]
    with pytest.raises(PositionResetError, match=rf"{dlt} holds 10 dead letters of {topic} "
                                                 rf"at offsets >= 50.*--archive-to"):
        _reset(cfg, pg_dsn, topic, 50)
    _reset(cfg, pg_dsn, topic, 50, archive_to=f"rpd_arch_{unique}")
    assert query(pg_dsn, f"SELECT count(*) FROM rpd_arch_{unique}_dead_letter") == [(10,)]
    run_until_caught_up(cfg, pg_dsn, spark, max_batches=3)
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT \"offset\") FROM {dlt} "
                         f"WHERE pipeline = %s", (cfg.name,)) == [(10, 10)]
    assert query(pg_dsn, f"SELECT count(*) FROM {table}") == [(50,)]
