"""The core batch path on real Kafka, PostgreSQL and Spark (issue: core batch path)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka import TopicPartition as KTP
from confluent_kafka.admin import AdminClient

from offsetflow.errors import BadRecordError, DataLossError, FencedCommitError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only, run_until_caught_up
from offsetflow.ops.runner import run_cycle
from tests.tooling.pipeline_data import (
    end_offsets,
    pipeline_for,
    produce_plain,
    produce_transactional,
    query,
)


def target_rows(dsn: str, table: str) -> list[tuple[Any, ...]]:
    return query(dsn, f"SELECT event_id, seq, amount, checksum, topic, partition, \"offset\" "
                      f"FROM {table}")


def test_exactly_once_with_aborted_transactions_over_rate_limited_batches(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    parts = 6
    topic = make_topic("e2e", parts)
    produced = produce_plain(kafka_bootstrap, topic, 60_000, f"p{unique}", parts)
    produced = produce_transactional(
        kafka_bootstrap, topic,
        [(5000, True), (3000, False), (10_000, True), (2000, False), (5000, True)],
        f"tx{unique}", parts, produced)
    produced = produce_plain(kafka_bootstrap, topic, 20_000, f"q{unique}", parts, produced)
    assert len(produced.committed) == 100_000 and len(produced.aborted) == 5000

    table = f"e2e_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_records_per_partition=7000,
                       max_offsets_per_task=3000)
    results = run_until_caught_up(cfg, pg_dsn, spark, max_batches=20)
    committed_batches = [r for r in results if r.report is not None]
    assert len(committed_batches) >= 3, "the rate limit should need several batches"
    assert results[-1].report is None, "the last cycle finds nothing new"

    rows = target_rows(pg_dsn, table)
    ids = Counter(r[0] for r in rows)
    assert len(rows) == len(ids), f"duplicates: {[k for k, v in ids.items() if v > 1][:5]}"
    assert set(ids) == set(produced.committed), (
        f"missing {len(set(produced.committed) - set(ids))}, "
        f"unexpected {len(set(ids) - set(produced.committed))}")
    assert not set(ids) & produced.aborted
    for event_id, seq, amount, checksum, *_ in rows[:2000]:
        src = produced.committed[event_id]
        assert (seq, amount, checksum) == (src["seq"], src["amount"], src["checksum"])

    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(cfg.name)
        batches = ledger.recent_batches(cfg.name, 50)
    assert positions == end_offsets(kafka_bootstrap, topic, parts)
    assert all(b.status == "committed" for b in batches)
    assert sum(b.rows_written or 0 for b in batches) == 100_000
    # ranges of consecutive batches tile each partition with no gap and no overlap
    for p in range(parts):
        rs = sorted((r.from_offset, r.until_offset) for b in batches for r in b.ranges
                    if r.partition == p)
        assert rs[0][0] == 0
        assert all(a[1] == b[0] for a, b in zip(rs, rs[1:], strict=False))
        assert rs[-1][1] == positions[(topic, p)]


def test_rerun_after_death_duplicate_commit_and_stale_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("rerun", 2)
    produce_plain(kafka_bootstrap, topic, 1000, f"r{unique}", 2)
    table = f"rerun_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_records_per_partition=300)

    first = plan_only(cfg, pg_dsn)
    # the Spark job "died" right after planning: planning again returns the same batch
    again = plan_only(cfg, pg_dsn)
    assert again.reused and again.batch_id == first.batch_id
    assert again.batch is not None and first.batch is not None
    assert again.batch.ranges == first.batch.ranges

    assert first.batch_id is not None
    rep = run_batch(spark, cfg, first.batch_id, pg_dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == 600
    dup = run_batch(spark, cfg, first.batch_id, pg_dsn)
    assert dup.result.status == "already_committed"
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 600

    # a stale batch (planned from the old positions) cannot move a position backwards
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        stale_id = ledger.insert_batch(cur, pipeline=cfg.name, kind="scheduled",
                                       ranges=first.batch.ranges, target_table=table,
                                       config_fingerprint=cfg.fingerprint(),
                                       split_offsets=cfg.spark.max_offsets_per_task,
                                       started_by="zombie")
    with pytest.raises(FencedCommitError, match=f"batch {stale_id} fenced"):
        run_batch(spark, cfg, stale_id, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 600
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 300, (topic, 1): 300}
        assert ledger.get_batch(stale_id).status == "failed"
        ledger.abandon(stale_id, "test: stale")
    # and the pipeline carries on from where it was
    run_until_caught_up(cfg, pg_dsn, spark)
    assert query(pg_dsn, f"SELECT count(DISTINCT event_id) FROM {table}")[0][0] == 1000


def test_retention_deleted_records_stop_with_data_loss_error(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("loss", 2)
    produce_plain(kafka_bootstrap, topic, 400, f"l{unique}", 2)
    table = f"loss_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_records_per_partition=50)
    run_cycle(cfg, pg_dsn, spark)  # positions now at 50 per partition
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for f in admin.delete_records([KTP(topic, 0, 120)]).values():
        f.result(timeout=30)

    with pytest.raises(DataLossError) as ei:
        run_cycle(cfg, pg_dsn, spark)
    e = ei.value
    assert (e.topic, e.partition, e.missing_from, e.missing_until) == (topic, 0, 50, 120)
    assert f"{topic}[0]" in str(e) and "[50, 120)" in str(e)
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 50, (topic, 1): 50}
        loss = ledger.data_loss_events(cfg.name)
        assert [(x["topic"], x["partition"], x["missing_from"], x["missing_until"])
                for x in loss] == [(topic, 0, 50, 120)]
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 100


def test_records_deleted_after_planning_fail_the_read(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("loss2", 1)
    produce_plain(kafka_bootstrap, topic, 200, f"m{unique}", 1)
    table = f"loss2_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table)
    out = plan_only(cfg, pg_dsn)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for f in admin.delete_records([KTP(topic, 0, 80)]).values():
        f.result(timeout=30)
    assert out.batch_id is not None
    with pytest.raises(Exception, match=r"data loss on .*\[0\]: offsets \[0, 80\)"):
        run_batch(spark, cfg, out.batch_id, pg_dsn)
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 0}  # the start, nothing committed
        assert ledger.get_batch(out.batch_id).status == "failed"
    assert query(pg_dsn, "SELECT count(*) FROM information_schema.tables WHERE table_name=%s",
                 (table,))[0][0] in (0, 1)


def _produce_with_bad(bootstrap: str, topic: str, unique: str) -> None:
    produce_plain(bootstrap, topic, 100, f"b{unique}", 1)
    p = Producer({"bootstrap.servers": bootstrap})
    p.produce(topic, b'{"event_id": "broken', partition=0)  # offset 100
    p.produce(topic, json.dumps({"event_id": "x", "seq": "not a number"}).encode(), partition=0)
    p.flush(30)
    produce_plain(bootstrap, topic, 50, f"c{unique}", 1)


def test_malformed_record_fails_batch_by_default(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("bad", 1)
    _produce_with_bad(kafka_bootstrap, topic, unique)
    table = f"bad_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table)
    with pytest.raises(BadRecordError) as ei:
        run_cycle(cfg, pg_dsn, spark)
    e = ei.value
    assert (e.topic, e.partition, e.offset) == (topic, 0, 100)
    assert "invalid JSON" in e.reason and e.more == 1
    assert f"{topic}[0]@100" in str(e)
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 0}  # the start, nothing committed
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 0


def test_malformed_record_goes_to_dead_letter_and_rest_commits(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("dlq", 1)
    _produce_with_bad(kafka_bootstrap, topic, unique)
    table = f"dlq_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, bad_records="dead_letter",
                       dead_letter_table=f"dead_{unique}")
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None
    assert res.report.result.rows_written == 150 and res.report.result.bad_records == 2
    dead = query(pg_dsn, f"SELECT topic, partition, \"offset\", value, error, pipeline "
                         f"FROM dead_{unique} ORDER BY \"offset\"")
    assert [(d[0], d[1], d[2]) for d in dead] == [(topic, 0, 100), (topic, 0, 101)]
    assert bytes(dead[0][3]) == b'{"event_id": "broken'
    assert "invalid JSON" in dead[0][4] and "field 'seq'" in dead[1][4]
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 150
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 152}


def test_upsert_mode_keeps_one_row_per_key(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("ups", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for version in range(3):
        for k in range(10):
            p.produce(topic, json.dumps({"event_id": f"k{k}", "seq": version, "amount": 1.0,
                                         "checksum": "x"}).encode(), partition=0)
        p.flush(30)
    table = f"ups_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"],
                       max_records_per_partition=15)
    run_until_caught_up(cfg, pg_dsn, spark)
    rows = query(pg_dsn, f"SELECT event_id, seq FROM {table} ORDER BY event_id")
    assert rows == [(f"k{k}", 2) for k in sorted(range(10), key=lambda k: f"k{k}")]


def test_abandoned_batch_staging_is_cleaned_up(pg_dsn: str, kafka_bootstrap: str,
                                               make_topic: Any, unique: str) -> None:
    from offsetflow.commit import create_stage_tables

    topic = make_topic("aband", 1)
    produce_plain(kafka_bootstrap, topic, 10, f"a{unique}", 1)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"aband_{unique}")
    out = plan_only(cfg, pg_dsn)
    assert out.batch_id is not None
    create_stage_tables(pg_dsn, out.batch_id, [("topic", "text"), ("partition", "integer"),
                                               ("offset", "bigint")])
    query(pg_dsn, "INSERT INTO offsetflow.staged_parts (batch_id, kind, part, rows_staged, "
                  "bad_records) VALUES (%s, 'rows', 0, 3, 0)", (out.batch_id,))

    def staged() -> int:
        return query(pg_dsn, "SELECT count(*) FROM pg_tables WHERE schemaname = "
                             "'offsetflow_stage' AND tablename LIKE %s",
                     (f"b{out.batch_id}%",))[0][0]

    assert staged() == 2
    with Ledger(pg_dsn) as ledger:
        # an open batch keeps its staged data (the ledger is shared with the other tests
        # running at once: another's closed batch may be cleaned here too)
        assert out.batch_id not in ledger.cleanup_staging()
        ledger.abandon(out.batch_id, "test: give up")
        assert ledger.get_batch(out.batch_id).status == "abandoned"
    assert staged() == 0
    assert query(pg_dsn, "SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s",
                 (out.batch_id,))[0][0] == 0
    # leftovers of a closed batch (e.g. a crash after commit) are dropped by `cleanup`
    create_stage_tables(pg_dsn, out.batch_id, [("topic", "text")])
    with Ledger(pg_dsn) as ledger:
        assert out.batch_id in ledger.cleanup_staging()
    assert staged() == 0
    # and the next plan starts from the same place: abandoning moved no position
    again = plan_only(cfg, pg_dsn)
    assert again.batch is not None and out.batch is not None
    assert again.batch.ranges == out.batch.ranges and again.batch_id != out.batch_id
