"""Faults of the Kafka topic sink on the real broker: the job killed with its transaction
open, killed between the Kafka commit and the ledger's, two runs of a batch at once, and
the broker killed during the commit. Every case ends with the output topic read twice:
read_committed holds each source record exactly once (tests.tooling.topic_checker), and
read_uncommitted shows the aborted attempt's records where there was one, so the isolation
is what keeps them out, not an absence of faults.

The job runs as `offsetflow run-batch` in a process group of its own; the test-only fault
points of offsetflow.sinks.kafka.sink (FAULT_ENV) hold it with its transaction open, or SIGKILL
it right after the Kafka commit. Both are in the driver's commit, after every Spark task has
ended, so the job is a thin client of the warm Spark Connect server (no JVM of its own): a
kill of it is the driver's death the invariants are about."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.cli import main as cli
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import run_until_caught_up
from tests.tooling import chaos
from tests.tooling.kafka_case import (
    RECORDS,
    KafkaCase,
    cut_idle_ledger_transactions,
    delete_batch_records,
    killed_at_end,
    make_case,
    range_records,
)
from tests.tooling.topic_checker import read_topic


@pytest.fixture
def case(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
         tmp_path: Path) -> KafkaCase:
    return make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)


def test_killed_mid_produce_the_open_transaction_is_aborted_by_the_next_run(
        spark: Any, case: KafkaCase, spark_connect_url: str) -> None:
    proc = case.start("pause_before_commit", spark_connect_url)
    with killed_at_end(proc):
        case.wait_paused(proc)
        # every record is in the log, in a transaction that is still open
        assert len(read_topic(case.bootstrap, case.out, "read_uncommitted")) == RECORDS
        assert read_topic(case.bootstrap, case.out, "read_committed") == []
        chaos.kill(proc)  # kill -9 of the job and its JVM
    assert case.status() != "committed"
    # the next run's init_transactions fences the dead producer and aborts its transaction
    assert run_batch(spark, case.cfg, case.batch_id, case.dsn).result.status == "committed"
    v = case.verdict()
    assert v.aborted_in_log == RECORDS  # the killed attempt's records exist, aborted


@pytest.mark.slow
def test_killed_between_kafka_commit_and_ledger_commit_no_second_copy_nor_abandon(
        spark: Any, case: KafkaCase, caplog: pytest.LogCaptureFixture,
        spark_connect_url: str) -> None:
    """The driver dies between the Kafka commit and the ledger's. The re-run writes no
    second copy. Review s23 H1: before it, an operator abandons the batch (or a
    config-drift error advised it); abandoning would plan the same ranges again and write
    them a second time: it is refused, and the re-run completes it. (One killed job for
    both: they reached this state alike, each with a job process of its own.)"""
    proc = case.start("kill_after_commit", spark_connect_url)
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    assert case.status() != "committed"  # the ledger never heard of the Kafka commit
    assert len(read_topic(case.bootstrap, case.out, "read_committed")) == RECORDS
    rc = cli(["--dsn", case.dsn, "abandon", "--pipeline-file", str(case.file), "--batch-id",
              str(case.batch_id), "--reason", "operator thinks it is dead"])
    assert rc != 0  # refused: not abandoned
    assert case.status() != "abandoned"
    logging.getLogger().addHandler(caplog.handler)  # the CLI's setup_logging replaced them
    with caplog.at_level("INFO", logger="offsetflow"):
        rep = run_batch(spark, case.cfg, case.batch_id, case.dsn)  # what the error says to do
    assert rep.result.status == "committed" and rep.result.rows_written == RECORDS
    assert case.status() == "committed"
    assert "nothing is produced again" in caplog.text
    run_until_caught_up(case.cfg, case.dsn, spark)
    v = case.verdict()
    assert v.in_log == RECORDS  # no second copy, not even an aborted one


def test_two_runs_at_once_the_older_is_fenced_by_the_broker(
        spark: Any, case: KafkaCase, spark_connect_url: str) -> None:
    older = case.start("pause_before_commit", spark_connect_url)
    with killed_at_end(older):
        case.wait_paused(older)
        # the older run loses its ledger connection (and the batch row lock) while its
        # Kafka transaction stays open: only the broker can stop it now
        assert cut_idle_ledger_transactions(case.dsn) >= 1
        newer = run_batch(spark, case.cfg, case.batch_id, case.dsn)
        assert newer.result.status == "committed"
        case.resume()  # the older run goes on to commit its transaction
        older.wait(timeout=300)
    out = case.output()
    assert re.search(r"commit_transaction failed \(.*\); this run was fenced", out), \
        out[-3000:]
    assert case.status() == "committed"
    v = case.verdict()
    assert v.aborted_in_log == RECORDS  # the older run's records: aborted by the fence


@pytest.mark.slow
def test_broker_killed_during_the_commit_the_batch_commits_once(
        spark: Any, case: KafkaCase, spark_connect_url: str) -> None:
    proc = case.start("pause_before_commit", spark_connect_url)
    with killed_at_end(proc):
        case.wait_paused(proc)
        chaos.kill_kafka(restart=False)  # kill -9 of the broker, transaction open
        try:
            case.resume()  # commit_transaction runs against a dead broker
            # the job's Kafka client retries against it: a connection from the job's process
            chaos.wait_for_reconnect(case.bootstrap, proc.pid,
                                     unless=lambda: proc.poll() is not None)
            assert proc.poll() is None, case.output()[-3000:]  # still waiting for it
        finally:
            chaos.start_kafka()
        code = proc.wait(timeout=600)
    if code != 0:  # the outcome was unknown to this run: the next one settles it
        assert "commit_transaction" in case.output() or "Kafka" in case.output()
        assert run_batch(spark, case.cfg, case.batch_id, case.dsn).result.status in (
            "committed", "already_committed")
    assert case.status() == "committed"
    case.verdict()


@pytest.mark.slow
def test_a_transaction_outlasting_its_timeout_says_so_not_fenced(
        spark: Any, case: KafkaCase, spark_connect_url: str) -> None:
    """The broker aborts a transaction open longer than transaction.timeout.ms and bumps the
    epoch, which the producer sees as a fence: the error must name the timeout (the next
    attempt of a batch that big times out the same way), not a newer run that took over."""
    raw = yaml.safe_load(case.file.read_text())
    raw["sink"]["producer"] = {"transaction.timeout.ms": "5000"}
    case.file.write_text(yaml.safe_dump(raw))
    proc = case.start("pause_before_commit", spark_connect_url)
    with killed_at_end(proc):
        case.wait_paused(proc)
        open_ends = case.high_watermarks()
        # the timeout, then the coordinator's sweep for timed-out transactions (every 10 s)
        case.wait_aborted_by_the_broker(open_ends, 120)
        case.resume()
        assert proc.wait(timeout=300) != 0
    out = case.output()
    assert "transaction.timeout.ms" in out and "5000" in out, out[-3000:]
    assert "a newer run of the batch took over" not in out, out[-3000:]
    assert case.status() != "committed"
    assert run_batch(spark, case.cfg, case.batch_id, case.dsn).result.status == "committed"
    v = case.verdict()
    # the timed-out attempt's records: aborted (and, when its read outlasted half the
    # timeout, what it produced during the read, given up then: invariant 38)
    assert v.aborted_in_log >= RECORDS


@pytest.mark.slow
def test_batch_the_topic_holds_whose_stage_and_records_are_gone_is_completed_from_the_sink(
        spark: Any, case: KafkaCase, spark_connect_url: str) -> None:
    """Review of the abandon guard: killed after the Kafka commit, then PostgreSQL crashed
    (the unlogged stage and markers are emptied) and retention deleted the source records.
    A re-run cannot re-stage (the records are gone), abandoning is refused (the topic holds
    the batch): without `offsetflow complete` the pipeline is wedged for good. It completes
    the ledger from the sink's record and writes nothing again."""
    proc = case.start("kill_after_commit", spark_connect_url)
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    chaos.crash_postgres()  # empties the unlogged stage and its markers
    delete_batch_records(case.bootstrap, case.dsn, case.batch_id)
    with pytest.raises(Exception, match=r"data loss on "):  # the re-run cannot read it again
        run_batch(spark, case.cfg, case.batch_id, case.dsn)
    abandon = ["--dsn", case.dsn, "abandon", "--pipeline-file", str(case.file),
               "--batch-id", str(case.batch_id), "--reason", "records gone"]
    assert cli(abandon) != 0 and case.status() != "abandoned"  # the topic holds it
    complete = ["--dsn", case.dsn, "complete", "--pipeline-file", str(case.file),
                "--batch-id", str(case.batch_id), "--reason", "stage and records gone"]
    assert cli(complete) == 0
    assert case.status() == "committed"
    with Ledger(case.dsn) as ledger:
        assert ledger.positions(case.name) == {
            (r.topic, r.partition): r.until_offset
            for r in ledger.get_batch(case.batch_id).ranges}
        batch = ledger.get_batch(case.batch_id)
        assert "stage and records gone" in (batch.error or "")
        # what the topic holds (review s24-complete LOW: 0 rows, 0 records read before)
        assert (batch.rows_written, batch.records_read, batch.bad_records) == (
            RECORDS, RECORDS, 0)
        assert sum(range_records(case.dsn, case.batch_id).values()) == RECORDS
    assert cli(complete) == 0  # again: already committed, nothing changes
    v = case.verdict()
    assert v.in_log == RECORDS  # nothing produced a second time


def test_complete_refuses_a_batch_the_topic_does_not_hold(case: KafkaCase) -> None:
    """`complete` never writes: a batch its sink does not hold is refused and stays open."""
    assert cli(["--dsn", case.dsn, "complete", "--pipeline-file", str(case.file),
                "--batch-id", str(case.batch_id), "--reason", "x"]) == 2
    assert case.status() == "planned"
    assert read_topic(case.bootstrap, case.out, "read_uncommitted") == []


@pytest.mark.slow
def test_complete_refuses_while_kafka_still_holds_the_batchs_records(
        spark: Any, case: KafkaCase, spark_connect_url: str) -> None:
    """Review s24-complete M1: completing from the sink while a re-run could still read the
    batch would drop the dead letters that re-run routes: refused, and the re-run completes it."""
    proc = case.start("kill_after_commit", spark_connect_url)
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    chaos.crash_postgres()  # the stage is gone, the records are still in Kafka
    assert cli(["--dsn", case.dsn, "complete", "--pipeline-file", str(case.file),
                "--batch-id", str(case.batch_id), "--reason", "x"]) == 2
    assert case.status() != "committed"
    rep = run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == RECORDS
    assert case.verdict().in_log == RECORDS
