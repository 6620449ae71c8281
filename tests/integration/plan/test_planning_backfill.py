"""Backfills against the live position, on real Kafka, PostgreSQL and Spark.

A backfill into the pipeline's own table may only cover offsets the live pipeline has already
committed: rows beyond the live position would make every later live batch fail on the
coordinates index. Into another table, or fully below the position, it works.
"""

from __future__ import annotations

from typing import Any

import pytest

from offsetflow.errors import RequestError
from offsetflow.ledger import Ledger
from offsetflow.ops import kafka_for, plan_window, run_batches, run_until_caught_up, submit_window
from offsetflow.ops.runner import run_cycle
from offsetflow.plan import parse_request
from tests.tooling.pipeline_data import pipeline_for, produce_plain, query


def _backfill(cfg: Any, dsn: str, spark: Any, **conf: Any) -> list[int]:
    req = parse_request("backfill", {"pipeline": cfg.name, **conf})
    with Ledger(dsn) as ledger:
        wp = plan_window(cfg, ledger, kafka_for(cfg), req)
        ids = submit_window(cfg, ledger, wp, "test")
    run_batches(cfg, dsn, ids, spark)
    return ids


def _once(dsn: str, table: str) -> dict[str, int]:
    return dict(query(dsn, f"SELECT event_id, count(*) FROM {table} GROUP BY 1"))


def test_backfill_into_own_table_ahead_of_live_position_is_refused(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("bfa", 2)
    produced = produce_plain(kafka_bootstrap, topic, 200, f"a{unique}", 2)
    table = f"bfa_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_records_per_partition=50)
    run_cycle(cfg, pg_dsn, spark)  # live position 50 on both partitions
    dry = parse_request("backfill", {"pipeline": cfg.name, "from_offset": 0,
                                     "until_offset": 80, "dry_run": True})
    with Ledger(pg_dsn) as ledger:  # a dry run shows why the real run would be refused
        assert "live position 50" in plan_window(cfg, ledger, kafka_for(cfg),
                                                 dry).report()["refused"]
    for target in ({}, {"target_table": f"public.{table}"}):
        with pytest.raises(RequestError, match=rf"{topic}\[0\] \[0, 80\).*live position 50.*"
                                               r"target_table.*replay"):
            _backfill(cfg, pg_dsn, spark, topic=topic, partitions="0", from_offset=0,
                      until_offset=80, **target)
    with Ledger(pg_dsn) as ledger:
        assert [b.kind for b in ledger.recent_batches(cfg.name)] == ["scheduled"]
    run_until_caught_up(cfg, pg_dsn, spark)  # the live pipeline is not wedged
    assert _once(pg_dsn, table) == {k: 1 for k in produced.committed}


def test_backfill_below_live_position_or_into_another_table_works(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("bfb", 2)
    produced = produce_plain(kafka_bootstrap, topic, 200, f"b{unique}", 2)
    table = f"bfb_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_records_per_partition=50)
    run_cycle(cfg, pg_dsn, spark)
    _backfill(cfg, pg_dsn, spark, topic=topic, from_offset=10, until_offset=50,
              records_per_batch=30)  # own table, fully below the position: replaced
    side = f"bfb_side_{unique}"
    _backfill(cfg, pg_dsn, spark, topic=topic, from_offset=0, until_offset=100,
              target_table=side)  # ahead of the position, into another table
    run_until_caught_up(cfg, pg_dsn, spark)
    assert _once(pg_dsn, table) == {k: 1 for k in produced.committed}
    assert _once(pg_dsn, side) == {k: 1 for k in produced.committed}
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 100, (topic, 1): 100}
