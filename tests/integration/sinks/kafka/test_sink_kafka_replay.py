"""Replays and backfills into a Kafka sink's `replay_topic`, on the real broker, PostgreSQL and
Spark: Kafka cannot delete what a topic holds, so a window already replayed into the side
topic is refused when it is asked for again there (`--allow-duplicates`, or another
`replay_topic`, is the way out), and a replay's dead letters replace the ones earlier
replays of the window into the same topic left. A replay batch killed after its Kafka commit
and run again produces nothing twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.errors import ConfigError, RequestError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import kafka_for, plan_only, plan_window, run_batches, submit_window
from offsetflow.plan import parse_request
from tests.tooling import chaos
from tests.tooling.chaos import SCHEMA, Workload, dead_letters
from tests.tooling.kafka_case import killed_at_end
from tests.tooling.topic_checker import read_topic

WINDOW = 30  # offsets 0..30 of each partition are replayed


def bad_records(bootstrap: str, topic: str, n: int) -> list[tuple[int, int]]:
    """`n` records that are not JSON (dead letters), one per partition in turn."""
    out: list[tuple[int, int]] = []
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(n):
        p.produce(topic, b"{not json", partition=i % 2,
                  on_delivery=lambda err, m: out.append((m.partition(), m.offset())))
    assert p.flush(30) == 0
    return out


def config(name: str, src: str, out: str, side: str | None, dsn: str, bootstrap: str,
           file: Path | None = None) -> PipelineConfig:
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [src], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"type": "kafka", "connection": dsn, "topic": out, "key_column": "event_id"},
        "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead",
        "spark": {"master": "local[2]"}}
    if side is not None:
        raw["sink"]["replay_topic"] = side
    if file is not None:
        file.write_text(yaml.safe_dump(raw))
    return parse_pipeline(raw, str(file or f"<test {name}>"), {})


def replay(cfg: PipelineConfig, dsn: str, src: str, frm: int = 0, until: int = WINDOW,
           **extra: Any) -> list[int]:
    req = parse_request("replay", {"pipeline": cfg.name, "topic": src, "from_offset": frm,
                                   "until_offset": until, **extra})
    with Ledger(dsn) as ledger:
        return submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req), "test")


def sources(bootstrap: str, topic: str, isolation: str = "read_committed"
            ) -> list[tuple[str, int, int]]:
    return sorted(r.source for r in read_topic(bootstrap, topic, isolation))


@pytest.fixture
def live(spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str
         ) -> dict[str, Any]:
    """A pipeline with a committed live batch: 80 records and 4 dead letters (two of them in
    the replayed window) in two partitions."""
    src = make_topic("krp-src", 2)
    out = make_topic("krp-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"krp{unique}")
    w.plain(40)
    bad = bad_records(kafka_bootstrap, src, 2)  # offsets 20 of both partitions
    w.plain(40)
    bad += bad_records(kafka_bootstrap, src, 2)  # beyond the window
    name = f"krp_{unique}"
    cfg = config(name, src, out, None, pg_dsn, kafka_bootstrap)
    p = plan_only(cfg, pg_dsn)
    assert p.batch is not None
    res = run_batch(spark, cfg, p.batch.batch_id, pg_dsn).result
    assert (res.rows_written, res.bad_records) == (80, 4)
    in_window = sorted((src, *c) for c in bad if c[1] < WINDOW)
    assert len(in_window) == 2
    return {"src": src, "out": out, "name": name, "cfg": cfg, "in_window": in_window}


def window_sources(bootstrap: str, src: str) -> list[tuple[str, int, int]]:
    return sorted((src, p, o) for p in (0, 1) for o in range(WINDOW)
                  if o != 20)  # offset 20 of each partition is a dead letter


def test_a_window_replayed_again_into_its_replay_topic_is_refused_naming_the_way_out(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, live: dict[str, Any]
        ) -> None:
    src, name = live["src"], live["name"]
    side = make_topic("krp-side", 2)
    cfg = config(name, src, live["out"], side, pg_dsn, kafka_bootstrap)
    first = replay(cfg, pg_dsn, src)
    assert [r.result.status for r in run_batches(cfg, pg_dsn, first, spark)] == ["committed"]
    assert sources(kafka_bootstrap, side) == window_sources(kafka_bootstrap, src)
    # the same window again, or one overlapping it: refused, naming the earlier replay,
    # the topic and the ways out; nothing is planned
    for frm, until in ((0, WINDOW), (10, WINDOW + 10)):
        with pytest.raises(RequestError) as e:
            replay(cfg, pg_dsn, src, frm, until)
        msg = str(e.value)
        assert f"batch {first[0]}" in msg and side in msg, msg
        assert "allow_duplicates" in msg and "replay_topic" in msg, msg
    assert sources(kafka_bootstrap, side, "read_uncommitted") == window_sources(
        kafka_bootstrap, src)
    # a window next to it is no repeat
    assert replay(cfg, pg_dsn, src, WINDOW, WINDOW + 5)
    # into a fresh replay topic the window is not there yet: no refusal
    fresh = make_topic("krp-fresh", 2)
    moved = config(name, src, live["out"], fresh, pg_dsn, kafka_bootstrap)
    ids = replay(moved, pg_dsn, src)
    assert [r.result.status for r in run_batches(moved, pg_dsn, ids, spark)] == ["committed"]
    assert sources(kafka_bootstrap, fresh) == window_sources(kafka_bootstrap, src)


def test_a_replays_dead_letters_replace_those_of_earlier_replays_into_its_topic(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, live: dict[str, Any]
        ) -> None:
    """Asked for with allow_duplicates, the window is replayed again (the topic then holds
    it twice, as asked); its dead letters replace the earlier replay's into that topic. The
    live batch's stay: the live topic, which still lacks those records, is not touched."""
    src, name = live["src"], live["name"]
    side = make_topic("krp-side", 2)
    cfg = config(name, src, live["out"], side, pg_dsn, kafka_bootstrap)
    dl = f"{name}_dead"
    for _ in range(2):
        ids = replay(cfg, pg_dsn, src, allow_duplicates=True)
        assert [r.result.status for r in run_batches(cfg, pg_dsn, ids, spark)] == [
            "committed"]
        dead = sorted((d.topic, d.partition, d.offset) for d in dead_letters(pg_dsn, dl, name))
        # the live batch's 4, and the replay's 2 of the window
        assert dead.count(live["in_window"][0]) == 2 and len(dead) == 6, dead
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(ids[0]).params.get("allow_duplicates") is True
    assert sources(kafka_bootstrap, side) == sorted(2 * window_sources(kafka_bootstrap, src))


