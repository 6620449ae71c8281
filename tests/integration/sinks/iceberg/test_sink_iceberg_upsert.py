"""`mode: upsert` into an Iceberg table (issue 17) on the real services: the PostgreSQL
upsert's rule (offset wins within a partition, one order across partitions, tombstones
delete and are remembered), one snapshot per batch, the sink's find/conflict protocol."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from psycopg2 import sql

from offsetflow.config import PipelineConfig, load_pipeline
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only, run_until_caught_up
from offsetflow.ranges import OffsetRange
from offsetflow.sinks.iceberg.upsert import memory_name
from tests.tooling.iceberg_case import IcebergCase, died_between_the_commits
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.pipeline_data import SCHEMA, ev, produce, query

COLUMNS = ("event_id", "amount", "topic", "partition", "offset")


def _raw(topic: str, dsn: str, bootstrap: str, name: str, **sink: Any) -> dict[str, Any]:
    return {"name": name, "kafka": {"bootstrap_servers": bootstrap},
            "source": {"topics": [topic], "starting": "earliest",
                       "max_records_per_partition": 4},
            "format": {"type": "json", "schema": dict(SCHEMA)},
            "sink": {"connection": dsn, "table": name, "mode": "upsert",
                     "key": ["event_id"], **sink},
            "spark": {"master": "local[2]"}, "dead_letter_table": f"{name}_dead"}


def _iceberg_cfg(tmp: Path, topic: str, dsn: str, bootstrap: str, table: str,
                 **sink: Any) -> PipelineConfig:
    warehouse = tmp / f"wh_{table}"
    warehouse.mkdir(exist_ok=True)
    raw = _raw(topic, dsn, bootstrap, table, type="iceberg", table=f"lake.{table}",
               catalog={"warehouse": f"file://{warehouse}"}, **sink)
    path = tmp / f"{table}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_pipeline(path)


def _pg_cfg(tmp: Path, topic: str, dsn: str, bootstrap: str, table: str) -> PipelineConfig:
    path = tmp / f"{table}.yaml"
    path.write_text(yaml.safe_dump(_raw(topic, dsn, bootstrap, table)))
    return load_pipeline(path)


def ice_rows(cfg: PipelineConfig, dsn: str) -> list[tuple[Any, ...]]:
    data = iceberg_table(cfg, dsn).scan(selected_fields=COLUMNS).to_arrow()
    return sorted(tuple(r[c] for c in COLUMNS) for r in data.to_pylist())


def pg_rows(dsn: str, table: str) -> list[tuple[Any, ...]]:
    cols = ", ".join(f'"{c}"' for c in COLUMNS)
    return sorted(query(dsn, f"SELECT {cols} FROM {table}"))


def _key(event_id: str) -> str:
    return json.dumps({"event_id": event_id})


def _changelog(bootstrap: str, topic: str, seed: int, n: int = 60) -> None:
    """Updates and deletes of a few keys over three partitions: a key in several
    partitions, timestamps out of order, repeated within and across batches."""
    rng = random.Random(seed)
    now = int(time.time() * 1000)
    for p in range(3):
        recs: list[tuple[Any, Any, int | None]] = []
        for i in range(n // 3):
            k = f"k{rng.randint(0, 7)}"
            if rng.random() < 0.2:
                recs.append((_key(k), None, now + rng.randint(-60_000, 60_000)))
            else:
                recs.append((_key(k), ev(k, float(p * 1000 + i)),
                             now + rng.randint(-60_000, 60_000)))
        produce(bootstrap, topic, recs, partition=p)


@pytest.mark.slow
def test_upsert_into_iceberg_gives_the_rows_of_a_postgresql_upsert(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    topic = make_topic("iup", 3)
    _changelog(kafka_bootstrap, topic, seed=1)
    pg = _pg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iup_pg_{unique}")
    ice = _iceberg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iup_ice_{unique}")
    for cfg in (pg, ice):  # several batches of 4 records per partition
        results = run_until_caught_up(cfg, pg_dsn, spark)
        assert len([r for r in results if r.report is not None]) >= 4
    _changelog(kafka_bootstrap, topic, seed=2)  # the same keys again, later
    for cfg in (pg, ice):
        run_until_caught_up(cfg, pg_dsn, spark)
    want = pg_rows(pg_dsn, pg.sink.table)
    assert 0 < len(want) < 8  # tombstones deleted some keys
    assert ice_rows(ice, pg_dsn) == want
    assert len({r[0] for r in want}) == len(want)  # one row per key
    # every batch one snapshot; its deletions remembered as PostgreSQL's are
    with Ledger(pg_dsn) as ledger:
        done = [b.batch_id for b in ledger.recent_batches(ice.name, 1000)
                if b.status == "committed"]
    assert snapshot_batches(ice, pg_dsn) == sorted(done)
    assert ice.sink.iceberg is not None
    memory = memory_name(ice.sink.iceberg, ice.sink.iceberg.identifier)
    assert _memory(pg_dsn, memory) == _memory(pg_dsn, f"public.{pg.sink.table}")
    # rewritten and new files alike carry the batch's prefix (the orphan sweep's)
    files = list(tmp_path.glob(f"wh_{ice.name}/**/*.parquet"))
    assert files and all(f.name.startswith("ofb-") for f in files)


def _memory(dsn: str, target: str) -> list[tuple[Any, ...]]:
    return sorted(query(dsn, "SELECT key::text, topic, partition, \"offset\" FROM "
                             "offsetflow.deleted_keys WHERE target_table = %s", (target,)))


def _plan_replay(cfg: PipelineConfig, dsn: str, topic: str, partition: int, lo: int,
                 hi: int) -> int:
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        return ledger.insert_batch(cur, pipeline=cfg.name, kind="replay",
                                   ranges=[OffsetRange(topic, partition, lo, hi)],
                                   target_table=cfg.sink.table,
                                   config_fingerprint=cfg.fingerprint(),
                                   split_offsets=cfg.spark.max_offsets_per_task,
                                   started_by="test", moves_positions=False)


def _replay(cfg: PipelineConfig, dsn: str, spark: Any, topic: str, partition: int,
            lo: int, hi: int) -> int:
    bid = _plan_replay(cfg, dsn, topic, partition, lo, hi)
    assert run_batch(spark, cfg, bid, dsn).result.status == "committed"
    return bid


def _killed_after_iceberg_commit(spark: Any, cfg: PipelineConfig, dsn: str) -> int:
    """The next batch, its driver dead after the Iceberg commit, before the ledger's: in
    this process, its ledger transaction rolled back as a killed driver's is (the kill -9
    itself: test_sink_iceberg.py::test_killed_between_iceberg_commit_and_ledger_...)."""
    planned = plan_only(cfg, dsn).batch
    assert planned is not None
    bid = planned.batch_id
    died_between_the_commits(spark, cfg, bid, dsn, "iceberg")
    assert snapshot_batches(cfg, dsn)[-1] == bid  # Iceberg committed, the ledger did not
    return bid


def test_replay_of_an_older_window_neither_moves_a_key_back_nor_revives_a_deleted_one(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    topic = make_topic("iur", 1)
    produce(kafka_bootstrap, topic, [
        (_key("a"), ev("a", 1.0), None), (_key("b"), ev("b", 2.0), None),  # [0, 2)
        (_key("c"), ev("c", 3.0), None), (_key("d"), ev("d", 4.0), None),
        (_key("a"), ev("a", 5.0), None), (_key("b"), None, None),  # a updated, b deleted
        (_key("e"), ev("e", 7.0), None), (_key("c"), ev("c", 8.0), None)])
    ice = _iceberg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iur_{unique}")
    run_until_caught_up(ice, pg_dsn, spark)
    before = ice_rows(ice, pg_dsn)
    assert [(r[0], r[1]) for r in before] == [("a", 5.0), ("c", 8.0), ("d", 4.0),
                                              ("e", 7.0)]
    _replay(ice, pg_dsn, spark, topic, 0, 0, 4)  # a@0, b@1, c@2, d@3: all older
    assert ice_rows(ice, pg_dsn) == before  # a not back to 1.0, b not revived, c kept
    rid = _replay(ice, pg_dsn, spark, topic, 0, 2, 4)  # d@3 is d's row: replaced by itself
    assert ice_rows(ice, pg_dsn) == before
    lineage = iceberg_table(ice, pg_dsn).scan(selected_fields=("event_id",
                                                               "_offsetflow_batch_id"))
    assert {r["event_id"]: r["_offsetflow_batch_id"]
            for r in lineage.to_arrow().to_pylist()}["d"] == rid
    produce(kafka_bootstrap, topic, [(_key("b"), ev("b", 9.0), None)])  # b again, later
    run_until_caught_up(ice, pg_dsn, spark)
    assert ("b", 9.0) in [(r[0], r[1]) for r in ice_rows(ice, pg_dsn)]


@pytest.mark.slow
def test_killed_between_iceberg_and_ledger_commit_retry_finds_it_and_keeps_the_memory(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    topic = make_topic("iuk", 1)
    produce(kafka_bootstrap, topic, [(_key("a"), ev("a", 1.0), None),
                                     (_key("b"), ev("b", 2.0), None)])
    ice = _iceberg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iuk_{unique}")
    run_until_caught_up(ice, pg_dsn, spark)
    produce(kafka_bootstrap, topic, [(_key("a"), None, None), (_key("c"), ev("c", 3.0), None),
                                     (_key("b"), ev("b", 4.0), None)])
    bid = _killed_after_iceberg_commit(spark, ice, pg_dsn)
    assert ice.sink.iceberg is not None
    memory = memory_name(ice.sink.iceberg, ice.sink.iceberg.identifier)
    assert _memory(pg_dsn, memory) == []  # rolled back with the ledger
    rows = ice_rows(ice, pg_dsn)
    rep = run_batch(spark, ice, bid, pg_dsn)
    assert rep.result.status == "committed"
    assert snapshot_batches(ice, pg_dsn).count(bid) == 1  # found: nothing committed again
    assert ice_rows(ice, pg_dsn) == rows
    assert [(r[0], r[1]) for r in rows] == [("b", 4.0), ("c", 3.0)]
    assert _memory(pg_dsn, memory) == [('["a"]', topic, 0, 2)]  # as one clean run leaves it
    _replay(ice, pg_dsn, spark, topic, 0, 0, 2)  # so a replay cannot bring a back
    assert ice_rows(ice, pg_dsn) == rows


@pytest.mark.slow
def test_two_runs_of_one_upsert_batch_at_once_commit_it_once(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, spark_connect_url: str) -> None:
    """A job process (a Spark Connect client) runs the batch; once it has taken it, a
    second run starts in this process's Spark session (no JVM of its own for either): one
    of them commits it, once."""
    topic = make_topic("iut", 2)
    case = IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)
    case.raw["sink"].update(mode="upsert", key=["event_id"])
    case.write_config()
    bid = case.planned_batch(800, seed=61)
    case.two_runs_at_once(spark, bid, spark_connect_url)
    case.assert_exactly_once()  # keys unique: 0 lost, 0 duplicated


@pytest.mark.slow
def test_a_write_landing_between_the_decision_and_the_commit_is_decided_again(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit asserts the snapshot the decision read: another writer's commit in
    between makes it conflict, and the batch is decided again against the new table (not
    written with the old decision, which would leave two rows of a key)."""
    import pyarrow as pa
    from pyiceberg.expressions import EqualTo

    from offsetflow.sinks.iceberg import upsert as sink_iceberg_upsert

    topic = make_topic("iuc", 1)
    produce(kafka_bootstrap, topic, [(_key("a"), ev("a", 1.0), None),
                                     (_key("b"), ev("b", 2.0), None)])
    ice = _iceberg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iuc_{unique}")
    run_until_caught_up(ice, pg_dsn, spark)
    produce(kafka_bootstrap, topic, [(_key("a"), ev("a", 3.0), None)])  # a@2
    decide = sink_iceberg_upsert._Plan.stage_into
    calls: list[int] = []

    def racing(plan: Any, table: Any) -> Any:
        txn = decide(plan, table)
        if not calls:  # another writer: key a at a later offset of the same partition
            other = iceberg_table(ice, pg_dsn)
            row = other.scan(row_filter=EqualTo("event_id", "a")).to_arrow()
            for col, value in (("offset", 10**9), ("amount", 99.0)):
                i = row.schema.get_field_index(col)
                row = row.set_column(i, row.schema.field(i),
                                     pa.array([value], row.schema.field(i).type))
            other.overwrite(row, overwrite_filter=EqualTo("event_id", "a"))  # a replaced
        calls.append(1)
        return txn

    monkeypatch.setattr(sink_iceberg_upsert._Plan, "stage_into", racing)
    results = [r for r in run_until_caught_up(ice, pg_dsn, spark) if r.report is not None]
    assert len(calls) == 2  # conflicted once, decided again
    assert [(r[0], r[1], r[4]) for r in ice_rows(ice, pg_dsn)] == [("a", 99.0, 10**9),
                                                                  ("b", 2.0, 1)]
    assert results[0].report is not None and results[0].report.result.rows_written == 0


