"""Adversarial cases of the Kafka sink's part-wise overlap (issue 32 review), on the real
broker and PostgreSQL, driven as `test_sink_kafka_overlap` drives it (each part staged by
the code a Spark task runs, the test deciding when)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from offsetflow.config import parse_pipeline
from offsetflow.ops import plan_only
from tests.integration.sinks.kafka.test_sink_kafka_overlap import _staging_for, wait_until
from tests.integration.sinks.kafka.test_sink_kafka_topic_settings import produce
from tests.tooling import chaos
from tests.tooling.topic_checker import read_topic


def test_a_pass_failed_during_the_read_holds_no_reader_back_while_the_read_goes_on(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A record the broker refuses during the read ends the overlap's pass: nothing more
    is produced before the read ends, and the pass can only be aborted. Left open until
    then, that dead transaction pins the last stable offset of every output partition it
    wrote to, so read_committed consumers of the topic see nothing newer (here another
    producer's record) for the rest of the read, up to transaction.timeout.ms. It is
    aborted as the overlap stops; the batch still commits once, the record dead-lettered."""
    src = make_topic("ovf-src", 2)
    out = make_topic("ovf-out", 2, {"max.message.bytes": "2000"})
    small = [(i % 2, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(60)]
    coords = produce(kafka_bootstrap, src, [*small[:10], (1, b"noise", os.urandom(3000), 0),
                                            *small[10:]])
    noise = coords[10]
    name = f"ovf_{unique}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": out,
                 "value_format": "raw", "producer": {"compression.type": "lz4"}},
        "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead",
        "spark": {"master": "local[2]", "max_offsets_per_task": 10}}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    s = _staging_for(cfg, planned.batch, pg_dsn, kafka_bootstrap, out, split=10)
    last = len(s.specs) - 1
    noisy = next(i for i, sp in enumerate(s.specs)
                 if sp["partition"] == noise[0] and sp["from_offset"] <= noise[1]
                 < sp["until_offset"])
    assert noisy != last
    with s.committer() as committer:
        for i in range(last):
            s.stage(i)
        sink = s.sink
        assert sink is not None
        wait_until(lambda: "kafka_overlap_stopped_s" in sink.phases,
                   "the refusal to stop the overlap")
        # the read goes on (the last part unstaged); another producer commits a record
        # to each output partition the dead pass wrote to
        produce(kafka_bootstrap, out, [(p, b"other", b"another producer's record", 0)
                                       for p in (0, 1)])
        t = time.monotonic()
        try:
            wait_until(lambda: sum(r.value == b"another producer's record" for r in
                                   read_topic(kafka_bootstrap, out, "read_committed",
                                              timeout_s=10)) == 2,
                       "read_committed to show the other producer's records", timeout_s=15)
        finally:
            held = time.monotonic() - t
            s.stage(last)
            result = committer.finish(expected_parts=len(s.specs))
        assert held < 15
    assert (result.status, result.rows_written, result.bad_records) == ("committed", 60, 1)
    committed = [r for r in read_topic(kafka_bootstrap, out, "read_committed")
                 if r.key != b"other"]
    assert sorted(r.value or b"" for r in committed) == sorted(v for _, _, v, _ in small)
    dead = chaos.dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *noise)]


def _set_topic_config(bootstrap: str, topic: str, configs: dict[str, str]) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.alter_configs([ConfigResource("topic", topic,
                                                 set_config=configs)]).values():
        f.result(timeout=30)


def test_a_topic_limit_lowered_during_the_read_is_the_one_the_batch_is_produced_under(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The overlap reads the output topic's settings before the first record, at the start
    of the read, where the commit used to read them after it. A max.message.bytes lowered
    while the read goes on (minutes, for a large batch) is then unknown to the rest of the
    attempt: a record over the new limit is sent, the broker refuses it, and the refusal is
    judged against the old limit (and the old producer's batch.size): no record is found
    refused for itself and the attempt fails, where the commit after the read took the new
    limit and dead-lettered that record. The settings are read again after the read (as
    the commit did): changed, what the overlap produced under the old ones is aborted and
    the batch produced under the new ones."""
    src = make_topic("ovs-src", 2)
    out = make_topic("ovs-out", 2, {"max.message.bytes": "8000"})
    small = [(i % 2, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(60)]
    coords = produce(kafka_bootstrap, src, [*small, (1, b"big", os.urandom(3000), 0)])
    big = coords[-1]
    name = f"ovs_{unique}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": out,
                 "value_format": "raw", "producer": {"compression.type": "lz4"}},
        "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead",
        "spark": {"master": "local[2]", "max_offsets_per_task": 10}}
    cfg = parse_pipeline(raw, f"<test {name}>", {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    s = _staging_for(cfg, planned.batch, pg_dsn, kafka_bootstrap, out, split=10)
    last = len(s.specs) - 1
    sp = s.specs[last]
    # the big record in the last part, staged last
    assert sp["partition"] == big[0] and sp["from_offset"] <= big[1] < sp["until_offset"]
    before = 60 - (sp["until_offset"] - sp["from_offset"] - 1)
    with s.committer() as committer:
        for i in range(last):
            s.stage(i)
        wait_until(lambda: s.in_log() == before, "the first parts to be produced")
        # the read goes on; the topic's limit is lowered below the big record meanwhile
        _set_topic_config(kafka_bootstrap, out, {"max.message.bytes": "2000"})
        s.stage(last)
        result = committer.finish(expected_parts=len(s.specs))
    assert (result.status, result.rows_written, result.bad_records) == ("committed", 60, 1)
    committed = read_topic(kafka_bootstrap, out, "read_committed")
    assert sorted(r.value or b"" for r in committed) == sorted(v for _, _, v, _ in small)
    dead = chaos.dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *big)]


@pytest.mark.slow
def test_the_broker_killed_mid_overlap_the_batch_commits_once(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """kill -9 of the broker with the overlap's transaction open and the read going on,
    started again before the read ends: this attempt commits, or fails with nothing
    visible and the next one commits; read_committed holds each record once."""
    from offsetflow.errors import KafkaSinkError
    from tests.integration.sinks.kafka.test_sink_kafka_overlap import KafkaStaging

    s = KafkaStaging(pg_dsn, kafka_bootstrap, make_topic, unique)
    try:
        with s.committer() as committer:
            assert s.stage(0) == 100 and s.stage(2) == 100
            wait_until(lambda: s.in_log() == 200, "parts 0 and 2 to be produced")
            chaos.kill_kafka(restart=True)
            for i in (1, 3):
                assert s.stage(i) == 100
            result = committer.finish(expected_parts=4)
    except KafkaSinkError:  # this attempt failed, nothing visible: the next one commits
        with s.committer() as committer:
            result = committer.finish(expected_parts=4)
    assert result.status == "committed" and result.rows_written == 400
    s.verdict(400)
