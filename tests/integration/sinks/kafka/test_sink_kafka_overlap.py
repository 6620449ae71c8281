"""The Kafka topic sink producing each stage part into the batch's transaction while later
parts are still read (`KafkaTopicSink.begin_parts`/`take_parts` under
`offsetflow.commit.PartwiseCommit`), on the real broker and PostgreSQL.

Most cases are driven without Spark (tests.tooling.kafka_staging), as
`tests/integration/commit/test_sink.py` drives the PostgreSQL part-wise commit: each part is
read and staged by the code a Spark task runs, so the test decides when a part becomes staged
relative to what the commit produces; among them the adversarial cases of issue 32's review
(a pass failed during the read, a topic limit lowered during it, the broker killed). The
driver killed mid-overlap and two runs of one batch at once run `offsetflow run-batch` as a
process (`KafkaCase`), held by the test-only fault point `pause_in_overlap` (some parts
produced, the transaction open, the read going on). Every case ends with the output topic
read read_committed (tests.tooling.topic_checker): each source record once, none lost, and
the aborted copies that read_uncommitted shows kept out."""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.job import run_batch
from tests.tooling import chaos
from tests.tooling.chaos import wait_for
from tests.tooling.kafka_case import (
    RECORDS,
    KafkaCase,
    cut_idle_ledger_transactions,
    killed_at_end,
    make_case,
)
from tests.tooling.kafka_staging import SMALL, KafkaStaging, json_staging, oversized_staging
from tests.tooling.kafka_topics import produce
from tests.tooling.topic_checker import read_topic


