"""The part-wise commit on real Kafka and PostgreSQL, driven step by step without Spark: parts
are read and staged by the same code a Spark task runs, so each test decides exactly when a
part becomes staged relative to the commit that moves it."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from offsetflow.commit import PartwiseCommit, create_stage_tables, ensure_dead_letter, ensure_target
from offsetflow.errors import FencedCommitError
from offsetflow.job import run_batch
from offsetflow.job.tasks import ReadContext, read_subrange, stage_columns
from offsetflow.ledger import Batch, Ledger, stage_part_table
from offsetflow.ops import plan_only
from offsetflow.ranges import split_ranges
from offsetflow.stage import TaskClock, binary_encoder, stage_rows
from tests.tooling.chaos import wait_for
from tests.tooling.pipeline_data import pipeline_for, produce_plain, query


class Staging:
    """One planned batch, split into parts, with the stage and target created as a run
    creates them; `stage(i)` does what the Spark task of part i does."""

    def __init__(self, dsn: str, bootstrap: str, topic: str, table: str) -> None:
        self.dsn = dsn
        self.cfg = pipeline_for(topic, dsn, bootstrap, table, max_offsets_per_task=100)
        planned = plan_only(self.cfg, dsn)
        assert planned.batch is not None
        self.batch: Batch = planned.batch
        self.specs = [r.to_dict() for r in split_ranges(self.batch.ranges, 100)]
        self.columns = stage_columns(self.cfg)
        with Ledger(dsn) as ledger, ledger.transaction() as cur:
            ensure_target(cur, table, self.columns, "append", [])
        create_stage_tables(dsn, self.batch.batch_id, self.columns, parts=len(self.specs))
        self.timings: dict[str, float] = {}

    def stage(self, part: int) -> int:
        rc = ReadContext.of(self.cfg, self.batch.batch_id, self.dsn, self.specs)
        clock = TaskClock()
        stats = stage_rows(self.dsn, self.batch.batch_id, part, read_subrange(rc, part, clock),
                           clock, binary_encoder([t for _, t in self.columns]),
                           table=stage_part_table(self.batch.batch_id, part))
        return int(stats["rows"])

    def committer(self, batch: Batch | None = None) -> PartwiseCommit:
        return PartwiseCommit(self.dsn, batch or self.batch,
                              columns=[c for c, _ in self.columns], parts=len(self.specs),
                              dead_letter_table=None, timings=self.timings)


@pytest.fixture
def staging(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> Staging:
    topic = make_topic("partwise", 2)
    produce_plain(kafka_bootstrap, topic, 400, f"pw{unique}", 2)  # 200 per partition
    return Staging(pg_dsn, kafka_bootstrap, topic, f"pw_{unique}")


def count(dsn: str, table: str) -> int:
    return int(query(dsn, f"SELECT count(*) FROM {table}")[0][0])


def test_parts_move_while_others_are_read_and_show_only_at_commit(staging: Staging) -> None:
    s = staging
    assert len(s.specs) == 4  # 2 partitions x 200 records, 100 per part
    table = s.batch.target_table
    with s.committer() as committer:
        assert s.stage(0) == 100 and s.stage(2) == 100
        wait_for(lambda: s.timings.get("commit_overlapped_s", 0) > 0, 30,
                 "the staged parts to be moved while the others are unread")
        assert count(s.dsn, table) == 0  # moved inside the open commit: not visible yet
        assert query(s.dsn, "SELECT status FROM offsetflow.batches WHERE batch_id = %s",
                     (s.batch.batch_id,))[0][0] == "planned"
        assert s.stage(1) == 100 and s.stage(3) == 100
        result = committer.finish(expected_parts=4)
    assert result.status == "committed" and result.rows_written == 400
    assert count(s.dsn, table) == 400
    assert query(s.dsn, f"SELECT count(DISTINCT (partition, \"offset\")) FROM {table}"
                 )[0][0] == 400
    ranges = query(s.dsn, "SELECT partition, records FROM offsetflow.batch_ranges "
                          "WHERE batch_id = %s ORDER BY partition", (s.batch.batch_id,))
    assert ranges == [(0, 200), (1, 200)]
    with Ledger(s.dsn) as ledger:
        assert set(ledger.positions(s.cfg.name).values()) == {200}
    assert query(s.dsn, "SELECT count(*) FROM pg_tables WHERE schemaname = 'offsetflow_stage' "
                        "AND tablename LIKE %s", (f"b{s.batch.batch_id}%",))[0][0] == 0


def test_aborted_commit_rolls_back_moved_parts_and_a_rerun_commits_once(
        staging: Staging, spark: Any) -> None:
    s = staging
    with s.committer() as committer:
        s.stage(0)
        wait_for(lambda: s.timings.get("commit_overlapped_s", 0) > 0, 30, "part 0 to be moved")
        committer.abort()  # as when the Spark job fails after part 0
    assert count(s.dsn, s.batch.target_table) == 0
    with Ledger(s.dsn) as ledger:
        assert ledger.get_batch(s.batch.batch_id).status == "planned"
        assert set(ledger.positions(s.cfg.name).values()) == {0}
    # the re-run reuses part 0's staging and commits every record once
    rep = run_batch(spark, s.cfg, s.batch.batch_id, s.dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == 400
    assert query(s.dsn, f"SELECT count(*), count(DISTINCT (partition, \"offset\")) FROM "
                        f"{s.batch.target_table}")[0] == (400, 400)


def test_zombie_whose_rows_are_already_committed_is_fenced_not_a_key_error(
        staging: Staging, spark: Any) -> None:
    s = staging
    assert run_batch(spark, s.cfg, s.batch.batch_id, s.dsn).result.status == "committed"
    with Ledger(s.dsn) as ledger, ledger.transaction() as cur:
        zombie_id = ledger.insert_batch(cur, pipeline=s.cfg.name, kind="scheduled",
                                        ranges=s.batch.ranges, target_table=s.batch.target_table,
                                        config_fingerprint=s.cfg.fingerprint(),
                                        split_offsets=s.cfg.spark.max_offsets_per_task,
                                        started_by="zombie")
    with Ledger(s.dsn) as ledger:
        zombie = ledger.get_batch(zombie_id)
    s.batch = zombie
    create_stage_tables(s.dsn, zombie_id, s.columns, parts=len(s.specs))
    with s.committer(zombie) as committer:  # no pre-check: the move itself hits the rows
        for part in range(len(s.specs)):
            s.stage(part)
        with pytest.raises(FencedCommitError, match=f"batch {zombie_id} fenced") as err:
            committer.finish(expected_parts=len(s.specs))
    assert "duplicate key" in str(err.value.__cause__)
    assert count(s.dsn, s.batch.target_table) == 400


def test_two_runs_creating_the_same_stage_and_target_at_once_both_succeed(
        pg_dsn: str, unique: str) -> None:
    """An Airflow retry beside a zombie run creates the same tables at the same moment; plain
    IF NOT EXISTS loses that race with a pg_type unique violation."""
    columns = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
               ("value", "bytea")]
    table = f"race_{unique}"
    batch_id = random.randrange(10**9, 2 * 10**9)  # never a real batch of this database
    errors: list[BaseException] = []
    barrier = threading.Barrier(6)

    def create() -> None:
        try:
            barrier.wait(10)
            with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
                ensure_target(cur, table, columns, "append", [])
                ensure_dead_letter(cur, f"{table}_dl")
            create_stage_tables(pg_dsn, batch_id, columns, parts=8)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    for _ in range(3):  # the race is short; three rounds make a regression show up
        threads = [threading.Thread(target=create) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        query(pg_dsn, f"DROP TABLE offsetflow_stage.b{batch_id} CASCADE")
        query(pg_dsn, f"DROP TABLE offsetflow_stage.b{batch_id}_dead")
        query(pg_dsn, f'DROP TABLE "{table}", "{table}_dl"')
