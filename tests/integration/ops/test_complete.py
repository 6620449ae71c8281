"""`offsetflow complete` on the real broker and PostgreSQL, in the states the review of its
first version found wedged (review s24-complete H1, H2): the job SIGKILLed right after the
Kafka commit, PostgreSQL crashed (`pg_ctl -m immediate` empties the unlogged stage and its
markers), and retention deleted some of the batch's source records. A re-run cannot finish
the batch, abandoning it is refused (the topic holds it): complete must take it from the
topic's record, once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka import TopicPartition as KTP
from confluent_kafka.admin import AdminClient

from offsetflow.cli import main as cli
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ranges import split_ranges
from tests.tooling import chaos
from tests.tooling.chaos import dead_letters
from tests.tooling.iceberg_case import IcebergCase
from tests.tooling.iceberg_rows import iceberg_sink_rows, snapshot_batches
from tests.tooling.kafka_case import (
    RECORDS,
    KafkaCase,
    delete_batch_records,
    killed_at_end,
    make_case,
    range_records,
)
from tests.tooling.kafka_topics import recreate
from tests.tooling.topic_checker import read_topic

SPLIT = 40  # offsets per sub-range: each partition's range is split into several parts


def _killed_after_the_kafka_commit_then_pg_crashed(case: KafkaCase) -> None:
    proc = case.start("kill_after_commit")
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    chaos.crash_postgres()  # empties the unlogged stage and its markers


def _complete(case: KafkaCase) -> int:
    return cli(["--dsn", case.dsn, "complete", "--pipeline-file", str(case.file),
                "--batch-id", str(case.batch_id), "--reason", "records gone"])


def _staged_parts(dsn: str, batch_id: int) -> int:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s",
                    (batch_id,))
        row = cur.fetchone()
    conn.close()
    return int(row[0]) if row else 0


@pytest.mark.slow
def test_complete_takes_a_partly_restaged_batch_a_rerun_cannot_finish(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path) -> None:
    """H1: retention deletes from the start, so a large batch usually loses its first
    sub-range only. The re-run stages the parts it can still read and fails on that one;
    those parts stay, and complete refused while any part was staged ("Run it again"),
    which fails the same way: wedged. A re-run cannot finish it, so the topic's record
    is the truth: complete drops the partial stage and commits the batch once."""
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"max_offsets_per_task": SPLIT})
    _killed_after_the_kafka_commit_then_pg_crashed(case)
    with Ledger(case.dsn) as ledger:
        batch = ledger.get_batch(case.batch_id)
    subs = split_ranges(batch.ranges, SPLIT)
    assert len(subs) >= 4
    # the last partition's first sub-range: the tasks of the other sub-ranges, scheduled
    # before it, stage their parts while it fails
    first = [s for s in subs if s.topic_partition == subs[-1].topic_partition][0]
    admin = AdminClient({"bootstrap.servers": case.bootstrap})
    for f in admin.delete_records([KTP(first.topic, first.partition,
                                       first.until_offset)]).values():
        f.result(30)
    with pytest.raises(Exception, match=r"data loss on "):
        run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert _staged_parts(case.dsn, case.batch_id) > 0  # the parts it could read stayed
    assert _complete(case) == 0
    assert case.status() == "committed"
    assert _staged_parts(case.dsn, case.batch_id) == 0  # the partial stage was dropped
    with Ledger(case.dsn) as ledger:
        done = ledger.get_batch(case.batch_id)
        assert ledger.positions(case.name) == {
            (r.topic, r.partition): r.until_offset for r in done.ranges}
    # the topic's counts, not the partial stage's
    assert (done.rows_written, done.records_read) == (RECORDS, RECORDS)
    assert sum(range_records(case.dsn, case.batch_id).values()) == RECORDS
    assert _complete(case) == 0  # again: already committed, nothing changes
    assert case.verdict().in_log == RECORDS  # nothing produced a second time


def _big_record(bootstrap: str, found: list[tuple[int, int]]) -> Any:
    """A valid record whose key and value are over the output topic's limit."""

    def produce(src: str) -> None:
        event_id = "big-" + "x" * 150_000
        value = json.dumps({"event_id": event_id, "seq": 1, "amount": 1.0,
                            "checksum": "x"}).encode()
        p = Producer({"bootstrap.servers": bootstrap})

        def delivered(err: Any, msg: Any) -> None:
            assert err is None, err
            found.append((msg.partition(), msg.offset()))

        p.produce(src, value, event_id.encode(), partition=0, on_delivery=delivered)
        assert p.flush(30) == 0

    return produce