@pytest.fixture
def staging(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> KafkaStaging:
    return json_staging(pg_dsn, kafka_bootstrap, make_topic, unique)


def test_parts_are_produced_in_source_order_as_staged_and_visible_only_at_commit(
        staging: KafkaStaging) -> None:
    s = staging
    assert len(s.specs) == 4  # sub-ranges: p0 [0,100) [100,200), p1 [0,100) [100,200)
    by_part = {i: (sp["partition"], sp["from_offset"]) for i, sp in enumerate(s.specs)}
    second_of_p0 = next(i for i, v in by_part.items() if v[0] == 0 and v[1] > 0)
    first_of_p0 = next(i for i, v in by_part.items() if v[0] == 0 and v[1] == 0)
    rest = [i for i in by_part if i not in (first_of_p0, second_of_p0)]
    with s.committer() as committer:
        # the later sub-range of partition 0 first: it waits for the earlier one
        assert s.stage(second_of_p0) == 100
        for i in rest:  # partition 1, both sub-ranges: produced now
            assert s.stage(i) == 100
        wait_for(lambda: s.in_log() == 200, 60, "partition 1's parts to be produced")
        got = read_topic(s.bootstrap, s.out, "read_uncommitted")
        sources = {(r.headers["offsetflow.source"] or b"").decode() for r in got}
        assert {src.split("/")[1] for src in sources} == {"1"}
        assert s.visible() == 0  # in the open transaction only
        assert s.stage(first_of_p0) == 100  # now both of partition 0 go, in order
        wait_for(lambda: s.in_log() == 400, 60, "partition 0's parts to be produced")
        result = committer.finish(expected_parts=4)
    assert result.status == "committed" and result.rows_written == 400
    assert s.timings.get("kafka_overlap_s", 0) > 0
    v = s.verdict(400)
    assert v.in_log == 400  # nothing produced twice, not even aborted
    # in each output partition, each source partition's records in source order
    offsets: dict[tuple[int, int], list[int]] = {}
    for r in read_topic(s.bootstrap, s.out, "read_committed"):
        _t, part, off = (r.headers["offsetflow.source"] or b"").decode().rsplit("/", 2)
        offsets.setdefault((r.partition, int(part)), []).append(int(off))
    for where, seen in offsets.items():
        assert seen == sorted(seen), where


def test_a_task_retried_after_its_part_was_produced_is_not_produced_again(
        staging: KafkaStaging) -> None:
    """A part produced during the read is never produced twice (its retry, or a zombie's
    attempt, finds the marker and stages nothing), and an attempt that failed halfway
    produced nothing: the overlap takes a part only by its marker, which commits with the
    part's rows."""
    s = staging
    with s.committer() as committer:
        assert s.stage(0) == 100
        wait_for(lambda: s.in_log() == 100, 60, "part 0 to be produced")
        assert s.stage(0) == 0  # the retried (or speculative) attempt: staged already
        with pytest.raises(RuntimeError, match="fails after"):
            s.stage(1, fail_after_rows=1)  # rolled back: no marker, no rows
        assert s.stage(1) == 100  # its retry
        assert s.stage(2) == 100 and s.stage(3) == 100
        result = committer.finish(expected_parts=4)
    assert result.status == "committed" and result.rows_written == 400
    assert s.verdict(400).in_log == 400


def test_a_transaction_that_would_outlive_its_timeout_during_the_read_is_given_up(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A read longer than transaction.timeout.ms: the transaction opened for the first part
    would be aborted by the broker, and so would every retry's (the read takes as long each
    time): a wedge. Past OVERLAP_SHARE of the timeout the overlap aborts what it produced and
    the batch is produced after the read, in a transaction as short as before."""
    s = json_staging(pg_dsn, kafka_bootstrap, make_topic, unique,
                     producer={"transaction.timeout.ms": "4000"})
    with s.committer() as committer:
        assert s.stage(0) == 100
        wait_for(lambda: s.in_log() == 100, 60, "part 0 to be produced")
        sink = s.sink
        assert sink is not None
        # the read goes on (parts 1-3 unstaged) until the overlap gives its transaction up
        wait_for(lambda: "kafka_overlap_given_up_s" in sink.phases, 30,
                 "the overlap to give up its transaction")
        for i in (1, 2, 3):
            assert s.stage(i) == 100
        result = committer.finish(expected_parts=4)
    assert result.status == "committed" and result.rows_written == 400
    v = s.verdict(400)
    assert v.aborted_in_log == 100  # part 0's copy of the given-up transaction


def _part_of(s: KafkaStaging, record: tuple[str, int, int]) -> int:
    """The part whose sub-range holds the source record (topic, partition, offset)."""
    _, partition, offset = record
    return next(i for i, sp in enumerate(s.specs) if sp["partition"] == partition
                and sp["from_offset"] <= offset < sp["until_offset"])


def test_a_record_refused_during_the_read_is_left_out_by_the_next_pass(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A record the broker refuses for itself (over the topic's max.message.bytes even
    compressed) in a part produced during the read: that pass is aborted after the read,
    the record found and sent to the dead-letter table, and the batch produced again
    without it; read_committed holds every other record once."""
    s, noise = oversized_staging(pg_dsn, kafka_bootstrap, make_topic, unique, "ovr",
                                 max_message_bytes="2000", at=10)
    noisy = _part_of(s, noise)
    with s.committer() as committer:
        for i in range(len(s.specs)):
            if i != len(s.specs) - 1 or i == noisy:
                s.stage(i)
        sink = s.sink
        assert sink is not None
        # the refusal arrives while the read goes on (the last part unstaged)
        wait_for(lambda: "kafka_overlap_stopped_s" in sink.phases, 60,
                 "the refusal to stop the overlap")
        s.stage(len(s.specs) - 1)
        result = committer.finish(expected_parts=len(s.specs))
    assert (result.status, result.rows_written, result.bad_records) == ("committed", 60, 1)
    committed = read_topic(kafka_bootstrap, s.out, "read_committed")
    assert sorted(r.value or b"" for r in committed) == sorted(v for _, _, v, _ in SMALL)
    assert len(read_topic(kafka_bootstrap, s.out, "read_uncommitted")) > 60  # aborted pass
    assert s.dead_letters() == [noise]


def test_a_pass_failed_during_the_read_holds_no_reader_back_while_the_read_goes_on(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A record the broker refuses during the read ends the overlap's pass: nothing more
    is produced before the read ends, and the pass can only be aborted. Left open until
    then, that dead transaction pins the last stable offset of every output partition it
    wrote to, so read_committed consumers of the topic see nothing newer (here another
    producer's record) for the rest of the read, up to transaction.timeout.ms. It is
    aborted as the overlap stops; the batch still commits once, the record dead-lettered."""
    s, noise = oversized_staging(pg_dsn, kafka_bootstrap, make_topic, unique, "ovf",
                                 max_message_bytes="2000", at=10)
    last = len(s.specs) - 1
    assert _part_of(s, noise) != last
    with s.committer() as committer:
        for i in range(last):
            s.stage(i)
        sink = s.sink
        assert sink is not None
        wait_for(lambda: "kafka_overlap_stopped_s" in sink.phases, 60,
                 "the refusal to stop the overlap")
        # the read goes on (the last part unstaged); another producer commits a record
        # to each output partition the dead pass wrote to
        produce(kafka_bootstrap, s.out, [(p, b"other", b"another producer's record", 0)
                                         for p in (0, 1)])
        t = time.monotonic()
        try:
            wait_for(lambda: sum(r.value == b"another producer's record" for r in
                                 read_topic(kafka_bootstrap, s.out, "read_committed",
                                            timeout_s=10)) == 2, 15,
                     "read_committed to show the other producer's records")
        finally:
            held = time.monotonic() - t
            s.stage(last)
            result = committer.finish(expected_parts=len(s.specs))
        assert held < 15
    assert (result.status, result.rows_written, result.bad_records) == ("committed", 60, 1)
    committed = [r for r in read_topic(kafka_bootstrap, s.out, "read_committed")
                 if r.key != b"other"]
    assert sorted(r.value or b"" for r in committed) == sorted(v for _, _, v, _ in SMALL)
    assert s.dead_letters() == [noise]


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
    s, big = oversized_staging(pg_dsn, kafka_bootstrap, make_topic, unique, "ovs",
                               max_message_bytes="8000", at=len(SMALL))
    last = len(s.specs) - 1
    sp = s.specs[last]
    # the big record in the last part, staged last
    assert _part_of(s, big) == last
    before = 60 - (sp["until_offset"] - sp["from_offset"] - 1)
    with s.committer() as committer:
        for i in range(last):
            s.stage(i)
        wait_for(lambda: s.in_log() == before, 60, "the first parts to be produced")
        # the read goes on; the topic's limit is lowered below the big record meanwhile
        _set_topic_config(kafka_bootstrap, s.out, {"max.message.bytes": "2000"})
        s.stage(last)
        result = committer.finish(expected_parts=len(s.specs))
    assert (result.status, result.rows_written, result.bad_records) == ("committed", 60, 1)
    committed = read_topic(kafka_bootstrap, s.out, "read_committed")
    assert sorted(r.value or b"" for r in committed) == sorted(v for _, _, v, _ in SMALL)
    assert s.dead_letters() == [big]


@pytest.mark.slow
def test_the_broker_killed_mid_overlap_the_batch_commits_once(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """kill -9 of the broker with the overlap's transaction open and the read going on,
    started again before the read ends: this attempt commits, or fails with nothing
    visible and the next one commits; read_committed holds each record once."""
    from offsetflow.errors import KafkaSinkError

    s = json_staging(pg_dsn, kafka_bootstrap, make_topic, unique)
    try:
        with s.committer() as committer:
            assert s.stage(0) == 100 and s.stage(2) == 100
            wait_for(lambda: s.in_log() == 200, 60, "parts 0 and 2 to be produced")
            chaos.kill_kafka(restart=True)
            for i in (1, 3):
                assert s.stage(i) == 100
            result = committer.finish(expected_parts=4)
    except KafkaSinkError:  # this attempt failed, nothing visible: the next one commits
        with s.committer() as committer:
            result = committer.finish(expected_parts=4)
    assert result.status == "committed" and result.rows_written == 400
    s.verdict(400)


# -- the job as a process ---------------------------------------------------------------


@pytest.fixture
def case(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
         tmp_path: Path) -> KafkaCase:
    c = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                  spark={"max_offsets_per_task": 100})
    raw = yaml.safe_load(c.file.read_text())
    assert raw["spark"]["max_offsets_per_task"] == 100  # several parts per partition
    return c


def test_driver_killed_mid_overlap_the_retry_commits_once(spark: Any, case: KafkaCase) -> None:
    proc = case.start("pause_in_overlap")
    with killed_at_end(proc):
        case.wait_paused(proc)
        # some parts produced into the open transaction while the read goes on
        wait_for(lambda: len(read_topic(case.bootstrap, case.out, "read_uncommitted")) > 0,
                 60, "the first part's records in the log")
        assert read_topic(case.bootstrap, case.out, "read_committed") == []
        chaos.kill(proc)  # kill -9 of the driver and its JVM
    assert case.status() != "committed"
    # the retry's init_transactions aborts the dead producer's transaction
    assert run_batch(spark, case.cfg, case.batch_id, case.dsn).result.status == "committed"
    v = case.verdict()
    assert v.aborted_in_log > 0  # the killed attempt's records exist, aborted


def test_two_runs_at_once_the_later_fences_the_earlier_mid_overlap(
        spark: Any, case: KafkaCase) -> None:
    older = case.start("pause_in_overlap")
    with killed_at_end(older):
        case.wait_paused(older)
        wait_for(lambda: len(read_topic(case.bootstrap, case.out, "read_uncommitted")) > 0,
                 60, "the older run's first part in the log")
        # the older run loses its ledger connection (and the batch row lock) with its
        # Kafka transaction open mid-read: only the broker can stop it now
        assert cut_idle_ledger_transactions(case.dsn) >= 1
        newer = run_batch(spark, case.cfg, case.batch_id, case.dsn)
        assert newer.result.status == "committed"
        case.resume()  # the older run goes on producing its parts
        older.wait(timeout=300)
    out = case.output()
    # it commits nothing: fenced by the broker, its ledger connection gone
    assert "committed by another run while this one was working" in out, out[-3000:]
    assert case.status() == "committed"
    v = case.verdict()
    assert v.aborted_in_log > 0  # the older run's records: aborted by the fence
    assert v.in_log - v.aborted_in_log == RECORDS


def test_a_remainder_that_would_outlive_the_transaction_is_produced_in_a_new_one(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The read ends young (the overlap goes on) but what it left (here: the whole of
    partition 0, its first part staged last) takes past the transaction's timeout to
    produce: the broker would abort the transaction under it, and every retry with the same
    skew alike (a wedge). Past REMAINDER_SHARE the pass is aborted and the batch produced
    in a new transaction: committed once."""
    from offsetflow.sinks.kafka import sink as kafka_sink

    s = json_staging(pg_dsn, kafka_bootstrap, make_topic, unique,
                     producer={"transaction.timeout.ms": "4000"})
    by_part = {i: (sp["partition"], sp["from_offset"]) for i, sp in enumerate(s.specs)}
    first_of_p0 = next(i for i, v in by_part.items() if v == (0, 0))
    paused, resume = tmp_path / "paused", tmp_path / "resume"
    with s.committer() as committer:
        for i in by_part:
            if i != first_of_p0:
                assert s.stage(i) == 100
        wait_for(lambda: s.in_log() == 200, 60, "partition 1's parts to be produced")
        # the commit looks for staged parts no more until finish(): partition 0 is left
        # for after it
        committer.poll_s = 3600.0
        wait_for(lambda: committer.waiting_s == 3600.0, 60, "the commit's poll to stop")
        assert s.stage(first_of_p0) == 100
        monkeypatch.setenv(kafka_sink.FAULT_ENV, "pause_before_remainder")
        monkeypatch.setenv(kafka_sink.PAUSED_ENV, str(paused))
        monkeypatch.setenv(kafka_sink.RESUME_ENV, str(resume))
        out: list[Any] = []

        def finish() -> None:
            try:
                out.append(committer.finish(expected_parts=4))
            except BaseException as e:  # noqa: BLE001 - shown by the assertion below
                out.append(e)

        t = threading.Thread(target=finish)
        t.start()
        wait_for(paused.exists, 60, "the remainder's pause")
        sink = s.sink
        assert sink is not None
        # past the timeout and the broker's abort interval (5 s): the transaction is gone
        wait_for(lambda: time.monotonic() - sink._txn_began > 10.0,  # noqa: SLF001
                 30, "the broker to abort the overlap's transaction")
        resume.write_text("go")
        t.join(120)
    assert out and not isinstance(out[0], BaseException), "".join(
        traceback.format_exception(out[0]))
    assert out[0].status == "committed" and out[0].rows_written == 400
    v = s.verdict(400)
    assert v.aborted_in_log >= 200  # partition 1's copy of the given-up transaction
