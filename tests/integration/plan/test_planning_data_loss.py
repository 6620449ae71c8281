"""Data loss under both policies on real Kafka: records deleted past a committed position.

`data_loss: continue` must commit (skipping the gap, recorded in offsetflow.data_loss) while
the fence still refuses zombies; `data_loss: fail` names topic, partition and missing offsets.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import TopicPartition as KTP
from confluent_kafka.admin import AdminClient

from offsetflow.errors import BatchStateError, DataLossError, FencedCommitError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only, run_until_caught_up
from offsetflow.ops.runner import run_cycle
from offsetflow.ranges import OffsetRange
from tests.tooling.pipeline_data import pipeline_for, produce_plain, query


def _delete_before(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.delete_records([KTP(topic, partition, offset)]).values():
        f.result(timeout=30)


def test_data_loss_continue_commits_past_a_gap_after_a_position(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("dlc", 2)
    first = produce_plain(kafka_bootstrap, topic, 200, f"a{unique}", 2)  # 100 per partition
    table = f"dlc_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, data_loss="continue")
    run_cycle(cfg, pg_dsn, spark)
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 100, (topic, 1): 100}
    more = produce_plain(kafka_bootstrap, topic, 200, f"b{unique}", 2, start_seq=200)
    _delete_before(kafka_bootstrap, topic, 0, 150)  # offsets [100, 150) of partition 0 gone

    results = run_until_caught_up(cfg, pg_dsn, spark, max_batches=3)
    assert results[0].report is not None
    assert results[0].report.result.status == "committed"
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 200, (topic, 1): 200}
        loss = [(x["topic"], x["partition"], x["missing_from"], x["missing_until"],
                 x["policy"], x["batch_id"]) for x in ledger.data_loss_events(cfg.name)]
        assert loss == [(topic, 0, 100, 150, "continue", results[0].report.batch_id)]
        cur_hist = ledger.conn.cursor()
        cur_hist.execute("""SELECT old_offset, new_offset FROM offsetflow.position_history
                             WHERE pipeline = %s AND partition = 0 AND reason LIKE 'commit%%'
                             ORDER BY id""", (cfg.name,))
        assert cur_hist.fetchall() == [(0, 100), (100, 200)]
    # rows: all of the first 200, the second batch's except the deleted 50, each once
    rows = dict(query(pg_dsn, f"SELECT event_id, count(*) FROM {table} GROUP BY 1"))
    assert set(rows.values()) == {1}
    gone = {f"b{unique}-{i}" for i in range(200, 400) if i % 2 == 0 and (i - 200) // 2 < 50}
    assert set(rows) == set(first.committed) | (set(more.committed) - gone)


def test_data_loss_continue_still_fences_a_zombie(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A batch planned across the gap carries the position it expects; once the position
    has moved (another run committed), a stale copy of it is refused."""
    topic = make_topic("dlz", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"a{unique}", 1)
    table = f"dlz_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, data_loss="continue")
    run_cycle(cfg, pg_dsn, spark)
    produce_plain(kafka_bootstrap, topic, 100, f"b{unique}", 1, start_seq=100)
    _delete_before(kafka_bootstrap, topic, 0, 130)
    planned = plan_only(cfg, pg_dsn).batch
    assert planned is not None and planned.ranges[0].from_offset == 130
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:  # a zombie copy of it
        zombie = ledger.insert_batch(cur, pipeline=cfg.name, kind="replay",
                                     ranges=planned.ranges, target_table=table,
                                     config_fingerprint=cfg.fingerprint(),
                                     split_offsets=cfg.spark.max_offsets_per_task,
                                     started_by="zombie", expected_positions={(topic, 0): 100})
        cur.execute("UPDATE offsetflow.batches SET kind = 'scheduled', status = 'abandoned', "
                    "moves_positions = true WHERE batch_id = %s", (zombie,))
    assert run_batch(spark, cfg, planned.batch_id, pg_dsn).result.status == "committed"
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        cur.execute("UPDATE offsetflow.batches SET status = 'planned' WHERE batch_id = %s",
                    (zombie,))
    with pytest.raises(FencedCommitError, match=f"batch {zombie} fenced.*expected committed "
                                                f"position 100, found 200"):
        run_batch(spark, cfg, zombie, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 170


def test_data_loss_fail_names_topic_partition_and_offsets(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("dlf", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"a{unique}", 1)
    table = f"dlf_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table)  # data_loss: fail (default)
    run_cycle(cfg, pg_dsn, spark)
    produce_plain(kafka_bootstrap, topic, 100, f"b{unique}", 1, start_seq=100)
    _delete_before(kafka_bootstrap, topic, 0, 140)
    with pytest.raises(DataLossError, match=rf"data loss on {topic}\[0\]: offsets \[100, 140\) "
                                            r"\(40 offsets\).*data_loss: continue"):
        plan_only(cfg, pg_dsn)
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 100}
        assert [(x["missing_from"], x["missing_until"], x["policy"])
                for x in ledger.data_loss_events(cfg.name)] == [(100, 140, "fail")]
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 100


def test_data_loss_continue_replans_an_open_batch_whose_records_were_deleted(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Records deleted after planning but before the read: under `continue` the open batch
    can never be read (it failed with DataLossError on every retry); the next plan abandons
    it and plans past the gap."""
    topic = make_topic("dlo", 1)
    produced = produce_plain(kafka_bootstrap, topic, 200, f"a{unique}", 1)
    table = f"dlo_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, data_loss="continue")
    stale = plan_only(cfg, pg_dsn).batch
    assert stale is not None
    _delete_before(kafka_bootstrap, topic, 0, 80)
    with pytest.raises(Exception, match=r"data loss on .*\[0\]: offsets \[0, 80\)"):
        run_batch(spark, cfg, stale.batch_id, pg_dsn)

    res = run_cycle(cfg, pg_dsn, spark)  # the scheduled run: plan (or re-use), read, commit
    assert res.report is not None and res.report.batch_id != stale.batch_id
    assert res.report.result.status == "committed"
    with Ledger(pg_dsn) as ledger:
        old = ledger.get_batch(stale.batch_id)
        assert old.status == "abandoned" and "[0, 80)" in (old.error or "")
        assert ledger.positions(cfg.name) == {(topic, 0): 200}
        assert [(x["missing_from"], x["missing_until"], x["batch_id"])
                for x in ledger.data_loss_events(cfg.name)] == [(0, 80, res.report.batch_id)]
    rows = dict(query(pg_dsn, f"SELECT event_id, count(*) FROM {table} GROUP BY 1"))
    assert rows == {f"a{unique}-{i}": 1 for i in range(80, 200)}
    assert len(produced.committed) == 200


def _fail_inserts(dsn: str, table: str, on: bool) -> None:
    """A trigger that makes every insert into `table` fail: the commit fails after staging."""
    if on:
        query(dsn, f"CREATE OR REPLACE FUNCTION fail_{table}() RETURNS trigger "
                   f"LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'test: commit refused'; "
                   f"END $$")
        query(dsn, f"CREATE TRIGGER fail_ins BEFORE INSERT ON {table} "
                   f"FOR EACH ROW EXECUTE FUNCTION fail_{table}()")
    else:
        query(dsn, f"DROP TRIGGER fail_ins ON {table}")


@pytest.mark.parametrize("partitions", [1, 20])
def test_data_loss_continue_commits_a_staged_batch_whose_records_were_deleted(
        partitions: int, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    """A batch read and staged in full whose commit failed: retention then deletes part of
    its offsets. Its stage still holds those records, so planning must re-use it (not
    abandon it as 'deleted before read') and the run commits them all. With 20 partitions
    the sub-ranges are packed into fewer tasks (part k is no longer sub-range k): planning
    must find the deleted offsets in the part whose marker names their sub-range."""
    topic = make_topic("dls", partitions)
    produced = produce_plain(kafka_bootstrap, topic, 100 * partitions, f"a{unique}",
                             partitions)
    table = f"dls_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, data_loss="continue",
                       mode="upsert", key=["event_id"])
    run_cycle(cfg, pg_dsn, spark)
    produce_plain(kafka_bootstrap, topic, 500 * partitions, f"a{unique}", partitions,
                  produced, start_seq=100 * partitions)
    _fail_inserts(pg_dsn, table, True)
    with pytest.raises(Exception, match="commit refused"):
        run_cycle(cfg, pg_dsn, spark)
    _fail_inserts(pg_dsn, table, False)
    with Ledger(pg_dsn) as ledger:
        failed = ledger.open_batch(ledger.conn.cursor(), cfg.name)
    assert failed is not None and failed.status == "failed"
    parts = query(pg_dsn, "SELECT count(*), sum(rows_staged) FROM offsetflow.staged_parts "
                          "WHERE batch_id = %s AND kind = 'rows'", (failed.batch_id,))
    assert parts[0][1] == 500 * partitions, parts
    if partitions > 1:
        assert parts[0][0] < partitions, parts  # packed: fewer parts than sub-ranges
    last = partitions - 1  # [100, 300) of the last partition: gone from Kafka, not stage
    _delete_before(kafka_bootstrap, topic, last, 300)

    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.batch_id == failed.batch_id
    assert res.report.result.status == "committed"
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, p): 600 for p in range(partitions)}
        assert ledger.data_loss_events(cfg.name) == []
    rows = dict(query(pg_dsn, f"SELECT event_id, count(*) FROM {table} GROUP BY 1"))
    assert rows == {k: 1 for k in produced.committed}


def test_data_loss_continue_never_abandons_a_running_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A running batch (a live job, or a zombie) whose offsets were deleted is not
    abandoned under it: planning fails naming the batch and `offsetflow abandon`."""
    topic = make_topic("dlr", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"a{unique}", 1)
    table = f"dlr_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, data_loss="continue")
    planned = plan_only(cfg, pg_dsn).batch
    assert planned is not None
    with Ledger(pg_dsn) as ledger:
        ledger.mark_running(planned.batch_id)
    _delete_before(kafka_bootstrap, topic, 0, 50)
    with pytest.raises(BatchStateError, match=rf"batch {planned.batch_id} is running.*"
                                              rf"offsetflow abandon --batch-id "
                                              rf"{planned.batch_id}"):
        plan_only(cfg, pg_dsn)
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(planned.batch_id).status == "running"
        assert ledger.data_loss_events(cfg.name) == []


def _wedged_by_the_old_release(cfg: Any, pg_dsn: str, kafka_bootstrap: str, topic: str,
                               unique: str, spark: Any) -> int:
    """Position 100, offsets [100, 130) deleted, and the open batch the release before
    ledger migration 0005 planned past the gap: [130, 200) without an expected position
    (NULL after the migration), and its gap recorded without a batch."""
    produce_plain(kafka_bootstrap, topic, 100, f"a{unique}", 1)
    run_cycle(cfg, pg_dsn, spark)
    produce_plain(kafka_bootstrap, topic, 100, f"b{unique}", 1, start_seq=100)
    _delete_before(kafka_bootstrap, topic, 0, 130)
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        batch_id = ledger.insert_batch(
            cur, pipeline=cfg.name, kind="scheduled",
            ranges=[OffsetRange(topic, 0, 130, 200)], target_table=cfg.sink.table,
            config_fingerprint=cfg.fingerprint(),
            split_offsets=cfg.spark.max_offsets_per_task, started_by="old release")
        cur.execute("""INSERT INTO offsetflow.data_loss (pipeline, topic, partition,
                         missing_from, missing_until, policy)
                       VALUES (%s, %s, 0, 100, 130, 'continue')""", (cfg.name, topic))
    return batch_id


def test_data_loss_continue_unwedges_a_batch_planned_by_the_old_release(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("dlw", 1)
    table = f"dlw_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, data_loss="continue")
    wedged = _wedged_by_the_old_release(cfg, pg_dsn, kafka_bootstrap, topic, unique, spark)

    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.batch_id == wedged
    assert res.report.result.status == "committed"
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 200}
        assert [(x["missing_from"], x["missing_until"], x["batch_id"])
                for x in ledger.data_loss_events(cfg.name)] == [(100, 130, wedged)]
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT event_id) FROM {table}") \
        == [(170, 170)]


def test_a_fenced_open_scheduled_batch_names_the_way_out(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Under `fail` the old release's batch is not adopted; its fence error must say how
    to get out (it would otherwise fail the same way forever)."""
    topic = make_topic("dlx", 1)
    table = f"dlx_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table)
    wedged = _wedged_by_the_old_release(cfg, pg_dsn, kafka_bootstrap, topic, unique, spark)
    assert plan_only(cfg, pg_dsn).batch_id == wedged
    with pytest.raises(FencedCommitError, match=rf"expected committed position 130, found "
                                                rf"100.*offsetflow abandon --batch-id {wedged}"):
        run_batch(spark, cfg, wedged, pg_dsn)


def test_data_loss_continue_records_a_gap_once_even_with_nothing_left_to_read(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Every record after the position deleted (earliest == latest): no batch covers the
    partition, the gap is still recorded, once, and linked to the batch that skips it."""
    topic = make_topic("dle", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"a{unique}", 1)
    table = f"dle_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, data_loss="continue")
    run_cycle(cfg, pg_dsn, spark)
    produce_plain(kafka_bootstrap, topic, 100, f"b{unique}", 1, start_seq=100)
    _delete_before(kafka_bootstrap, topic, 0, 200)

    def loss() -> list[tuple[int, int, Any]]:
        with Ledger(pg_dsn) as ledger:
            return [(x["missing_from"], x["missing_until"], x["batch_id"])
                    for x in ledger.data_loss_events(cfg.name)]
    assert plan_only(cfg, pg_dsn).batch is None
    assert plan_only(cfg, pg_dsn).batch is None
    assert loss() == [(100, 200, None)]
    produce_plain(kafka_bootstrap, topic, 10, f"c{unique}", 1, start_seq=200)
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    assert loss() == [(100, 200, res.report.batch_id)]
    assert query(pg_dsn, f"SELECT count(*) FROM {table}") == [(110,)]
