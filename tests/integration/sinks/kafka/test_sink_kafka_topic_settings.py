"""The output topic's own settings that the broker enforces on produce, on the real broker,
PostgreSQL and Spark: none of them may refuse a batch every run with no way out, and none
may drop a record silently. Each is either met by producer settings derived from the topic
(`max.message.bytes` and `segment.bytes` cap librdkafka's record batches), or the record the
topic can never take goes to the dead-letter table naming the setting (a timestamp outside
`message.timestamp.before/after.max.ms`, a single compressed record over the limit), or the
batch stops with an error naming the record or topic, the setting and the way out. A
delivery error names the source record (`topic/partition/offset`), though delivery reports
carry no headers. (`min.insync.replicas` above the in-sync replicas needs a broker down:
test_sink_kafka_cluster.py.)"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.errors import KafkaSinkError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.sinks.kafka.sink import FAULT_ENV
from tests.tooling import chaos
from tests.tooling.chaos import dead_letters
from tests.tooling.kafka_topics import produce
from tests.tooling.topic_checker import read_topic

DAY_MS = 86_400_000


def pipeline(name: str, src: str, out: str, dsn: str, bootstrap: str, *,
             dead_letter: bool, producer: dict[str, str] | None = None) -> PipelineConfig:
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": dsn, "topic": out, "value_format": "raw",
                 "producer": producer or {}}}
    if dead_letter:
        raw.update({"bad_records": "dead_letter", "dead_letter_table": f"{name}_dead"})
    return parse_pipeline(raw, f"<test {name}>", {})


def planned(cfg: PipelineConfig, dsn: str) -> int:
    p = plan_only(cfg, dsn)
    assert p.batch is not None
    return p.batch.batch_id


def status(dsn: str, batch_id: int) -> str:
    with Ledger(dsn) as ledger:
        return ledger.get_batch(batch_id).status


def test_small_max_message_bytes_caps_the_producers_record_batches(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Each record fits the topic's 2,000 bytes, librdkafka's batches (up to 1 MB) do not:
    the batch size is capped from the topic, so the batch commits instead of failing every
    run with `Message size too large`."""
    src = make_topic("kmb-src", 2)
    out = make_topic("kmb-out", 2, {"max.message.bytes": "2000"})
    records = [(i % 2, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(300)]
    produce(kafka_bootstrap, src, records)
    cfg = pipeline(f"kmb_{unique}", src, out, pg_dsn, kafka_bootstrap, dead_letter=False)
    bid = planned(cfg, pg_dsn)
    res = run_batch(spark, cfg, bid, pg_dsn).result
    assert (res.status, res.rows_written) == ("committed", 300)
    got = read_topic(kafka_bootstrap, out)
    assert sorted(r.value or b"" for r in got) == sorted(v for _, _, v, _ in records)


def test_a_compressed_record_the_topic_refuses_alone_goes_to_dead_letters_named(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """With compression the size check is the broker's: a record over the topic's limit
    even compressed (random bytes) is refused by the broker alone in its record batch. The
    delivery report names no source record: the sink finds it, sends it to the dead-letter
    table and commits the rest in a new transaction; without a dead-letter table the error
    names it (topic/partition/offset) and the setting. Before: every run failed with
    `Message size too large` naming `record of source ?`."""
    src = make_topic("kmz-src", 2)
    out = make_topic("kmz-out", 2, {"max.message.bytes": "2000"})
    small = [(i % 2, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(60)]
    coords = produce(kafka_bootstrap, src, [*small[:30], (1, b"noise", os.urandom(3000), 0),
                                            *small[30:]])
    noise = coords[30]
    lz4 = {"compression.type": "lz4"}

    failing = pipeline(f"kmzf_{unique}", src, out, pg_dsn, kafka_bootstrap,
                       dead_letter=False, producer=lz4)
    bid = planned(failing, pg_dsn)
    with pytest.raises(KafkaSinkError) as e:
        run_batch(spark, failing, bid, pg_dsn)
    msg = str(e.value)
    assert f"{src}/{noise[0]}/{noise[1]}" in msg and "max.message.bytes" in msg, msg
    assert "bad_records: dead_letter" in msg  # the way out
    assert read_topic(kafka_bootstrap, out) == []

    name = f"kmzd_{unique}"
    cfg = pipeline(name, src, out, pg_dsn, kafka_bootstrap, dead_letter=True, producer=lz4)
    res = run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 60, 1)
    assert sorted(r.value or b"" for r in read_topic(kafka_bootstrap, out)) == sorted(
        v for _, _, v, _ in small)
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *noise)]
    assert out in dead[0].error and "max.message.bytes" in dead[0].error


