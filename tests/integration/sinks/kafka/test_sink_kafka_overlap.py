"""The Kafka topic sink producing each stage part into the batch's transaction while later
parts are still read (`KafkaTopicSink.begin_parts`/`take_parts` under
`offsetflow.commit.PartwiseCommit`), on the real broker and PostgreSQL.

Most cases are driven without Spark, as `tests/integration/commit/test_sink.py` drives the
PostgreSQL part-wise commit: each part is read and staged by the code a Spark task runs, so
the test decides when a part becomes staged relative to what the commit produces. The
driver killed mid-overlap and two runs of one batch at once run `offsetflow run-batch` as a
process (`KafkaCase`), held by the test-only fault point `pause_in_overlap` (some parts
produced, the transaction open, the read going on). Every case ends with the output topic
read read_committed (tests.tooling.topic_checker): each source record once, none lost, and
the aborted copies that read_uncommitted shows kept out."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from offsetflow.commit import CommitSpec, PartwiseCommit, create_stage_tables, ensure_dead_letter
from offsetflow.config import parse_pipeline
from offsetflow.job import run_batch
from offsetflow.job.tasks import ReadContext, read_subrange, stage_columns
from offsetflow.ledger import Batch, Ledger, stage_part_table
from offsetflow.ops import plan_only
from offsetflow.ranges import split_ranges
from offsetflow.sinks import sink_for
from offsetflow.sinks.kafka import KafkaTopicSink
from offsetflow.stage import TaskClock, binary_encoder, stage_generation, stage_rows
from tests.tooling import chaos
from tests.tooling.chaos import SCHEMA, Workload
from tests.tooling.kafka_case import RECORDS, KafkaCase, killed_at_end, make_case
from tests.tooling.topic_checker import TopicVerdict, check_topic, read_topic


class KafkaStaging:
    """One planned batch of `records` JSON records on a 2-partition source into a fresh
    output topic, split into parts of `split` offsets, its stage created as a run creates
    it; `stage(i)` does what the Spark task of part i does."""

    def __init__(self, dsn: str, bootstrap: str, make_topic: Any, unique: str, *,
                 records: int = 400, split: int = 100,
                 producer: dict[str, str] | None = None) -> None:
        self.dsn = dsn
        self.bootstrap = bootstrap
        src = make_topic("ov-src", 2)
        self.out = make_topic("ov-out", 2)
        self.workload = Workload(bootstrap, src, 2, f"ov{unique}")
        self.workload.plain(records)
        self.name = f"ov_{unique}"
        raw: dict[str, Any] = {
            "name": self.name, "kafka": {"bootstrap_servers": bootstrap},
            "source": {"topics": [src], "starting": "earliest"},
            "format": {"type": "json", "schema": dict(SCHEMA)},
            "sink": {"type": "kafka", "connection": dsn, "topic": self.out,
                     "key_column": "event_id", "producer": producer or {}},
            "spark": {"master": "local[2]", "max_offsets_per_task": split}}
        self.cfg = parse_pipeline(raw, f"<test {self.name}>", {})
        planned = plan_only(self.cfg, dsn)
        assert planned.batch is not None
        self.batch: Batch = planned.batch
        with Ledger(dsn) as ledger:
            self.generation = stage_generation(ledger, self.batch, split)
        self.specs = [r.to_dict() for r in split_ranges(self.batch.ranges, split)]
        self.columns = stage_columns(self.cfg)
        create_stage_tables(dsn, self.batch.batch_id, self.columns, parts=len(self.specs))
        self.timings: dict[str, float] = {}
        self.sink: KafkaTopicSink | None = None

    def stage(self, part: int, fail_after_rows: int | None = None) -> int:
        """Part `part` staged as its task does (an attempt that fails after
        `fail_after_rows` rows: its transaction, marker and rows roll back). Returns the
        rows it staged (0: staged by an earlier attempt)."""
        rc = ReadContext.of(self.cfg, self.batch.batch_id, self.dsn, self.specs,
                            self.generation)
        clock = TaskClock()
        rows: Iterator[Any] = read_subrange(rc, part, clock)
        if fail_after_rows is not None:
            rows = _failing(rows, fail_after_rows)
        stats = stage_rows(self.dsn, self.batch.batch_id, part, rows, clock,
                           binary_encoder([t for _, t in self.columns]),
                           table=stage_part_table(self.batch.batch_id, part),
                           generation=self.generation)
        return 0 if stats.get("skipped") else int(stats["rows"])

    def committer(self) -> PartwiseCommit:
        """The commit a run starts before its tasks (`job.driver`), the sink its step 4."""
        dead = self.cfg.dead_letter_table
        if dead is not None:  # as the run creates it before the read
            with Ledger(self.dsn) as ledger, ledger.transaction() as cur:
                ensure_dead_letter(cur, dead)
        spec = CommitSpec(columns=tuple(c for c, _ in self.columns), dead_letter_table=dead,
                          bad_records_staged=dead is not None,
                          config_fingerprint=self.batch.config_fingerprint,
                          stage_generation=self.generation, subrange_parts=True)
        sink = sink_for(self.cfg).external(self.dsn, self.columns, spec)
        assert isinstance(sink, KafkaTopicSink)
        self.sink = sink
        return PartwiseCommit(self.dsn, self.batch, columns=spec.columns,
                              parts=len(self.specs), dead_letter_table=dead,
                              timings=self.timings,
                              spec=dataclasses.replace(spec, external=sink))

    def in_log(self) -> int:
        return len(read_topic(self.bootstrap, self.out, "read_uncommitted"))

    def visible(self) -> int:
        return len(read_topic(self.bootstrap, self.out, "read_committed"))

    def verdict(self, expected: int) -> TopicVerdict:
        with Ledger(self.dsn) as ledger:
            positions = ledger.positions(self.name)
        v = check_topic(self.bootstrap, self.out, self.workload.produced.values(), positions)
        assert v.committed.ok, v.committed.explain()
        assert v.committed.found == v.committed.expected == expected
        assert v.batches == {self.batch.batch_id}
        return v


def _failing(rows: Iterator[Any], after: int) -> Iterator[Any]:
    seen = 0
    for b in rows:
        yield b
        seen += b.num_rows
        if seen >= after:
            raise RuntimeError(f"test: this task attempt fails after {seen} rows")


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def staging(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> KafkaStaging:
    return KafkaStaging(pg_dsn, kafka_bootstrap, make_topic, unique)


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
        wait_until(lambda: s.in_log() == 200, "partition 1's parts to be produced")
        got = read_topic(s.bootstrap, s.out, "read_uncommitted")
        sources = {(r.headers["offsetflow.source"] or b"").decode() for r in got}
        assert {src.split("/")[1] for src in sources} == {"1"}
        assert s.visible() == 0  # in the open transaction only
        assert s.stage(first_of_p0) == 100  # now both of partition 0 go, in order
        wait_until(lambda: s.in_log() == 400, "partition 0's parts to be produced")
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
        wait_until(lambda: s.in_log() == 100, "part 0 to be produced")
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
    s = KafkaStaging(pg_dsn, kafka_bootstrap, make_topic, unique,
                     producer={"transaction.timeout.ms": "4000"})
    with s.committer() as committer:
        assert s.stage(0) == 100
        wait_until(lambda: s.in_log() == 100, "part 0 to be produced")
        sink = s.sink
        assert sink is not None
        # the read goes on (parts 1-3 unstaged) until the overlap gives its transaction up
        wait_until(lambda: "kafka_overlap_given_up_s" in sink.phases,
                   "the overlap to give up its transaction", timeout_s=30)
        for i in (1, 2, 3):
            assert s.stage(i) == 100
        result = committer.finish(expected_parts=4)
    assert result.status == "committed" and result.rows_written == 400
    v = s.verdict(400)
    assert v.aborted_in_log == 100  # part 0's copy of the given-up transaction


def test_a_record_refused_during_the_read_is_left_out_by_the_next_pass(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A record the broker refuses for itself (over the topic's max.message.bytes even
    compressed) in a part produced during the read: that pass is aborted after the read,
    the record found and sent to the dead-letter table, and the batch produced again
    without it; read_committed holds every other record once."""
    from offsetflow.errors import KafkaSinkError  # noqa: F401 - the failing variant's error
    from tests.integration.sinks.kafka.test_sink_kafka_topic_settings import produce

    src = make_topic("ovr-src", 2)
    out = make_topic("ovr-out", 2, {"max.message.bytes": "2000"})
    small = [(i % 2, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(60)]
    coords = produce(kafka_bootstrap, src, [*small[:10], (1, b"noise", os.urandom(3000), 0),
                                            *small[10:]])
    noise = coords[10]
    name = f"ovr_{unique}"
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
    noisy = next(i for i, sp in enumerate(s.specs)
                 if sp["partition"] == noise[0] and sp["from_offset"] <= noise[1]
                 < sp["until_offset"])
    with s.committer() as committer:
        for i in range(len(s.specs)):
            if i != len(s.specs) - 1 or i == noisy:
                s.stage(i)
        sink = s.sink
        assert sink is not None
        # the refusal arrives while the read goes on (the last part unstaged)
        wait_until(lambda: "kafka_overlap_stopped_s" in sink.phases,
                   "the refusal to stop the overlap")
        s.stage(len(s.specs) - 1)
        result = committer.finish(expected_parts=len(s.specs))
    assert (result.status, result.rows_written, result.bad_records) == ("committed", 60, 1)
    committed = read_topic(kafka_bootstrap, out, "read_committed")
    assert sorted(r.value or b"" for r in committed) == sorted(v for _, _, v, _ in small)
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) > 60  # aborted pass
    dead = chaos.dead_letters(pg_dsn, f"{name}_dead", name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(src, *noise)]


