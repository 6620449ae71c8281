"""The Kafka topic sink (sink.type: kafka) on the real broker, PostgreSQL and Spark: one
producer transaction per batch with the source positions in it; replays only to a side
topic. The crash and fencing cases are in test_sink_kafka_faults.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KTopicPartition

from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError, RequestError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger, ledger_identity
from offsetflow.ops import kafka_for, plan_only, plan_window, submit_window
from offsetflow.plan import parse_request
from tests.tooling.chaos import SCHEMA, Workload, dead_letters, payload
from tests.tooling.checker import ProducedRecord
from tests.tooling.kafka_case import kafka_sink_pipeline
from tests.tooling.kafka_topics import recreate
from tests.tooling.topic_checker import check_topic, read_topic


def produce_with_headers(bootstrap: str, topic: str, n: int, prefix: str
                         ) -> list[ProducedRecord]:
    """Records with a key and two headers (one with a null value)."""
    out: list[ProducedRecord] = []

    def cb(err: Any, msg: Any) -> None:
        assert err is None, err
        body = json.loads(msg.value())
        out.append(ProducedRecord(body["event_id"], body["checksum"], msg.topic(),
                                  msg.partition(), msg.offset()))

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for i in range(n):
        body = payload(f"{prefix}-h{i}", 10_000 + i)
        p.produce(topic, json.dumps(body).encode(), key=body["event_id"].encode(),
                  partition=i % 2, headers=[("trace", f"t{i}".encode()), ("empty", None)],
                  on_delivery=cb)
    assert p.flush(30) == 0
    return out


def group_offsets(bootstrap: str, group: str, tps: list[tuple[str, int]]
                  ) -> dict[tuple[str, int], tuple[int, str]]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                  "isolation.level": "read_committed"})
    try:
        got = c.committed([KTopicPartition(t, p) for t, p in tps], timeout=30)
        return {(x.topic, x.partition): (x.offset, x.metadata) for x in got}
    finally:
        c.close()


def test_kafka_sink_commits_each_batch_once_with_its_offsets_and_replays_only_to_a_side_topic(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    src = make_topic("ks-src", 2)
    out = make_topic("ks-out", 3)
    side = make_topic("ks-side", 3)
    w = Workload(kafka_bootstrap, src, 2, f"ks{unique}")
    w.plain(150)
    w.transaction(40, commit=False)  # aborted source records: never in the output
    w.transaction(30, commit=True)
    extra = produce_with_headers(kafka_bootstrap, src, 6, f"ks{unique}")
    name = f"ks_{unique}"
    cfg = kafka_sink_pipeline(name, src, pg_dsn, kafka_bootstrap, topic=out,
                              key_column="event_id", split=60)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    rep = run_batch(spark, cfg, bid, pg_dsn)
    assert rep.result.status == "committed"
    assert rep.result.rows_written == 186
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(name)
        assert ledger.get_batch(bid).status == "committed"
    produced = [*w.produced.values(), *extra]
    verdict = check_topic(kafka_bootstrap, out, produced, positions)
    assert verdict.committed.ok, verdict.committed.explain()
    assert verdict.committed.found == verdict.committed.expected == 186
    assert verdict.in_log == 186 and verdict.batches == {bid}

    records = read_topic(kafka_bootstrap, out)
    by_id = {json.loads(r.value or b"{}")["event_id"]: r for r in records}
    one = by_id[f"ks{unique}-h3"]
    assert one.key == f"ks{unique}-h3".encode()  # key_column: event_id
    assert one.headers["trace"] == b"t3" and one.headers["empty"] is None  # carried over
    assert one.headers["offsetflow.batch"] == str(bid).encode()
    assert set(json.loads(one.value or b"")) == set(SCHEMA)  # the payload columns only
    # the batch's positions went into the same transaction, to the sink's own group, with
    # the batch id; the lag publisher's group is another one
    tps = sorted(positions)
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        lid = ledger_identity(cur).installation_id
        cur.execute("SELECT topic, partition, records FROM offsetflow.batch_ranges "
                    "WHERE batch_id = %s", (bid,))
        counts = {(t, int(p)): int(n) for t, p, n in cur.fetchall()}
    assert group_offsets(kafka_bootstrap, f"offsetflow-sink-{name}.{lid}", tps) == {
        tp: (positions[tp], f"offsetflow pipeline={name} batch={bid} ledger={lid} topic={out}"
                            f",records={counts[tp]}")  # what `offsetflow complete` reads
        for tp in tps}

    # the same batch again: committed in the ledger, nothing produced
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "already_committed"
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) == 186

    # a replay into the live topic is refused when it is requested ...
    req = parse_request("replay", {"pipeline": name, "topic": src,
                                   "from_offset": 0, "until_offset": 40})
    with Ledger(pg_dsn) as ledger, pytest.raises(RequestError, match="sink.replay_topic"):
        submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req), "test")
    with_side = kafka_sink_pipeline(name, src, pg_dsn, kafka_bootstrap, topic=out,
                                    replay_topic=side, key_column="event_id", split=60)
    with Ledger(pg_dsn) as ledger:
        ids = submit_window(with_side, ledger,
                            plan_window(with_side, ledger, kafka_for(with_side), req), "test")
        # assets and lineage name the topic the replay writes, not the live one
        assert ledger.get_batch(ids[0]).target_table == f"kafka:{side}"
    # ... and, run with a config that lost its side topic, before anything is read
    with pytest.raises(ConfigError, match=r"sink\.replay_topic.*duplicate"):
        run_batch(spark, cfg, ids[0], pg_dsn)
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) == 186
    # with the side topic, the replay writes there, once, even when run twice
    assert run_batch(spark, with_side, ids[0], pg_dsn).result.status == "committed"
    assert run_batch(spark, with_side, ids[0], pg_dsn).result.status == "already_committed"
    replayed = read_topic(kafka_bootstrap, side)
    assert sorted(r.source for r in replayed) == sorted(
        p.coordinates for p in produced
        if p.committed and p.offset < 40 and p.coordinates[1] in (0, 1))
    assert {r.batch_id for r in replayed} == {ids[0]}
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) == 186
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(name) == positions  # a replay never moves the live position


def test_kafka_sink_raw_value_partitioned_by_source_keeps_tombstones(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    src = make_topic("kr-src", 2)
    out = make_topic("kr-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kr{unique}")
    w.plain(50)
    w.tombstones(4)
    name = f"kr_{unique}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [src]}, "format": {"type": "raw"},
           "sink": {"type": "kafka", "connection": pg_dsn, "topic": out,
                    "value_format": "raw", "partitioning": "source", "headers": "none"}}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    assert run_batch(spark, cfg, planned.batch.batch_id, pg_dsn).result.rows_written == 54
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(name)
    verdict = check_topic(kafka_bootstrap, out, w.produced.values(), positions)
    assert verdict.committed.ok, verdict.committed.explain()
    records = read_topic(kafka_bootstrap, out)
    assert all(r.partition == r.source[1] for r in records)  # partitioning: source
    tombstones = [r for r in records if r.value is None]
    assert len(tombstones) == 4 and all(r.key for r in tombstones)


def test_kafka_sink_bad_records_go_to_the_dead_letter_table_in_the_same_commit(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    src = make_topic("kd-src", 2)
    out = make_topic("kd-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kd{unique}")
    w.plain(30)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    bad: list[tuple[int, int]] = []
    for i in range(3):
        p.produce(src, b"{not json", partition=i % 2,
                  on_delivery=lambda err, m: bad.append((m.partition(), m.offset())))
    assert p.flush(30) == 0
    w.plain(10)
    name = f"kd_{unique}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [src]}, "format": {"type": "json", "schema": dict(SCHEMA)},
           "sink": {"type": "kafka", "connection": pg_dsn, "topic": out},
           "bad_records": "dead_letter", "dead_letter_table": f"kd_dead_{unique}"}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    res = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn).result
    assert (res.rows_written, res.bad_records) == (40, 3)
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(name)
    verdict = check_topic(kafka_bootstrap, out, w.produced.values(), positions)
    assert verdict.committed.ok, verdict.committed.explain()
    assert verdict.in_log == 40
    got = sorted((d.partition, d.offset) for d in dead_letters(pg_dsn, f"kd_dead_{unique}", name))
    assert got == sorted(bad)


def test_kafka_sink_after_a_transform(spark: Any, pg_dsn: str, kafka_bootstrap: str,
                                      make_topic: Any, unique: str) -> None:
    """The DataFrame path (a transform's output staged by Spark partitions) into a topic;
    the transform's columns are checked when the run starts."""
    src = make_topic("kt-src", 2)
    out = make_topic("kt-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kt{unique}")
    w.plain(80)
    name = f"kt_{unique}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [src]}, "format": {"type": "json", "schema": dict(SCHEMA)},
           "transform": "tests.tooling.chaos.maybe_fail_task",  # rows unchanged
           "sink": {"type": "kafka", "connection": pg_dsn, "topic": out,
                    "key_column": "no_such_column"}}
    broken = parse_pipeline(raw, f"<test {name}>", {})
    planned = plan_only(broken, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    with pytest.raises(ConfigError, match="no_such_column") as e:
        run_batch(spark, broken, bid, pg_dsn)
    assert e.value.field == "sink.key_column"
    raw["sink"]["key_column"] = "event_id"
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    assert run_batch(spark, cfg, bid, pg_dsn, accept_config_change=True).result.rows_written == 80
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(name)
    verdict = check_topic(kafka_bootstrap, out, w.produced.values(), positions)
    assert verdict.committed.ok, verdict.committed.explain()
    assert all(r.key == json.loads(r.value or b"")["event_id"].encode()
               for r in read_topic(kafka_bootstrap, out))


def key_from_seq(df: Any) -> Any:
    """Re-keys every record by a bigint column (the issue's re-keying use)."""
    from pyspark.sql import functions as F

    return df.withColumn("key", F.col("seq"))


def key_from_event_id(df: Any) -> Any:
    """Re-keys every record by a string column."""
    from pyspark.sql import functions as F

    return df.withColumn("key", F.col("event_id"))


@pytest.mark.parametrize("transform, expected", [
    ("key_from_seq", lambda body: str(body["seq"]).encode()),
    ("key_from_event_id", lambda body: body["event_id"].encode()),
])
def test_kafka_sink_key_set_by_a_transform_is_encoded_as_text(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        transform: str, expected: Any) -> None:
    """A transform's `key` column that is not bytea: a number becomes its decimal text, a
    string its UTF-8 bytes (never `bytes(int)`, a run of NUL bytes as long as the number)."""
    src = make_topic("kk-src", 2)
    out = make_topic("kk-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kk{unique}")
    w.plain(40)
    name = f"kk_{unique}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [src]}, "format": {"type": "json", "schema": dict(SCHEMA)},
           "transform": f"tests.integration.sinks.kafka.test_sink_kafka.{transform}",
           "sink": {"type": "kafka", "connection": pg_dsn, "topic": out}}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    assert run_batch(spark, cfg, planned.batch.batch_id, pg_dsn).result.rows_written == 40
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(name)
    verdict = check_topic(kafka_bootstrap, out, w.produced.values(), positions)
    assert verdict.committed.ok, verdict.committed.explain()
    records = read_topic(kafka_bootstrap, out)
    assert len(records) == 40
    for r in records:
        assert r.key == expected(json.loads(r.value or b"")), (r.key, r.value)