def test_a_replay_batch_runs_only_into_the_topic_it_was_planned_for(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, live: dict[str, Any]
        ) -> None:
    """The refusal above compares the topic each replay recorded as its target: a batch
    planned into one side topic and run with a config naming another would write the window
    where an earlier replay put it already. Refused, naming both topics."""
    src, name = live["src"], live["name"]
    side, other = make_topic("krp-side", 2), make_topic("krp-other", 2)
    first = replay(config(name, src, live["out"], side, pg_dsn, kafka_bootstrap), pg_dsn, src)
    moved = config(name, src, live["out"], other, pg_dsn, kafka_bootstrap)
    with pytest.raises(ConfigError) as e:
        run_batch(spark, moved, first[0], pg_dsn)
    assert side in str(e.value) and other in str(e.value)
    assert read_topic(kafka_bootstrap, other, "read_uncommitted") == []


@pytest.mark.slow
def test_a_replay_killed_after_its_kafka_commit_is_completed_without_a_second_copy(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, live: dict[str, Any],
        tmp_path: Path, spark_connect_url: str) -> None:
    src, name = live["src"], live["name"]
    side = make_topic("krp-side", 2)
    file = tmp_path / f"{name}.yaml"
    cfg = config(name, src, live["out"], side, pg_dsn, kafka_bootstrap, file)
    ids = replay(cfg, pg_dsn, src)
    # the fault is in the driver's commit, after the tasks: a thin Spark Connect client
    proc = chaos.run_batch_process(chaos.connect_file(file, spark_connect_url), ids[0],
                                   tmp_path / "job.log",
                                   env={"OFFSETFLOW_TEST_SINK_KAFKA_FAULT": "kill_after_commit"})
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, (tmp_path / "job.log").read_text()[-3000:]
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(ids[0]).status != "committed"
    assert sources(kafka_bootstrap, side) == window_sources(kafka_bootstrap, src)
    res = run_batch(spark, cfg, ids[0], pg_dsn).result
    assert res.status == "committed" and res.bad_records == 2
    # not even an aborted second copy in the log; the dead letters once per target
    assert sources(kafka_bootstrap, side, "read_uncommitted") == window_sources(
        kafka_bootstrap, src)
    dead = sorted((d.topic, d.partition, d.offset)
                  for d in dead_letters(pg_dsn, f"{name}_dead", name))
    assert dead.count(live["in_window"][0]) == 2 and len(dead) == 6