def _rec(event_id: str, seq: int, amount: float) -> dict[str, Any]:
    return {"event_id": event_id, "seq": seq, "amount": amount, "checksum": "x"}


def test_a_composite_key_row_matching_two_key_chunks_is_read_once(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Key (event_id, seq), chunks of 3 keys: the first chunk's values (t1, t2) x (1, 2)
    select every row, (t2, 2) included, whose key is the second chunk's; it must enter the
    table's rows once (a second insert was a unique violation on every attempt)."""
    from offsetflow.sinks.iceberg import upsert as sink_iceberg_upsert

    monkeypatch.setattr(sink_iceberg_upsert, "KEY_CHUNK", 3)
    topic = make_topic("iu2", 1)
    keys = [("t1", 1), ("t1", 2), ("t2", 1), ("t2", 2)]
    produce(kafka_bootstrap, topic, [(None, _rec(t, s, 1.0), None) for t, s in keys])
    ice = _iceberg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iu2_{unique}",
                       key=["event_id", "seq"])
    run_until_caught_up(ice, pg_dsn, spark)
    produce(kafka_bootstrap, topic, [(None, _rec(t, s, 2.0), None) for t, s in keys])
    run_until_caught_up(ice, pg_dsn, spark)
    with Ledger(pg_dsn) as ledger:
        assert [b.status for b in ledger.recent_batches(ice.name, 10)] == ["committed"] * 2
    data = iceberg_table(ice, pg_dsn).scan(selected_fields=("event_id", "seq", "amount"))
    assert sorted((r["event_id"], r["seq"], r["amount"])
                  for r in data.to_arrow().to_pylist()) == [(t, s, 2.0) for t, s in keys]


