"""Faults of the Kafka sink's task-file path (`sink.task_files`, issue 32) in the windows the
files open: a task's Python worker killed with its file complete but its part's marker not
committed, or with the marker committed but the task not returned; the broker killed while
the driver produces from the files. Each case ends with the output topic read with
read_committed (tests.tooling.topic_checker): 0 lost, 0 duplicated, nothing of an aborted
attempt visible; and no file of the batch left.

A task fault is the stage's test-only hook (`offsetflow.stage.part.TASK_FAULT_ENV`) in the
Python workers of this process's Spark session (PySpark hands `SparkContext.environment` to
them): the attempt SIGKILLs itself at the point, no job process of its own. The session's
`local[2]` retries no task, so the run fails and the next run is the retry. The broker fault
is the sink's fault point in a thin Spark Connect client's driver, as in
test_sink_kafka_faults.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from offsetflow.config import parse_pipeline
from offsetflow.job import run_batch
from offsetflow.sinks.kafka import KafkaTopicSink
from offsetflow.sinks.kafka.sink import FAULT_ENV
from offsetflow.stage.part import TASK_FAULT_ENV
from tests.tooling import chaos
from tests.tooling.kafka_case import RECORDS, KafkaCase, killed_at_end, make_case
from tests.tooling.kafka_staging import task_file_reads
from tests.tooling.topic_checker import read_topic


@pytest.fixture
def case(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
         tmp_path: Path) -> KafkaCase:
    """A planned batch of several parts per partition with `sink.task_files` set (in its
    pipeline file too, for a job run as a process)."""
    c = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                  spark={"max_offsets_per_task": 100})
    files = tmp_path / "task-files"
    files.mkdir()
    raw = yaml.safe_load(c.file.read_text())
    raw["sink"]["task_files"] = str(files)
    c.file.write_text(yaml.safe_dump(raw))
    c.cfg = parse_pipeline(raw, str(c.file), {})  # not in the fingerprint: same batch
    return c


def _files(case: KafkaCase) -> list[Path]:
    assert case.cfg.sink.kafka is not None and case.cfg.sink.kafka.task_files is not None
    return sorted(Path(case.cfg.sink.kafka.task_files).glob(f"*_b{case.batch_id}_*"))


@contextlib.contextmanager
def task_fault(spark: Any, fault: str) -> Iterator[None]:
    """TASK_FAULT_ENV for the Python workers of this process's Spark session."""
    env = spark.sparkContext.environment
    env[TASK_FAULT_ENV] = fault
    try:
        yield
    finally:
        env.pop(TASK_FAULT_ENV, None)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(part, path) of every task file the driver (this process) reads."""
    return task_file_reads(monkeypatch)


def _marker_files(dsn: str, batch_id: int) -> dict[int, list[str]]:
    """part -> the task files its committed marker names."""
    with contextlib.closing(psycopg2.connect(dsn)) as conn, conn.cursor() as cur:
        cur.execute("""SELECT part, data_files FROM offsetflow.staged_parts
                        WHERE batch_id = %s AND kind = 'rows'""", (batch_id,))
        return {int(p): [str(e["path"]) for e in (
            json.loads(d) if isinstance(d, str) else d or [])] for p, d in cur.fetchall()}


def _killed_attempt(spark: Any, case: KafkaCase, point: str) -> tuple[int, list[str]]:
    """The batch run with the first task attempt to reach `point` killed there: the run
    fails (no task retry in this session) with nothing visible. Its pid and files."""
    flag = case.dir / f"killed-{point}"
    with task_fault(spark, f"{point}:{flag}"), pytest.raises(Exception) as e:
        run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert flag.exists(), f"the fault never fired: {e.value!r}"
    pid, *paths = flag.read_text().splitlines()
    assert paths and all(Path(p).exists() for p in paths), paths  # complete, renamed
    assert "Python worker exited unexpectedly" in str(e.value) or "crashed" in str(
        e.value), repr(e.value)[:3000]
    assert case.status() != "committed"
    assert read_topic(case.bootstrap, case.out, "read_committed") == []
    return int(pid), paths


def test_a_task_killed_after_its_file_before_its_marker_the_rerun_never_reads_the_file(
        spark: Any, case: KafkaCase, reads: list[tuple[int, str]]) -> None:
    """kill -9 of a task's Python worker once its part's task file is complete under its
    final name, before the part's marker commits: the marker rolls back with its session,
    so no marker names that file; the rerun writes the part again in a file of its own,
    produces the batch once from the files the markers name (never the orphan), and the
    commit removes the orphan with the batch's files."""
    _, orphans = _killed_attempt(spark, case, "kill-before-marker")
    named = {p for paths in _marker_files(case.dsn, case.batch_id).values() for p in paths}
    assert not named & set(orphans), (named, orphans)
    rep = run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert rep.result.status == "committed", rep.result
    read = {p for _, p in reads}
    assert read and not read & set(orphans), (read, orphans)
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found == RECORDS, v
    assert _files(case) == [], "the orphaned attempt's file stays"