def test_a_record_refused_last_in_its_partition_leaves_no_gap_that_fails_the_next_pass(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A record the broker refuses (compressed, over the limit alone) as the last one of
    its partition in a pass: no request after it in the pass fails out of order, so the
    abort bumps no epoch, and the next pass's first request has a sequence number one past
    what the broker expects: librdkafka fails that transaction as abortable
    (OUT_OF_ORDER_SEQUENCE_NUMBER, "skipped sequence numbers") with no record refused. Each
    pass after an aborted one now has a new producer (its init_transactions bumps the
    epoch: no gap), and a pass that becomes abortable all the same is one more pass (its
    abort bumps the epoch; the first version of the fix committed so, in 3 passes). Before:
    the batch failed at
    send_offsets_to_transaction every run (the flake of
    test_killed_after_a_commit_that_left_out_refused_records_the_next_run_routes_them,
    where under load the records after the refused one were still queued, and purged)."""
    src = make_topic("kmg-src", 1)
    out = make_topic("kmg-out", 1, {"max.message.bytes": "2000"})
    small = [(0, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(10)]
    coords = produce(kafka_bootstrap, src, [*small, (0, b"noise", os.urandom(3000), 0)])
    name = f"kmg_{unique}"
    cfg = pipeline(name, src, out, pg_dsn, kafka_bootstrap, dead_letter=True,
                   producer={"compression.type": "lz4"})
    res = run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 10, 1)
    assert sorted(r.value or b"" for r in read_topic(kafka_bootstrap, out)) == sorted(
        v for _, _, v, _ in small)
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *coords[10])]


def test_more_refused_records_than_passes_all_become_dead_letters(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Eight incompressible records over the topic's 2,000 bytes, spread among small ones
    in one output partition: a pass stops at the first refusal (the transaction is then
    abortable and the rest is purged), so a pass may find only one of them. The batch must
    commit with all eight as dead letters."""
    src = make_topic("kmp-src", 1)
    out = make_topic("kmp-out", 1, {"max.message.bytes": "2000"})
    records: list[tuple[int, bytes | None, bytes, int]] = []
    noisy: list[int] = []
    for i in range(80):
        if i % 10 == 5:
            noisy.append(len(records))
            records.append((0, f"n{i}".encode(), os.urandom(3000), 0))
        else:
            records.append((0, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0))
    coords = produce(kafka_bootstrap, src, records)
    name = f"kmp_{unique}"
    cfg = pipeline(name, src, out, pg_dsn, kafka_bootstrap, dead_letter=True,
                   producer={"compression.type": "lz4"})
    res = run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result
    small = [v for i, (_, _, v, _) in enumerate(records) if i not in noisy]
    assert (res.status, res.rows_written, res.bad_records) == ("committed", len(small),
                                                               len(noisy))
    assert sorted(r.value or b"" for r in read_topic(kafka_bootstrap, out)) == sorted(small)
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert sorted((d.topic, d.partition, d.offset) for d in dead) == sorted(
        (src, *coords[i]) for i in noisy)


def test_timestamps_the_topic_refuses_go_to_dead_letters_or_fail_naming_the_setting(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The sink copies source timestamps (CreateTime); a topic with
    `message.timestamp.before.max.ms` of a day refuses a replay of older records, and one
    with `after.max.ms` a record stamped in the future (INVALID_TIMESTAMP, the whole
    transaction aborted, every run). Such records are found before they are produced: dead
    letters naming the setting, or the batch fails naming record, setting and way out. A
    LogAppendTime topic takes them all (the broker stamps its own time)."""
    src = make_topic("kts-src", 2, {"message.timestamp.after.max.ms": str(7 * DAY_MS)})
    limits = {"message.timestamp.before.max.ms": str(DAY_MS),
              "message.timestamp.after.max.ms": "3600000"}
    out = make_topic("kts-out", 2, limits)
    now = int(time.time() * 1000)
    good = [(i % 2, f"k{i}".encode(), f"v{i}".encode(), now - 60_000) for i in range(40)]
    coords = produce(kafka_bootstrap, src, [
        *good[:20], (0, b"old", b"two days old", now - 2 * DAY_MS),
        (1, b"future", b"three hours ahead", now + 3 * 3_600_000), *good[20:]])
    old, future = coords[20], coords[21]

    failing = pipeline(f"ktsf_{unique}", src, out, pg_dsn, kafka_bootstrap, dead_letter=False)
    bid = planned(failing, pg_dsn)
    with pytest.raises(KafkaSinkError) as e:
        run_batch(spark, failing, bid, pg_dsn)
    msg = str(e.value)
    assert re.search(rf"{src}/({old[0]}/{old[1]}|{future[0]}/{future[1]})", msg), msg
    assert "message.timestamp." in msg and "bad_records: dead_letter" in msg, msg
    assert status(pg_dsn, bid) != "committed"
    assert read_topic(kafka_bootstrap, out) == []

    name = f"ktsd_{unique}"
    cfg = pipeline(name, src, out, pg_dsn, kafka_bootstrap, dead_letter=True)
    res = run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 40, 2)
    assert sorted(r.value or b"" for r in read_topic(kafka_bootstrap, out)) == sorted(
        v for _, _, v, _ in good)
    dead = {(d.topic, d.partition, d.offset): d.error
            for d in dead_letters(pg_dsn, f"{name}_dead", name)}
    assert set(dead) == {(src, *old), (src, *future)}
    assert "message.timestamp.before.max.ms" in dead[(src, *old)]
    assert "message.timestamp.after.max.ms" in dead[(src, *future)]

    # a LogAppendTime topic stamps the broker's time: every record goes in
    stamped = make_topic("kts-lat", 2, {**limits, "message.timestamp.type": "LogAppendTime"})
    lat = pipeline(f"ktsl_{unique}", src, stamped, pg_dsn, kafka_bootstrap, dead_letter=True)
    res = run_batch(spark, lat, planned(lat, pg_dsn), pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 42, 0)


def test_an_output_topic_deleted_between_batches_is_refused_and_recreated_grown_is_noted(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Deleted: the batch fails naming the topic and the way out (the producer never
    creates it: a broker with auto.create.topics.enable would make it again, empty, with
    its default partitions). Recreated with more partitions: the batch commits once, and
    since a key's later records then go to another partition (Kafka's keyed partitioning,
    no loss or copy), the run says so naming both counts."""
    src = make_topic("kpc-src", 2)
    out = make_topic("kpc-out", 2)
    keys = [f"key-{i}".encode() for i in range(40)]
    produce(kafka_bootstrap, src, [(i % 2, k, b"first", 0) for i, k in enumerate(keys)])
    cfg = pipeline(f"kpc_{unique}", src, out, pg_dsn, kafka_bootstrap, dead_letter=False)
    assert run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result.rows_written == 40
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_topics([out])[out].result(30)
    chaos.wait_for(lambda: out not in admin.list_topics(timeout=10).topics, 30,
                   f"{out} to be deleted")
    produce(kafka_bootstrap, src, [(i % 2, k, b"second", 0) for i, k in enumerate(keys)])
    bid = planned(cfg, pg_dsn)
    with pytest.raises(KafkaSinkError, match=f"output topic {out} is not usable.*create it"):
        run_batch(spark, cfg, bid, pg_dsn)
    assert out not in admin.list_topics(timeout=10).topics  # not created by the sink
    admin.create_topics([NewTopic(out, 4, 1)])[out].result(30)
    with caplog.at_level("WARNING", logger="offsetflow"):
        res = run_batch(spark, cfg, bid, pg_dsn).result
    assert (res.status, res.rows_written) == ("committed", 40)
    assert f"output topic {out} has 4 partitions, 2 when batch" in caplog.text
    assert "partitioning: key" in caplog.text
    got = read_topic(kafka_bootstrap, out)
    assert sorted(r.key or b"" for r in got) == sorted(keys) and {r.value for r in got} == {
        b"second"}


@pytest.mark.slow
def test_killed_after_a_commit_that_left_out_refused_records_the_next_run_routes_them(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path) -> None:
    """A commit whose passes left out a record only the broker refused (compressed, over
    the limit alone) and one with a refused timestamp records both in its offset metadata;
    killed before the ledger's commit, the next run finds the commit, produces nothing again
    and routes the same two records, each with its reason."""
    src = make_topic("kmk-src", 2, {"message.timestamp.after.max.ms": str(7 * DAY_MS)})
    out = make_topic("kmk-out", 2, {"max.message.bytes": "2000",
                                    "message.timestamp.after.max.ms": "3600000"})
    small = [(i % 2, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(40)]
    ahead = int(time.time() * 1000) + 3 * 3_600_000
    coords = produce(kafka_bootstrap, src, [*small[:20], (1, b"noise", os.urandom(3000), 0),
                                            (0, b"ahead", b"later", ahead), *small[20:]])
    name = f"kmk_{unique}"
    file = tmp_path / f"{name}.yaml"
    raw = {"name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [src]}, "format": {"type": "raw"},
           "sink": {"type": "kafka", "connection": pg_dsn, "topic": out, "value_format": "raw",
                    "producer": {"compression.type": "lz4"}},
           "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead"}
    file.write_text(yaml.safe_dump(raw))
    cfg = parse_pipeline(raw, str(file), {})
    bid = planned(cfg, pg_dsn)
    proc = chaos.run_batch_process(file, bid, tmp_path / "job.log",
                                   env={FAULT_ENV: "kill_after_commit"})
    try:
        assert proc.wait(timeout=600) == -9, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            chaos.kill(proc)
    assert status(pg_dsn, bid) != "committed"
    assert dead_letters(pg_dsn, f"{name}_dead", name) == []
    res = run_batch(spark, cfg, bid, pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 40, 2)
    assert len(read_topic(kafka_bootstrap, out, "read_committed")) == 40
    # the aborted pass's records are in the log, the committed pass's once, none again
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) < 2 * 40 + 2
    dead = {(d.topic, d.partition, d.offset): d.error
            for d in dead_letters(pg_dsn, f"{name}_dead", name)}
    assert set(dead) == {(src, *coords[20]), (src, *coords[21])}
    assert "max.message.bytes" in dead[(src, *coords[20])]
    assert "message.timestamp.after.max.ms" in dead[(src, *coords[21])]


def test_too_many_refused_records_of_a_replay_name_its_side_topic(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A replay of records older than its side topic's message.timestamp.before.max.ms
    leaves every one of them out; too many to list in the commit's offset metadata, the
    batch fails. The error must name the side topic the records were refused by (whose
    setting to raise), not the live topic, which the replay does not touch."""
    from offsetflow.ops import kafka_for, plan_window, run_batches, submit_window
    from offsetflow.plan import parse_request

    src = make_topic("kto-src", 1)
    out = make_topic("kto-out", 1)
    side = make_topic("kto-side", 1, {"message.timestamp.before.max.ms": str(DAY_MS)})
    old = int(time.time() * 1000) - 2 * DAY_MS
    n = 300  # each is listed as "offset:ts<13 digits>" in at most 4,000 bytes
    produce(kafka_bootstrap, src, [(0, f"k{i}".encode(), f"v{i}".encode(), old + i)
                                   for i in range(n)])
    name = f"kto_{unique}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [src], "starting": "earliest"}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": out, "value_format": "raw",
                 "replay_topic": side},
        "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead"}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    assert run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result.status == "committed"
    req = parse_request("replay", {"pipeline": name, "topic": src, "from_offset": 0,
                                   "until_offset": n})
    with Ledger(pg_dsn) as ledger:
        ids = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req), "t")
    with pytest.raises(KafkaSinkError) as e:
        run_batches(cfg, pg_dsn, ids, spark)
    msg = str(e.value)
    assert f"not produced to {side}" in msg and "too many to record" in msg, msg
    assert f"not produced to {out}" not in msg, msg
    assert read_topic(kafka_bootstrap, side) == []


def test_a_record_refused_last_in_its_partition_then_a_stage_read_out_of_order_commits(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The unsorted stage read's pass sends a record the broker refuses, the last of its
    output partition in that pass (no later request there fails out of order, so the abort
    bumps no epoch), and then meets a record out of source order (here forced: the last two
    segments swapped): the transaction is aborted and the sorted pass follows in the same
    commit. It must start from a new producer, as every pass after an aborted one does
    (`_reopen`), else its first request to that partition skips a sequence number. The
    batch commits with the refused record a dead letter and every other record once."""
    import offsetflow.sinks.kafka.sink as sink_module

    real = sink_module.segments

    def late_swap(*args: Any) -> Any:
        got = real(*args)
        return None if got is None else [*got[:-2], got[-1], got[-2]]

    monkeypatch.setattr(sink_module, "segments", late_swap)
    sinks: list[Any] = []
    real_segments = sink_module.KafkaTopicSink._segments

    def keep(self: Any, *args: Any) -> Any:
        sinks.append(self)
        return real_segments(self, *args)

    real_prefetched = sink_module.prefetched

    def delivered_before_the_surprise(*args: Any, **kw: Any) -> Any:
        """The stage's rows as read, but every record produced before the first one out of
        order is delivered (or refused) first: the refused record has spent its sequence
        number when the pass is aborted."""
        last: dict[tuple[str, int], int] = {}
        for chunk in real_prefetched(*args, **kw):
            held: list[Any] = []
            for row in chunk:
                if row[2] < last.get((row[0], row[1]), -1):
                    yield held
                    held = []
                    sinks[-1]._producer.flush(30)
                last[(row[0], row[1])] = row[2]
                held.append(row)
            yield held

    monkeypatch.setattr(sink_module.KafkaTopicSink, "_segments", keep)
    monkeypatch.setattr(sink_module, "prefetched", delivered_before_the_surprise)
    # the pass after the read (no overlap: a refusal during the read has its own test in
    # test_sink_kafka_overlap.py)
    monkeypatch.setattr(sink_module.KafkaTopicSink, "overlap", False)
    src = make_topic("kmo-src", 2)
    out = make_topic("kmo-out", 2, {"max.message.bytes": "2000"})
    small = [(0, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(10)]
    bulk = [(1, f"b{i}".encode(), f"{i:06d}".encode() * 4, 0) for i in range(600)]
    coords = produce(kafka_bootstrap, src,
                     [*small, (0, b"noise", os.urandom(3000), 0), *bulk])
    name = f"kmo_{unique}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": out, "value_format": "raw",
                 "partitioning": "source", "producer": {"compression.type": "lz4"}},
        "spark": {"master": "local[2]", "max_offsets_per_task": 500},
        "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead"}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    with caplog.at_level(logging.WARNING, logger="offsetflow.sinks.kafka.sink"):
        res = run_batch(spark, cfg, planned(cfg, pg_dsn), pg_dsn).result
    assert (res.status, res.rows_written, res.bad_records) == ("committed", 610, 1), res
    assert "producing the batch again from the stage read sorted" in caplog.text
    # no pass is lost to the aborted transaction's leftovers (its purged records' reports,
    # a skipped sequence number): each such pass counts against MAX_PASSES
    assert "failed with no record refused" not in caplog.text, caplog.text
    got = read_topic(kafka_bootstrap, out)
    assert sorted(r.value or b"" for r in got) == sorted(
        v for _, _, v, _ in [*small, *bulk])
    for part in (0, 1):
        offsets = [r.source[2] for r in sorted(got, key=lambda r: r.offset)
                   if r.partition == part]
        assert offsets == sorted(offsets), part
    dead = dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *coords[10])]
