"""Issue 28 class 3, the PostgreSQL append sink: a replay of a recreated topic's window whose
coordinates still hold the old incarnation's rows (below the offset `reset-position
--archive-to` moved aside) deleted them with the window's own and wrote only the new
incarnation's: those records were gone from the target and the archive alike. An append
target holds one row per coordinates, so such a window is refused naming the rows; once
they are moved aside it commits."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from offsetflow.cli import main as cli
from offsetflow.errors import WindowIncarnationError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import kafka_for, plan_window, run_batches, run_until_caught_up, submit_window
from offsetflow.plan import parse_request
from tests.tooling import chaos
from tests.tooling.fault_case import Case
from tests.tooling.kafka_topics import recreate
from tests.tooling.pipeline_data import query


def test_a_replay_over_the_old_incarnations_rows_is_refused_not_a_silent_loss(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        spark: Any) -> None:
    topic = make_topic("pg-inc", 1)
    case = Case(tmp_path, pg_dsn, kafka_bootstrap, topic, 1, unique)
    old = case.workload
    old.plain(50)
    run_until_caught_up(case.cfg, case.dsn, spark)
    recreate(kafka_bootstrap, topic, 1)
    new = chaos.Workload(kafka_bootstrap, topic, 1, f"n{unique}")
    new.plain(60)
    archive = f"{case.table}_old"
    assert cli(["--dsn", case.dsn, "reset-position", "--pipeline-file", str(case.file),
                "--topic", topic, "--partition", "0", "--offset", "10", "--archive-to",
                archive, "--reason", "topic recreated"]) == 0  # old rows >= 10 moved
    run_until_caught_up(case.cfg, case.dsn, spark)

    def ids(table: str) -> Counter[str]:
        return Counter(r[0] for r in query(case.dsn, f"SELECT event_id FROM {table}"))

    before = ids(case.table)
    assert before == Counter([*(r.record_id for r in old.produced.values() if r.offset < 10),
                              *(r.record_id for r in new.produced.values() if r.offset >= 10)])
    cfg = case.cfg
    req = parse_request("replay", {"pipeline": cfg.name, "topic": topic, "partitions": "0",
                                   "from_offset": 0, "until_offset": 40})
    with Ledger(case.dsn) as ledger:
        bids = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req), "test")
    with pytest.raises(WindowIncarnationError, match=(
            rf"batch {bids[0]} \(replay of {topic}\[0\] \[0, 40\)\): {case.table} "
            rf"holds 10 rows there written by batch\(es\) \[\d+\] of another incarnation of "
            rf"{topic} .*nothing was written. Move those rows aside first")):
        run_batches(cfg, case.dsn, bids, spark)
    assert ids(case.table) == before  # nothing deleted, nothing written
    # the way out: the old incarnation's rows moved aside, the replay commits
    query(case.dsn, f"WITH m AS (DELETE FROM {case.table} WHERE \"offset\" < 10 AND "
                    f"event_id LIKE 'w%%' RETURNING *) INSERT INTO {archive} SELECT * FROM m")
    assert run_batch(spark, cfg, bids[0], case.dsn).result.status == "committed"
    assert ids(case.table) == Counter(r.record_id for r in new.produced.values())
    assert ids(archive) == Counter(r.record_id for r in old.produced.values())