def _staging_for(cfg: Any, batch: Batch, dsn: str, bootstrap: str, out: str,
                 split: int) -> KafkaStaging:
    """A `KafkaStaging` over a batch planned elsewhere (its own records and config)."""
    s = KafkaStaging.__new__(KafkaStaging)
    s.dsn, s.bootstrap, s.out, s.name, s.cfg, s.batch = dsn, bootstrap, out, cfg.name, cfg, batch
    with Ledger(dsn) as ledger:
        s.generation = stage_generation(ledger, batch, split)
    s.specs = [r.to_dict() for r in split_ranges(batch.ranges, split)]
    s.columns = stage_columns(cfg)
    create_stage_tables(dsn, batch.batch_id, s.columns, parts=len(s.specs))
    s.timings = {}
    s.sink = None
    return s


# -- the job as a process ---------------------------------------------------------------


@pytest.fixture
def case(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
         tmp_path: Path) -> KafkaCase:
    c = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                  spark={"max_offsets_per_task": 100})
    raw = yaml.safe_load(c.file.read_text())
    assert raw["spark"]["max_offsets_per_task"] == 100  # several parts per partition
    return c


def _cut_idle_ledger_transactions(dsn: str) -> int:
    """pg_terminate_backend of every OffsetFlow connection idle inside a transaction: the
    held job's commit, whose batch row lock then goes with it."""
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn, conn.cursor() as cur:
            cur.execute("""SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                            WHERE application_name = 'offsetflow'
                              AND state = 'idle in transaction'
                              AND datname = current_database()""")
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def test_driver_killed_mid_overlap_the_retry_commits_once(spark: Any, case: KafkaCase) -> None:
    proc = case.start("pause_in_overlap")
    with killed_at_end(proc):
        case.wait_paused(proc)
        # some parts produced into the open transaction while the read goes on
        wait_until(lambda: len(read_topic(case.bootstrap, case.out, "read_uncommitted")) > 0,
                   "the first part's records in the log")
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
        wait_until(lambda: len(read_topic(case.bootstrap, case.out, "read_uncommitted")) > 0,
                   "the older run's first part in the log")
        # the older run loses its ledger connection (and the batch row lock) with its
        # Kafka transaction open mid-read: only the broker can stop it now
        assert _cut_idle_ledger_transactions(case.dsn) >= 1
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