def test_reset_position_backwards_into_the_live_topic_is_refused(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, capsys: Any) -> None:
    """Moving a position back re-reads records the live topic already holds: written there
    again they would be duplicates (Kafka cannot delete records). Refused unless forced, or
    unless the source topic was recreated (its offsets are then a new incarnation's)."""
    from offsetflow.cli import main as cli

    src = make_topic("kp-src", 2)
    out = make_topic("kp-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kp{unique}")
    w.plain(60)
    name = f"kp_{unique}"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [src]}, "format": {"type": "json", "schema": dict(SCHEMA)},
           "sink": {"type": "kafka", "connection": pg_dsn, "topic": out}}
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(raw))
    cfg = parse_pipeline(raw, str(f), {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    assert run_batch(spark, cfg, planned.batch.batch_id, pg_dsn).result.rows_written == 60
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(name)
    reset = ["--dsn", pg_dsn, "reset-position", "--pipeline-file", str(f), "--topic", src,
             "--reason", "test"]

    assert cli([*reset, "--all-partitions", "--offset", "0"]) == 2
    err = capsys.readouterr().err
    assert out in err and "sink.replay_topic" in err and "--allow-duplicates" in err
    assert f"{src}[0]" in err
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(name) == positions  # nothing changed
    assert plan_only(cfg, pg_dsn).batch is None  # nothing to write again
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) == 60

    # forward (or to where it is) is no rewind
    assert cli([*reset, "--partition", "0", "--offset", str(positions[(src, 0)])]) == 0
    # forced: the operator wants the duplicates
    assert cli([*reset, "--partition", "1", "--offset", "0", "--allow-duplicates"]) == 0
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(name)[(src, 1)] == 0
    # a recreated source topic: its offsets are new records, not the ones the topic holds
    recreate(kafka_bootstrap, src, 2)
    capsys.readouterr()
    assert cli([*reset, "--all-partitions", "--offset", "0"]) == 0, capsys.readouterr().err


def test_each_source_partitions_records_are_produced_in_offset_order_across_parts(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The commit streams the stage through an index in source order (not one sort of the
    whole batch): a partition read by several tasks (parts) still comes out in offset
    order."""
    src = make_topic("ko-src", 2)
    out = make_topic("ko-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"ko{unique}")
    w.plain(120)
    name = f"ko_{unique}"
    cfg = kafka_sink_pipeline(name, src, pg_dsn, kafka_bootstrap, topic=out,
                              partitioning="source", headers="none", split=15)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    rep = run_batch(spark, cfg, bid, pg_dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == 120
    # the commit's split is in the batch's timings (make bench reports it)
    assert {"kafka_produce_s", "kafka_commit_s"} <= set(rep.timings)
    records = read_topic(kafka_bootstrap, out)
    assert len(records) == 120
    for part in (0, 1):
        sources = [r.source for r in sorted(records, key=lambda r: r.offset)
                   if r.partition == part]
        assert [s[2] for s in sources] == sorted(s[2] for s in sources), part
        assert {s[1] for s in sources} == {part}
