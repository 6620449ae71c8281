"""Crash-consistent staging (issue 15 item 1): PostgreSQL crashes (`pg_ctl stop -m
immediate`, which resets every UNLOGGED table) after a batch is staged and before its commit;
the next run must re-stage what the crash destroyed and commit every record exactly once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from offsetflow.errors import StagingIncompleteError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import run_until_caught_up
from tests.tooling import chaos
from tests.tooling.fault_case import Case
from tests.tooling.pipeline_data import query


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> Case:
    topic = make_topic("crash", 2)
    return Case(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)


@pytest.mark.parametrize("variant", ["append", "upsert", "transform"])
def test_postgres_crash_after_staging_rerun_commits_exactly_once(case: Case, spark: Any,
                                                                 variant: str) -> None:
    if variant == "upsert":
        case.raw["sink"].update({"mode": "upsert", "key": ["event_id"]})
    elif variant == "transform":
        case.raw["transform"] = "tests.tooling.chaos.maybe_fail_task"  # rows pass unchanged
    case.write_config()
    bid = case.planned_batch(3000, seed=11)
    case.postgres_down_in_commit(spark, bid, "pg-crash")
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert rep.result.rows_written == len([p for p in case.workload.produced.values()
                                           if p.committed])
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_part_with_fewer_rows_than_its_marker_is_refused_and_restaged(
        case: Case, spark: Any, spark_connect_url: str) -> None:
    """A part table that lost rows its marker counts (whatever removed them) is refused by
    name, its marker dropped, and the next attempt re-stages it from Kafka."""
    bid = case.planned_batch(3000, seed=12)
    with case.job_waiting_to_commit(bid, spark_connect_url) as proc:
        chaos.kill(proc)  # everything staged, nothing committed
    query(case.dsn, f"DELETE FROM offsetflow_stage.b{bid}_p1 WHERE ctid IN "
                    f"(SELECT ctid FROM offsetflow_stage.b{bid}_p1 LIMIT 5)")
    with pytest.raises(StagingIncompleteError, match=rf"batch {bid}: part 1 .* holds \d+ "
                                                     rf"rows but its marker counts \d+"):
        run_batch(spark, case.cfg, bid, case.dsn)
    with Ledger(case.dsn) as ledger:
        assert ledger.positions(case.cfg.name) == {k: 0 for k in case.positions()}
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()