class _RecordingEvent(threading.Event):
    """The commit thread's finish event, remembering the longest wait it was asked for."""
    longest = 0.0

    def wait(self, timeout: float | None = None) -> bool:
        self.longest = max(self.longest, timeout or 0.0)
        return super().wait(timeout)


def test_a_remainder_that_would_outlive_the_transaction_is_produced_in_a_new_one(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The read ends young (the overlap goes on) but what it left (here: the whole of
    partition 0, its first part staged last) takes past the transaction's timeout to
    produce: the broker would abort the transaction under it, and every retry with the same
    skew alike (a wedge). Past REMAINDER_SHARE the pass is aborted and the batch produced
    in a new transaction: committed once."""
    from offsetflow.sinks.kafka import sink as kafka_sink

    s = KafkaStaging(pg_dsn, kafka_bootstrap, make_topic, unique,
                     producer={"transaction.timeout.ms": "4000"})
    by_part = {i: (sp["partition"], sp["from_offset"]) for i, sp in enumerate(s.specs)}
    first_of_p0 = next(i for i, v in by_part.items() if v == (0, 0))
    paused, resume = tmp_path / "paused", tmp_path / "resume"
    with s.committer() as committer:
        for i in by_part:
            if i != first_of_p0:
                assert s.stage(i) == 100
        wait_until(lambda: s.in_log() == 200, "partition 1's parts to be produced")
        # the commit thread polls no more until finish(): partition 0 is left for after it
        event = _RecordingEvent()
        committer._finish, committer.POLL_S = event, 3600.0  # noqa: SLF001 - test hook
        wait_until(lambda: event.longest == 3600.0, "the commit's poll to stop")
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
        wait_until(paused.exists, "the remainder's pause")
        sink = s.sink
        assert sink is not None
        # past the timeout and the broker's abort interval (5 s): the transaction is gone
        wait_until(lambda: time.monotonic() - sink._txn_began > 10.0,  # noqa: SLF001
                   "the broker to abort the overlap's transaction", timeout_s=30)
        resume.write_text("go")
        t.join(120)
    assert out and not isinstance(out[0], BaseException), "".join(
        traceback.format_exception(out[0]))
    assert out[0].status == "committed" and out[0].rows_written == 400
    v = s.verdict(400)
    assert v.aborted_in_log >= 200  # partition 1's copy of the given-up transaction
