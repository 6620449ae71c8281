"""Upsert and tombstone semantics of the commit on real Kafka, Spark and PostgreSQL (issue 15
items 3-6): the latest offset wins, a replay never moves a key backwards, rows without a key
and tombstones are dead letters or deletes by policy, never lost and never a failed batch."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import reset_positions, run_until_caught_up
from offsetflow.ops.runner import run_cycle
from offsetflow.ranges import OffsetRange
from tests.tooling.kafka_topics import recreate
from tests.tooling.pipeline_data import ev, pipeline_for, produce, query


def rows(dsn: str, table: str, cols: str = "event_id, amount") -> dict[Any, Any]:
    return {r[0]: r[1:] if len(r) > 2 else r[1]
            for r in query(dsn, f"SELECT {cols} FROM {table} ORDER BY 1")}


def dead(dsn: str, table: str) -> list[tuple[Any, ...]]:
    return query(dsn, f"SELECT partition, \"offset\", stage, error FROM {table} "
                      f"ORDER BY partition, \"offset\"")


def drop_timestamp(df: Any) -> Any:
    """A transform that drops the record timestamp (upsert must still order by offset)."""
    return df.drop("timestamp")


def raw_pipeline(topic: str, dsn: str, bootstrap: str, table: str, mode: str,
                 **extra: Any) -> PipelineConfig:
    raw: dict[str, Any] = {
        "name": table, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic]}, "format": {"type": "raw"},
        "sink": {"connection": dsn, "table": table, "mode": mode,
                 **({"key": ["key"]} if mode == "upsert" else {})},
        "spark": {"master": "local[2]"}, "dead_letter_table": f"{table}_dead", **extra}
    return parse_pipeline(raw, f"<test {table}>", {})


@pytest.mark.parametrize("transform", [None, "drop_timestamp"])
def test_upsert_latest_offset_wins_over_an_older_timestamp(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        transform: str | None) -> None:
    topic = make_topic("ups", 1)
    now = int(time.time() * 1000)
    # offset 0 carries a CreateTime a minute later than offset 1: Kafka's order is the offset
    produce(kafka_bootstrap, topic, [("a", ev("a", 1.0), now + 60_000),
                                     ("a", ev("a", 2.0), now), ("b", ev("b", 3.0), now)])
    table = f"ups_{unique}"
    over: dict[str, Any] = {}
    if transform:
        over["transform"] = f"tests.integration.commit.test_commit_upsert.{transform}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"],
                       **over)
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    assert rows(pg_dsn, table) == {"a": 2.0, "b": 3.0}


def test_replay_never_moves_a_key_backwards(spark: Any, pg_dsn: str, kafka_bootstrap: str,
                                            make_topic: Any, unique: str) -> None:
    topic = make_topic("upr", 1)
    recs: list[tuple[Any, Any, int | None]] = []
    script = {2: "before", 5: "inside", 15: "inside", 12: "after", 25: "after", 14: "in_only",
              3: "gone", 8: "gone"}  # offset -> key updated there; others are filler
    for off in range(30):
        key = script.get(off, f"filler{off}")
        recs.append((key, ev(key, float(off)), None))
    produce(kafka_bootstrap, topic, recs)
    table = f"upr_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"],
                       max_records_per_partition=10)  # batches [0,10) [10,20) [20,30)
    run_until_caught_up(cfg, pg_dsn, spark)
    before = rows(pg_dsn, table, "event_id, amount, \"offset\"")
    assert before["after"] == (25.0, 25) and before["inside"] == (15.0, 15)
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        replay = ledger.insert_batch(cur, pipeline=cfg.name, kind="replay",
                                     ranges=[OffsetRange(topic, 0, 10, 20)], target_table=table,
                                     config_fingerprint=cfg.fingerprint(),
                                     split_offsets=cfg.spark.max_offsets_per_task,
                                     started_by="test", moves_positions=False)
    rep = run_batch(spark, cfg, replay, pg_dsn)
    assert rep.result.status == "committed"
    assert rows(pg_dsn, table, "event_id, amount, \"offset\"") == before


def test_upsert_rows_without_a_key_are_dead_letters(spark: Any, pg_dsn: str,
                                                    kafka_bootstrap: str, make_topic: Any,
                                                    unique: str) -> None:
    topic = make_topic("upn", 1)
    produce(kafka_bootstrap, topic, [(None, ev(None, 1.0), None), ("a", ev("a", 2.0), None),
                                     (None, ev(None, 3.0), None), (None, ev(None, 4.0), None)])
    table = f"upn_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"],
                       dead_letter_table=f"{table}_dead")
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    assert rows(pg_dsn, table) == {"a": 2.0}
    dl = dead(pg_dsn, f"{table}_dead")
    assert [(p, o, s) for p, o, s, _ in dl] == [(0, 0, "upsert_key"), (0, 2, "upsert_key"),
                                                (0, 3, "upsert_key")]
    assert "upsert key column(s) event_id NULL" in dl[0][3]
    assert res.report.result.bad_records == 3


def test_tombstones_delete_keys_in_upsert_mode(spark: Any, pg_dsn: str, kafka_bootstrap: str,
                                               make_topic: Any, unique: str) -> None:
    topic = make_topic("upt", 1)
    produce(kafka_bootstrap, topic, [("k1", b"v1", None), ("k2", b"v2", None),
                                     ("k1", None, None), ("k3", None, None),
                                     ("k2", b"v2b", None), (None, None, None)])
    table = f"upt_{unique}"
    cfg = raw_pipeline(topic, pg_dsn, kafka_bootstrap, table, "upsert")
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    assert {bytes(k): bytes(v) for k, v in query(
        pg_dsn, f"SELECT key, value FROM {table}")} == {b"k2": b"v2b"}
    # a tombstone without a key cannot delete anything: a dead letter, not a lost record
    assert [(o, s) for _, o, s, _ in dead(pg_dsn, f"{table}_dead")] == [(5, "upsert_key")]
    produce(kafka_bootstrap, topic, [("k2", None, None)])  # a later batch deletes k2
    run_cycle(cfg, pg_dsn, spark)
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 0
    # remembered under the canonical name: `t` and `public.t` are one table (review item 9)
    assert query(pg_dsn, "SELECT DISTINCT target_table FROM offsetflow.deleted_keys "
                         "WHERE target_table LIKE %s", (f"%{table}",)) == [(f"public.{table}",)]


def test_tombstones_as_dead_letters_in_upsert_mode(spark: Any, pg_dsn: str,
                                                   kafka_bootstrap: str, make_topic: Any,
                                                   unique: str) -> None:
    topic = make_topic("uptd", 1)
    produce(kafka_bootstrap, topic, [("k1", b"v1", None), ("k1", None, None)])
    table = f"uptd_{unique}"
    cfg = raw_pipeline(topic, pg_dsn, kafka_bootstrap, table, "upsert",
                       tombstones="dead_letter")
    run_cycle(cfg, pg_dsn, spark)
    assert {bytes(k): bytes(v) for k, v in query(
        pg_dsn, f"SELECT key, value FROM {table}")} == {b"k1": b"v1"}
    dl = dead(pg_dsn, f"{table}_dead")
    assert [(o, s) for _, o, s, _ in dl] == [(1, "tombstone")]
    assert "tombstone (null value)" in dl[0][3]


@pytest.mark.parametrize("policy", [None, "null_row", "dead_letter"])
def test_tombstones_in_append_mode(spark: Any, pg_dsn: str, kafka_bootstrap: str,
                                   make_topic: Any, unique: str, policy: str | None) -> None:
    topic = make_topic("apt", 2)
    produce(kafka_bootstrap, topic, [("k1", b"v1", None), ("k1", None, None)], partition=0)
    produce(kafka_bootstrap, topic, [("k2", None, None), ("k2", b"v2", None)], partition=1)
    table = f"apt_{unique}"
    cfg = raw_pipeline(topic, pg_dsn, kafka_bootstrap, table, "append",
                       **({"tombstones": policy} if policy else {}))
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    got = {(p, o): v for p, o, v in query(pg_dsn, f"SELECT partition, \"offset\", value "
                                                  f"FROM {table}")}
    dl = [(p, o, s) for p, o, s, _ in dead(pg_dsn, f"{table}_dead")]
    if policy in (None, "null_row"):  # null_row: the raw-format append default, as on main
        assert set(got) == {(0, 0), (0, 1), (1, 0), (1, 1)}
        assert got[(0, 1)] is None and got[(1, 0)] is None and dl == []
    else:
        assert set(got) == {(0, 0), (1, 1)}
        assert dl == [(0, 1, "tombstone"), (1, 0, "tombstone")]
        assert res.report.result.bad_records == 2
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic, 0): 2, (topic, 1): 2}


def test_replay_does_not_resurrect_a_key_deleted_after_the_window(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("upz", 1)
    produce(kafka_bootstrap, topic, [("k1", b"v1", None), ("k2", b"v2", None),  # window
                                     ("k1", None, None), ("k3", b"v3", None)])  # after it
    table = f"upz_{unique}"
    cfg = raw_pipeline(topic, pg_dsn, kafka_bootstrap, table, "upsert")
    run_until_caught_up(cfg, pg_dsn, spark)

    def state() -> dict[bytes, bytes]:
        return {bytes(k): bytes(v) for k, v in query(pg_dsn, f"SELECT key, value FROM {table}")}

    assert state() == {b"k2": b"v2", b"k3": b"v3"}
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        replay = ledger.insert_batch(cur, pipeline=cfg.name, kind="replay",
                                     ranges=[OffsetRange(topic, 0, 0, 2)], target_table=table,
                                     config_fingerprint=cfg.fingerprint(),
                                     split_offsets=cfg.spark.max_offsets_per_task,
                                     started_by="test", moves_positions=False)
    assert run_batch(spark, cfg, replay, pg_dsn).result.status == "committed"
    assert state() == {b"k2": b"v2", b"k3": b"v3"}  # k1 stays deleted
    produce(kafka_bootstrap, topic, [("k1", b"v1-again", None)])  # a later record re-creates it
    run_until_caught_up(cfg, pg_dsn, spark)
    assert state() == {b"k1": b"v1-again", b"k2": b"v2", b"k3": b"v3"}


def test_json_tombstone_deletes_its_key_in_upsert_mode(spark: Any, pg_dsn: str,
                                                       kafka_bootstrap: str, make_topic: Any,
                                                       unique: str) -> None:
    topic = make_topic("upj", 1)
    produce(kafka_bootstrap, topic, [(json.dumps({"event_id": "a"}), ev("a", 1.0), None),
                                     (json.dumps({"event_id": "b"}), ev("b", 2.0), None),
                                     (json.dumps({"event_id": "a"}), None, None)])
    table = f"upj_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"],
                       dead_letter_table=f"{table}_dead")
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    assert rows(pg_dsn, table) == {"b": 2.0}


def test_a_key_in_two_partitions_is_ordered_by_timestamp_and_replay_keeps_the_newest(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("upx", 2)
    now = int(time.time() * 1000)
    produce(kafka_bootstrap, topic, [("a", ev("a", 1.0), now + 60_000)], partition=0)
    produce(kafka_bootstrap, topic, [("a", ev("a", 2.0), now)], partition=1)
    table = f"upx_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"])
    run_until_caught_up(cfg, pg_dsn, spark)
    assert rows(pg_dsn, table) == {"a": 1.0}  # across partitions: the later timestamp
    produce(kafka_bootstrap, topic, [("a", ev("a", 3.0), now + 120_000)], partition=1)
    run_until_caught_up(cfg, pg_dsn, spark)
    assert rows(pg_dsn, table) == {"a": 3.0}
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        replay = ledger.insert_batch(cur, pipeline=cfg.name, kind="replay",
                                     ranges=[OffsetRange(topic, 0, 0, 1)], target_table=table,
                                     config_fingerprint=cfg.fingerprint(),
                                     split_offsets=cfg.spark.max_offsets_per_task,
                                     started_by="test", moves_positions=False)
    assert run_batch(spark, cfg, replay, pg_dsn).result.status == "committed"
    assert rows(pg_dsn, table) == {"a": 3.0}  # the replayed older record does not win


def test_upsert_after_the_topic_was_deleted_and_recreated(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Offsets start again at 0 in a recreated topic: its records are newer than every row
    of the old incarnation, whatever their offsets (review item 1)."""
    topic = make_topic("upi", 1)
    produce(kafka_bootstrap, topic, [("gone", b"old", None)]
            + [("k", f"v1@{i}".encode(), None) for i in range(1, 21)])
    table = f"upi_{unique}"
    cfg = raw_pipeline(topic, pg_dsn, kafka_bootstrap, table, "upsert")
    run_until_caught_up(cfg, pg_dsn, spark)

    def state() -> dict[bytes, bytes]:
        return {bytes(k): bytes(v) for k, v in query(pg_dsn, f"SELECT key, value FROM {table}")}

    assert state() == {b"gone": b"old", b"k": b"v1@20"}
    new_id = recreate(kafka_bootstrap, topic, 1)
    with Ledger(pg_dsn) as ledger:  # reset-position, as the operator does after recreation
        reset_positions(ledger, cfg.name, topic, [0], 0, "topic recreated", topic_id=new_id)
    produce(kafka_bootstrap, topic, [("k", b"v2", None), ("gone", None, None)])
    run_until_caught_up(cfg, pg_dsn, spark)
    assert state() == {b"k": b"v2"}
    produce(kafka_bootstrap, topic, [("gone", b"back", None)])  # offset 2 > the tombstone's
    run_until_caught_up(cfg, pg_dsn, spark)
    assert state() == {b"k": b"v2", b"gone": b"back"}


def test_a_timestamp_tie_across_partitions_is_decided_the_same_in_and_across_batches(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """One strict order (timestamp, topic, partition) for a key in two partitions: within a
    batch the higher partition wins a tie, so across batches it must too (review item 2)."""
    topic = make_topic("upq", 2)
    ts = int(time.time() * 1000)
    table = f"upq_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"])
    # in one batch: partition 1 wins the tie
    produce(kafka_bootstrap, topic, [("a", ev("a", 1.0), ts)], partition=1)
    produce(kafka_bootstrap, topic, [("a", ev("a", 0.0), ts)], partition=0)
    run_until_caught_up(cfg, pg_dsn, spark)
    assert rows(pg_dsn, table) == {"a": 1.0}
    # the same tie split over two batches: a later commit of partition 0 does not win it
    produce(kafka_bootstrap, topic, [("b", ev("b", 1.0), ts)], partition=1)
    run_until_caught_up(cfg, pg_dsn, spark)
    produce(kafka_bootstrap, topic, [("b", ev("b", 0.0), ts)], partition=0)
    run_until_caught_up(cfg, pg_dsn, spark)
    assert rows(pg_dsn, table) == {"a": 1.0, "b": 1.0}