@pytest.mark.slow
def test_complete_routes_the_records_the_kafka_transaction_left_out(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path) -> None:
    """H2: the transaction left one record out (over the output topic's max.message.bytes,
    bad_records: dead_letter) and named it in its offset metadata. complete joined it with
    the stage the crash emptied and failed with StagedRowsLostError ("dropped ... re-stages
    them"), leaving the batch wedged. Its coordinates and size are in the metadata: they
    reach the dead-letter table, saying the value is gone."""
    big: list[tuple[int, int]] = []
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     dead_letter=True, out_config={"max.message.bytes": "200000"},
                     before_plan=_big_record(kafka_bootstrap, big))
    _killed_after_the_kafka_commit_then_pg_crashed(case)
    assert len(read_topic(case.bootstrap, case.out, "read_committed")) == RECORDS
    delete_batch_records(case.bootstrap, case.dsn, case.batch_id)
    assert _complete(case) == 0
    with Ledger(case.dsn) as ledger:
        done = ledger.get_batch(case.batch_id)
    assert done.status == "committed"
    assert (done.rows_written, done.bad_records, done.records_read) == (RECORDS, 1,
                                                                        RECORDS + 1)
    dead = dead_letters(case.dsn, f"{case.name}_dead", case.name)
    assert [(d.topic, d.partition, d.offset) for d in dead] == [(case.src, *big[0])]
    assert case.out in dead[0].error and "gone" in dead[0].error, dead[0].error
    assert "bytes" in dead[0].error  # its size, as the metadata recorded it
    assert len(read_topic(case.bootstrap, case.out, "read_committed")) == RECORDS


@pytest.mark.slow
def test_complete_records_the_iceberg_snapshots_counts(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, spark_connect_url: str) -> None:
    """Review s24-complete LOW: completed from an Iceberg snapshot, the batch recorded 0 bad
    records (and 0 records read) although the snapshot's summary holds its dead-letter
    count; status, metrics and Asset events then show a batch without its tombstones."""
    case = IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, make_topic("ice", 2), 2, unique)
    case.workload.tombstones(40)  # routed to the dead-letter table: the summary counts them
    bid = case.planned_batch(3000, seed=23)
    # killed in its commit, after the tasks: a thin Spark Connect client (no JVM of its own)
    proc = case.job_with(bid, spark_connect_url, OFFSETFLOW_ICEBERG_FAULT="after-commit")
    assert proc.wait(timeout=600) != 0, case.job_output()[-3000:]
    assert snapshot_batches(case.cfg, case.dsn) == [bid]  # Iceberg committed it, the ledger not
    chaos.crash_postgres()
    delete_batch_records(kafka_bootstrap, pg_dsn, bid)
    assert cli(["--dsn", pg_dsn, "complete", "--pipeline-file", str(case.file),
                "--batch-id", str(bid), "--reason", "records gone"]) == 0
    done = case.batch(bid)
    rows = len(iceberg_sink_rows(case.cfg, case.dsn))
    assert done.status == "committed" and rows > 0
    assert (done.rows_written, done.bad_records, done.records_read) == (rows, 40, rows + 40)
    assert snapshot_batches(case.cfg, case.dsn) == [bid]  # nothing appended again