def test_a_task_killed_after_its_marker_committed_the_rerun_reads_that_attempts_file_once(
        spark: Any, case: KafkaCase, reads: list[tuple[int, str]]) -> None:
    """kill -9 of a task's Python worker right after its part's marker committed, before the
    task returned: the marker names the killed attempt's file, so the rerun's task of that
    part finds the marker and writes nothing; the driver produces that part from the
    killed attempt's file, once, and the batch once."""
    _, paths = _killed_attempt(spark, case, "kill-after-marker")
    markers = _marker_files(case.dsn, case.batch_id)
    part = next(p for p, named in markers.items() if named == paths)  # the marker names it
    rep = run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert rep.result.status == "committed", rep.result
    of_part = {p for q, p in reads if q == part}
    assert of_part == set(paths), (part, of_part, paths)  # no second attempt of the part
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found == RECORDS, v
    assert _files(case) == []


@pytest.mark.slow  # as its stage counterpart (test_sink_kafka_faults.py); serial
def test_broker_killed_while_the_driver_produces_from_task_files_the_batch_commits_once(
        spark: Any, case: KafkaCase, spark_connect_url: str) -> None:
    """The driver (a thin Spark Connect client) holds its transaction open after producing
    the first parts from their files during the read; every part's file is written; the
    broker is killed -9; the driver goes on producing the other parts from their files
    into the dead broker and commits once it is back (or its run fails and the next run
    settles it): the batch once, nothing of an aborted attempt visible, no file left."""
    proc = case.start("pause_in_overlap", spark_connect_url)
    with killed_at_end(proc):
        case.wait_paused(proc)
        chaos.wait_for(lambda: chaos.staged_rows(case.dsn, case.batch_id) == RECORDS
                       or proc.poll() is not None, 120, "every part's task file")
        assert proc.poll() is None, case.output()[-3000:]
        in_log: list[int] = []  # until the first parts' records are all delivered

        def settled() -> bool:
            in_log.append(len(read_topic(case.bootstrap, case.out, "read_uncommitted")))
            return in_log[-1] > 0 and in_log[-2:] == in_log[-1:] * 2

        chaos.wait_for(settled, 60, "the first parts' records in the log")
        assert in_log[-1] < RECORDS, in_log  # parts left to produce from their files
        assert read_topic(case.bootstrap, case.out, "read_committed") == []
        chaos.kill_kafka(restart=False)  # kill -9 of the broker, transaction open
        try:
            case.resume()  # the remaining parts produced from their files, no broker
            assert proc.poll() is None, case.output()[-3000:]
        finally:
            chaos.start_kafka()
        code = proc.wait(timeout=600)
    assert "Connection refused" in case.output()  # the driver met the dead broker
    if code != 0:  # the outcome was unknown to this run: the next one settles it
        rep = run_batch(spark, case.cfg, case.batch_id, case.dsn)
        assert rep.result.status in ("committed", "already_committed"), rep.result
    assert case.status() == "committed"
    v = case.verdict()
    assert v.visible == v.committed.found == RECORDS, v
    assert _files(case) == []


def _whole_batch_job(case: KafkaCase, fault: str, connect_url: str) -> Any:
    """The batch's job as a thin Spark Connect client with the overlap off
    (`KafkaTopicSink.overlap`, a class switch: set in the process before the CLI runs), so
    the batch is read whole after its tasks and committed by `WholeStage`, and with the
    sink's fault point `fault`."""
    boot = ("import sys; from offsetflow.sinks.kafka import KafkaTopicSink; "
            "KafkaTopicSink.overlap = False; from offsetflow.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    file = chaos.connect_file(case.file, connect_url)
    out = case.log.open("ab")
    return subprocess.Popen(
        [sys.executable, "-c", boot, "run-batch", "--pipeline-file", str(file),
         "--batch-id", str(case.batch_id)], stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OFFSETFLOW_SPARK_LOG_LEVEL": "ERROR", FAULT_ENV: fault})


def test_driver_killed_between_the_kafka_and_the_ledger_commit_of_a_batch_read_whole(
        spark: Any, case: KafkaCase, spark_connect_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch read whole after its tasks (the overlap off: `WholeStage` commits, the
    Kafka transaction produced from the files after the read; test_sink_kafka_task_files.py
    kills the part-wise commit): the driver killed right after the Kafka commit, before the
    ledger's. The files stay until the ledger commits; the rerun (read whole too) finds the
    batch in the topic, produces nothing again (not even an aborted copy), completes the
    ledger and drops the files."""
    proc = _whole_batch_job(case, "kill_after_commit", spark_connect_url)
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    out = case.output()
    assert "as their tasks stage them" not in out, out[-3000:]  # not part by part
    assert "Kafka transaction committed" in out, out[-3000:]
    assert case.status() != "committed"  # the ledger never heard of the Kafka commit
    assert len(read_topic(case.bootstrap, case.out, "read_committed")) == RECORDS
    assert _files(case)  # kept for the rerun (its left-out records' dead letters)
    monkeypatch.setattr(KafkaTopicSink, "overlap", False)
    rep = run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == RECORDS, rep.result
    v = case.verdict()
    assert v.in_log == RECORDS  # no second copy, not even an aborted one
    assert _files(case) == []