def test_a_replay_of_another_incarnation_of_the_source_topic_keeps_the_earlier_dead_letters(
        pg_dsn: str, kafka_bootstrap: str, unique: str) -> None:
    """A source topic deleted and created again holds other records at the same offsets:
    `check_window_repeat` lets a window of the new incarnation into the side topic where a
    replay of the old one went (their Kafka ids differ). That replay's dead letters must
    then not replace the old replay's: the old incarnation's record is not in the side topic
    (it was left out), so its dead letter is the only trace of it."""
    from psycopg2 import sql

    from offsetflow.commit import LINEAGE_COLUMN, ensure_dead_letter
    from offsetflow.ledger import qualified
    from offsetflow.ranges import OffsetRange
    from offsetflow.sinks import sink_for
    from offsetflow.sinks.kafka.limits import replace_window_dead_letters

    name, src, side = f"krpinc_{unique}", f"krpinc-src-{unique}", f"krpinc-side-{unique}"
    cfg = config(name, src, f"krpinc-out-{unique}", side, pg_dsn, kafka_bootstrap)
    dl = f"{name}_dead"
    rng = [OffsetRange(src, 0, 0, WINDOW)]
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        ids = []
        for incarnation in ("old-topic-id", "new-topic-id"):
            ids.append(ledger.insert_batch(
                cur, pipeline=name, kind="replay", ranges=rng, target_table=f"kafka:{side}",
                config_fingerprint="x", split_offsets=0, started_by="test",
                moves_positions=False, topic_ids={src: incarnation}))
        cur.execute("UPDATE offsetflow.batches SET status = 'committed' WHERE batch_id = %s",
                    (ids[0],))
        ensure_dead_letter(cur, dl)
        cur.execute(sql.SQL("INSERT INTO {} (pipeline, topic, partition, \"offset\", error, "
                            "stage, {}) VALUES (%s, %s, 0, 5, 'too large', 'sink', %s)"
                            ).format(qualified(dl), sql.Identifier(LINEAGE_COLUMN)),
                    (name, src, ids[0]))
        # the refusal takes the new incarnation's window for other records: no repeat
        sink_for(cfg).check_window_repeat(cur, "replay", None, rng, {src: "new-topic-id"},
                                          False)
        # so the new incarnation's replay commits beside it, and replaces nothing of it
        removed = replace_window_dead_letters(cur, cfg, ledger.get_batch(ids[1], cur))
        assert removed == 0
        cur.execute(sql.SQL("SELECT count(*) FROM {} WHERE pipeline = %s").format(
            qualified(dl)), (name,))
        assert cur.fetchone() == (1,)


def test_a_replay_planned_before_the_refusal_existed_is_refused_when_it_runs(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, live: dict[str, Any]
        ) -> None:
    """The refusal of a repeated window runs when the window is planned. A replay batch
    planned before that refusal existed (its params do not say allow_duplicates, though it
    repeats a committed replay's window) must not write the window into the side topic a
    second time when it runs: refused, naming the earlier batch and the ways out."""
    import psycopg2

    from offsetflow.errors import KafkaSinkError

    src, name = live["src"], live["name"]
    side = make_topic("krp-side", 2)
    cfg = config(name, src, live["out"], side, pg_dsn, kafka_bootstrap)
    first = replay(cfg, pg_dsn, src)
    assert [r.result.status for r in run_batches(cfg, pg_dsn, first, spark)] == ["committed"]
    # as planned before the refusal: the same window, no allow_duplicates in its params
    again = replay(cfg, pg_dsn, src, allow_duplicates=True)
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("UPDATE offsetflow.batches SET params = params - 'allow_duplicates' "
                        "WHERE batch_id = ANY(%s)", (again,))
    finally:
        conn.close()
    with pytest.raises(KafkaSinkError) as e:
        run_batch(spark, cfg, again[0], pg_dsn)
    msg = str(e.value)
    assert f"batch {first[0]}" in msg and side in msg and "abandon" in msg, msg
    assert sources(kafka_bootstrap, side, "read_uncommitted") == window_sources(
        kafka_bootstrap, src)