@pytest.mark.slow
def test_complete_takes_an_iceberg_batch_whose_source_topic_was_recreated(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, spark_connect_url: str) -> None:
    """Review s25-complete2 H1: the source topic deleted and recreated after Iceberg's
    commit. Its new incarnation starts at offset 0, so complete saw no offset gone ("Kafka
    still holds all of its records: run it again"), a run refuses the recreated topic
    ("abandon it") and abandon is refused (the table holds the batch): each pointed at
    another that refused. The batch's records are gone for good: complete takes it. (A
    Kafka sink is not wedged this way: deleting the topic deletes its group offsets, the
    sink's record, so abandon is allowed.)"""

    topic = make_topic("ice", 2)
    case = IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)
    bid = case.planned_batch(1000, seed=29)
    # killed in its commit, after the tasks: a thin Spark Connect client (no JVM of its own)
    proc = case.job_with(bid, spark_connect_url, OFFSETFLOW_ICEBERG_FAULT="after-commit")
    assert proc.wait(timeout=600) != 0, case.job_output()[-3000:]
    chaos.crash_postgres()
    recreate(kafka_bootstrap, topic, 2)
    assert cli(["--dsn", pg_dsn, "complete", "--pipeline-file", str(case.file),
                "--batch-id", str(bid), "--reason", "topic recreated"]) == 0
    done = case.batch(bid)
    assert done.status == "committed" and "deleted and recreated" in (done.error or "")
    assert done.rows_written == len(iceberg_sink_rows(case.cfg, case.dsn)) > 0
    assert snapshot_batches(case.cfg, case.dsn) == [bid]  # nothing appended again


def _bad_record(bootstrap: str) -> Any:
    def produce(src: str) -> None:
        p = Producer({"bootstrap.servers": bootstrap})
        p.produce(src, b"{not json", b"bad-key", partition=0)
        assert p.flush(30) == 0

    return produce


@pytest.mark.slow
def test_complete_refuses_after_a_split_change_and_the_restored_split_finishes_the_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Review s25-complete2 M1: the run killed after the Kafka commit, before the ledger's,
    with every part staged; then retention deleted the batch's records. A re-run finishes it
    from the intact stage (with the dead letters it holds, values and all). Once the
    config's spark.max_offsets_per_task changed, complete judged the gone offsets under the
    new split, found no part of it holding them, and took the batch from the sink, dropping
    the stage and its dead letters. It must refuse and name the split to restore (a run
    under the new split would drop the stage too); restored, a run commits the batch once."""
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"max_offsets_per_task": SPLIT}, dead_letter=True,
                     before_plan=_bad_record(kafka_bootstrap))
    proc = case.start("kill_after_commit")
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    parts = _staged_parts(case.dsn, case.batch_id)
    assert parts > 0  # the stage is intact: a run can finish the batch from it
    delete_batch_records(case.bootstrap, case.dsn, case.batch_id)

    changed = tmp_path / "changed"
    changed.mkdir()
    raw = yaml.safe_load(case.file.read_text())
    raw["spark"]["max_offsets_per_task"] = SPLIT * 3
    (changed / case.file.name).write_text(yaml.safe_dump(raw))
    capsys.readouterr()

    def complete(pipeline_file: Path) -> tuple[int, str]:
        rc = cli(["--dsn", case.dsn, "complete", "--pipeline-file", str(pipeline_file),
                  "--batch-id", str(case.batch_id), "--reason", "records gone"])
        return rc, capsys.readouterr().err

    rc, err = complete(changed / case.file.name)
    assert rc == 2, err
    assert f"restored to {SPLIT}" in err and f"a run under {SPLIT * 3} drops" in err, err
    assert case.status() != "committed"
    assert _staged_parts(case.dsn, case.batch_id) == parts  # nothing dropped
    rc, err = complete(case.file)  # restored: a run finishes it, so complete still refuses
    assert rc == 2 and "Run it again" in err and "restored" not in err, err

    rep = run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert rep.result.status == "committed", rep
    with Ledger(case.dsn) as ledger:
        done = ledger.get_batch(case.batch_id)
    assert (done.rows_written, done.bad_records) == (RECORDS, 1)
    with psycopg2.connect(case.dsn) as conn, conn.cursor() as cur:
        cur.execute(f'SELECT value FROM "{case.name}_dead" WHERE pipeline = %s', (case.name,))
        values = [bytes(v) for v, in cur.fetchall()]
    conn.close()
    assert values == [b"{not json"]  # routed with its value, from the stage
    assert case.verdict().in_log == RECORDS  # nothing produced a second time
    assert complete(case.file)[0] == 0  # already committed: nothing changes