def test_float_keys_minus_zero_and_zero_are_one_key_as_in_postgresql(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    """PostgreSQL's -0.0 = 0.0 (one key there): the Iceberg upsert keeps one row too."""
    topic = make_topic("iuz", 1)
    ice = _iceberg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iuz_{unique}",
                       key=["amount"])
    for event_id, amount in (("a", -0.0), ("b", 0.0)):
        produce(kafka_bootstrap, topic, [(None, ev(event_id, amount), None)])
        run_until_caught_up(ice, pg_dsn, spark)  # one batch each: key read from the table
    data = iceberg_table(ice, pg_dsn).scan(selected_fields=("event_id", "amount"))
    assert sorted(r["event_id"] for r in data.to_arrow().to_pylist()) == ["b"]


@pytest.mark.slow
def test_a_replay_never_revives_a_key_deleted_by_a_batch_iceberg_holds_but_the_ledger_not(
        tmp_path: Path, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    """Batch 2 deletes a, its Iceberg commit lands, its driver dies before the ledger
    commit (the deletion not remembered yet): a replay of a's older window is refused,
    naming batch 2, until batch 2 is completed; then it leaves a deleted."""
    from offsetflow.errors import BatchStateError

    topic = make_topic("iuh", 1)
    produce(kafka_bootstrap, topic, [(_key("a"), ev("a", 1.0), None),
                                     (_key("b"), ev("b", 2.0), None)])
    ice = _iceberg_cfg(tmp_path, topic, pg_dsn, kafka_bootstrap, f"iuh_{unique}")
    run_until_caught_up(ice, pg_dsn, spark)
    produce(kafka_bootstrap, topic, [(_key("a"), None, None), (_key("c"), ev("c", 3.0), None)])
    bid = _killed_after_iceberg_commit(spark, ice, pg_dsn)
    rid = _plan_replay(ice, pg_dsn, topic, 0, 0, 2)
    with pytest.raises(BatchStateError, match=rf"batch {bid}\b.*(run|complete)"):
        run_batch(spark, ice, rid, pg_dsn)
    assert [(r[0], r[1]) for r in ice_rows(ice, pg_dsn)] == [("b", 2.0), ("c", 3.0)]
    assert run_batch(spark, ice, bid, pg_dsn).result.status == "committed"
    assert run_batch(spark, ice, rid, pg_dsn).result.status == "committed"
    assert [(r[0], r[1]) for r in ice_rows(ice, pg_dsn)] == [("b", 2.0), ("c", 3.0)]


def test_key_chunks_come_in_key_order_whatever_the_winners_order(
        pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's min/max prunes files only if the chunks are key ranges: the winners read
    in key order, not in their table's order (here the reverse)."""
    from types import SimpleNamespace

    import psycopg2

    from offsetflow.commit import WINNERS
    from offsetflow.sinks.iceberg import upsert as sink_iceberg_upsert

    monkeypatch.setattr(sink_iceberg_upsert, "KEY_CHUNK", 3)
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT "
                                "lpad(g::text, 2, '0') AS k FROM generate_series(9, 1, -1) g")
                        .format(WINNERS))
            plan = SimpleNamespace(cur=cur, key=["k"])
            chunks = [c.column("k").to_pylist()
                      for c in sink_iceberg_upsert._Plan._key_chunks(plan)]  # type: ignore[arg-type]
    finally:
        conn.close()
    assert chunks == [["01", "02", "03"], ["04", "05", "06"], ["07", "08", "09"]]
