"""The Apache Iceberg sink (issue 17) on the real services: a SQL catalog in the stack's
PostgreSQL, a file warehouse, Spark local[2]. Faults break the commit at each step; the
checker reads the table back with a pyiceberg scan: 0 lost, 0 duplicated."""

from __future__ import annotations

import os
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest

from offsetflow.cli import main as cli
from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.config import snapshot_summary
from offsetflow.config.iceberg_sink import BatchIdentityError, sqlalchemy_url
from offsetflow.errors import BatchStateError, RequestError, SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import (
    kafka_for,
    plan_only,
    plan_window,
    run_until_caught_up,
    submit_window,
)
from offsetflow.plan import parse_request
from offsetflow.sinks.iceberg.commit import FAULT_ENV, commit_snapshot, find_batch
from offsetflow.sinks.iceberg.files import referenced_files, remove_orphan_files
from offsetflow.sinks.iceberg.maint import ORPHAN_GRACE_S, main
from offsetflow.sinks.iceberg.sink import load_catalog
from tests.tooling import chaos
from tests.tooling.iceberg_case import IcebergCase, window
from tests.tooling.iceberg_rows import iceberg_sink_rows, iceberg_table, snapshot_batches


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> IcebergCase:
    topic = make_topic("ice", 2)
    return IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)


def test_batches_land_once_each_in_one_snapshot_with_the_batch_id(case: IcebergCase,
                                                                  spark: Any) -> None:
    case.workload.mixed(1500, random.Random(21))  # two parts per partition
    results = run_until_caught_up(case.cfg, case.dsn, spark)
    committed = [r.report.batch_id for r in results if r.report is not None]
    assert committed, "nothing was planned"
    case.assert_exactly_once()
    assert snapshot_batches(case.cfg, case.dsn) == committed  # one snapshot per batch
    table = iceberg_table(case.cfg, case.dsn)
    assert [f.name for f in table.spec().fields] == ["partition"]
    assert [table.schema().find_column_name(f.source_id)
            for f in table.sort_order().fields] == ["offset"]
    # the sink names its files with the batch's prefix through its in-memory view only:
    # other writers of the table never see (or need) OffsetFlow's location provider
    assert not {"write.py-location-provider.impl", "offsetflow.data-file-prefix",
                "commit.retry.num-retries"} & set(table.properties)
    assert all(p.name.startswith("ofb-") for p in case.data_files())
    # created with its layout in ONE commit (a kill in between cannot leave it
    # unpartitioned): one metadata version for the creation, then one per batch
    assert len(table.metadata.metadata_log) == len(committed)
    # a batch already committed: its re-run is a no-op and writes no snapshot
    rep = run_batch(spark, case.cfg, committed[0], case.dsn)
    assert rep.result.status == "already_committed"
    assert snapshot_batches(case.cfg, case.dsn) == committed


@pytest.mark.slow
def test_killed_after_data_files_written_rerun_commits_those_files_once(
        case: IcebergCase, spark: Any, spark_connect_url: str) -> None:
    """The Spark tasks wrote the batch's data files and listed them in their markers; the
    driver dies before the catalog commit. The rerun commits those very files (its tasks
    find the markers and write nothing again), and the sweep after it spares a concurrent
    writer's uncommitted files (a compaction in flight), however old."""
    import pyarrow.parquet as pq
    from pyiceberg.io.pyarrow import _dataframe_to_data_files  # noqa: PLC2701 - no public API

    bid = case.planned_batch(1000, seed=22)
    # the kill is in the driver's commit, after the tasks: a thin Spark Connect client
    proc = case.job_with(bid, spark_connect_url, OFFSETFLOW_ICEBERG_FAULT="after-files")
    assert proc.wait(timeout=600) != 0, case.job_output()[-3000:]
    assert "after-files: killing this driver" in case.job_output()
    orphans = sorted(case.data_files())
    assert len(orphans) >= 2, "the fault must come after the data files were written"
    assert case.batch(bid).status != "committed"
    assert snapshot_batches(case.cfg, case.dsn) == []
    # another writer's files, written long ago and not committed yet (a compaction)
    table = iceberg_table(case.cfg, case.dsn)
    rows = pq.read_table(orphans[0]).slice(0, 5)
    foreign = list(_dataframe_to_data_files(table.metadata, rows, table.io))
    foreign_paths = sorted(case.data_files() - set(orphans))
    assert len(foreign_paths) == len(foreign) >= 1
    old = time.time() - 2 * ORPHAN_GRACE_S
    for p in [orphans[0], *foreign_paths]:
        os.utime(p, (old, old))
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    assert all(p.exists() for p in foreign_paths), "another writer's files were swept"
    table = iceberg_table(case.cfg, case.dsn)
    # the files the first run's tasks wrote are the batch's: committed, not written again
    assert {str(p) for p in orphans} == referenced_files(table)
    assert remove_orphan_files(table, older_than_s=3600) == []
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()
    # the other writer commits its files: the table still reads
    table = iceberg_table(case.cfg, case.dsn)
    with table.transaction() as txn, txn.update_snapshot().fast_append() as append:
        for f in foreign:
            append.append_data_file(f)
    total = len(iceberg_sink_rows(case.cfg, case.dsn))
    assert total == rows.num_rows + case.workload.committed_count


@pytest.mark.parametrize("spelling", ["file:{}", "{}", "file://{}"])
def test_orphan_sweep_keeps_every_referenced_file_however_the_warehouse_is_spelled(
        case: IcebergCase, spark: Any, spelling: str) -> None:
    case.raw["sink"]["catalog"]["warehouse"] = spelling.format(case.warehouse)
    case.write_config()
    case.workload.mixed(300, random.Random(40))
    run_until_caught_up(case.cfg, case.dsn, spark)
    files = case.data_files()
    assert files
    stray = next(iter(files)).with_name("00000-0-stray.parquet")
    stray.write_bytes(b"not referenced")
    assert remove_orphan_files(iceberg_table(case.cfg, case.dsn), older_than_s=0) == [
        str(stray)]
    assert case.data_files() == files
    case.assert_exactly_once()


@pytest.mark.slow
def test_killed_between_iceberg_commit_and_ledger_commit_retry_finds_the_snapshot(
        case: IcebergCase, spark: Any, spark_connect_url: str) -> None:
    case.workload.tombstones(40)  # dead letters: PostgreSQL's, written again by the retry
    bid = case.planned_batch(1000, seed=23)
    # the kill is in the driver's commit, after the tasks: a thin Spark Connect client
    proc = case.job_with(bid, spark_connect_url, OFFSETFLOW_ICEBERG_FAULT="after-commit")
    assert proc.wait(timeout=600) != 0, case.job_output()[-3000:]
    assert "after-commit: killing this driver" in case.job_output()
    assert case.batch(bid).status != "committed"  # the ledger never committed
    assert set(case.positions().values()) == {0}
    assert snapshot_batches(case.cfg, case.dsn) == [bid]  # but Iceberg did
    files = case.data_files()
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert snapshot_batches(case.cfg, case.dsn) == [bid]  # not appended again
    assert case.data_files() == files
    assert rep.result.rows_written == len(iceberg_sink_rows(case.cfg, case.dsn))
    assert rep.result.bad_records == 40  # the tombstones, once
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


@pytest.mark.slow
def test_abandoning_a_batch_its_table_already_holds_is_refused(
        case: IcebergCase, spark: Any) -> None:
    """Review s23 H3: killed between the Iceberg commit and the ledger's, then abandoned by
    an operator: the next plan would read the same ranges and append them again. The ledger
    is refused instead, and a re-run completes the batch from the snapshot. The driver
    dies in this process (the kill itself: test_killed_between_iceberg_commit_...)."""
    bid = case.planned_batch(1000, seed=29)
    case.died_between_the_commits(spark, bid, "iceberg")
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    rc = cli(["--dsn", case.dsn, "abandon", "--pipeline-file", str(case.file), "--batch-id",
              str(bid), "--reason", "operator thinks it is dead"])
    assert rc != 0  # refused: not abandoned
    assert case.batch(bid).status != "abandoned"
    rep = run_batch(spark, case.cfg, bid, case.dsn)  # what the error says to do
    assert rep.result.status == "committed"
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert snapshot_batches(case.cfg, case.dsn).count(bid) == 1
    case.assert_exactly_once()


@pytest.mark.slow
def test_two_runs_of_one_batch_at_once_commit_it_once(case: IcebergCase, spark: Any,
                                                       spark_connect_url: str) -> None:
    """A job process runs the batch; once it has taken the batch (running), a second run
    starts in this process's warm Spark session: both work on it at once (no JVM of its
    own for either), the commit's fencing lets one commit it."""
    bid = case.planned_batch(1000, seed=24)
    case.two_runs_at_once(spark, bid, spark_connect_url)
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


@pytest.mark.slow
def test_catalog_postgres_crash_during_the_iceberg_commit_then_rerun_commits_once(
        case: IcebergCase, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The catalog's PostgreSQL crashes while the driver is in the Iceberg commit. The run
    is a thread of this process (`in_thread`): PostgreSQL, not the driver, is what dies,
    and a job process meets it the same way for a JVM more."""
    bid = case.planned_batch(1000, seed=25)
    flag = case.file.with_suffix(".pause")
    # the pause is the driver's (commit.py reads it here); the tasks never see it
    monkeypatch.setenv(FAULT_ENV, f"pause-before-commit:{flag}")
    proc = case.in_thread(spark, bid)
    try:
        chaos.wait_for(flag.exists, 300, "the job to reach the Iceberg commit")
        chaos.stack("pg-crash")
    finally:
        chaos.stack("pg-start")
        flag.unlink(missing_ok=True)
    assert proc.wait(timeout=300) != 0, "the run went on through a crashed catalog"
    monkeypatch.delenv(FAULT_ENV)
    assert case.batch(bid).status != "committed"
    assert snapshot_batches(case.cfg, case.dsn) == []
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_zombie_commit_on_a_stale_snapshot_conflicts_and_finds_the_batch(
        case: IcebergCase, spark: Any) -> None:
    """A zombie whose ledger lock is gone reaches the Iceberg commit with the table as it
    loaded it before another run committed the batch: its commit asserts the snapshot it
    checked, so it conflicts, refreshes, finds the batch, and appends nothing."""
    case.workload.mixed(400, random.Random(26))
    first = run_until_caught_up(case.cfg, case.dsn, spark)
    case.workload.mixed(400, random.Random(27))
    bid = plan_only(case.cfg, case.dsn).batch
    assert bid is not None and first[0].report is not None
    zombie_view = iceberg_table(case.cfg, case.dsn)  # main: the first batches' snapshot
    with Ledger(case.dsn) as ledger:
        batch = ledger.get_batch(bid.batch_id)
    assert find_batch(zombie_view, batch) is None
    rep = run_batch(spark, case.cfg, bid.batch_id, case.dsn)  # the live run wins
    assert rep.result.status == "committed"
    rows = len(iceberg_sink_rows(case.cfg, case.dsn))
    data = zombie_view.scan(limit=10).to_arrow()  # whatever the zombie would append
    found = commit_snapshot(zombie_view, batch, data, {"offsetflow.pipeline": "zombie"})
    assert found == rep.result.rows_written  # found the winner's snapshot, appended nothing
    assert len(iceberg_sink_rows(case.cfg, case.dsn)) == rows
    assert snapshot_batches(case.cfg, case.dsn).count(bid.batch_id) == 1
    case.assert_exactly_once()


def _lineage(case: IcebergCase, table: Any, partition: int, until: int) -> set[int]:
    from pyiceberg.expressions import And, EqualTo, LessThan

    rows = table.scan(row_filter=And(EqualTo("partition", partition),
                                     LessThan("offset", until)),
                      selected_fields=(LINEAGE_COLUMN,)).to_arrow()
    return set(rows[LINEAGE_COLUMN].to_pylist())


def test_replay_replaces_the_window_in_one_commit(case: IcebergCase, spark: Any) -> None:
    """A replay deletes what its window produced (by coordinates) and appends the re-read
    rows in the same catalog commit: the window's rows are the replay's, once."""
    case.workload.mixed(1200, random.Random(28))
    live = [r.report.batch_id for r in run_until_caught_up(case.cfg, case.dsn, spark)
            if r.report is not None]
    ids = window(case, spark, "replay", partitions="0", from_offset=0, until_offset=400)
    assert len(ids) == 1
    table = iceberg_table(case.cfg, case.dsn)
    assert _lineage(case, table, 0, 400) == {ids[0]}  # replaced, not added beside
    assert _lineage(case, table, 1, 400) <= set(live)  # another partition: untouched
    batches = snapshot_batches(case.cfg, case.dsn)
    assert batches[:len(live)] == live and set(batches[len(live):]) == {ids[0]}
    case.assert_exactly_once()
    window(case, spark, "replay", partitions="0", from_offset=0, until_offset=400)
    case.assert_exactly_once()  # a second replay of the same window: still once


def test_backfill_with_its_own_target_table_writes_that_iceberg_table(
        case: IcebergCase, spark: Any) -> None:
    case.workload.mixed(1000, random.Random(29))
    run_until_caught_up(case.cfg, case.dsn, spark)
    rows = len(iceberg_sink_rows(case.cfg, case.dsn))
    other = f"lake.{case.table}_bf"
    ids = window(case, spark, "backfill", partitions="0", from_offset=0, until_offset=200,
                  target_table=other)
    assert len(iceberg_sink_rows(case.cfg, case.dsn)) == rows  # the pipeline's: unchanged
    assert case.cfg.sink.iceberg is not None
    copy = load_catalog(case.cfg.sink.iceberg, case.dsn).load_table(other)
    assert _lineage(case, copy, 0, 200) == set(ids)
    assert copy.scan().to_arrow().num_rows == _count(case, 0, 200)
    case.assert_exactly_once()


def _count(case: IcebergCase, partition: int, until: int) -> int:
    return sum(1 for p in case.workload.produced.values()
               if p.committed and p.partition == partition and p.offset < until)


def test_rows_that_do_not_fit_the_table_fail_the_batch_naming_it(case: IcebergCase,
                                                                  spark: Any) -> None:
    case.workload.mixed(500, random.Random(30))
    run_until_caught_up(case.cfg, case.dsn, spark)
    positions = case.positions()
    case.raw["format"]["schema"]["extra"] = "string"  # a column the table does not have
    case.write_config()
    case.workload.mixed(300, random.Random(31))
    with pytest.raises(SchemaMismatchError, match=rf"batch \d+: its rows do not fit the "
                                                  rf"Iceberg table lake\.{case.table} .*extra"):
        run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.positions() == positions  # nothing moved, nothing lost
    case.assert_exactly_once(expect_all=False)


def test_maintenance_expires_old_snapshots_but_never_one_an_open_batch_may_need(
        case: IcebergCase, spark: Any) -> None:
    """Snapshot expiry keeps every snapshot younger than the oldest open batch (its retry
    may have to find its own); the command also removes orphan files."""
    case.workload.mixed(300, random.Random(32))
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.workload.mixed(300, random.Random(33))
    run_until_caught_up(case.cfg, case.dsn, spark)
    done = snapshot_batches(case.cfg, case.dsn)
    assert len(done) >= 2
    case.workload.mixed(200, random.Random(34))
    bid = case.planned_batch(200, seed=35)  # open: planned, not committed
    # its snapshot is in Iceberg, its ledger row open (the driver dies in this process)
    case.died_between_the_commits(spark, bid, "iceberg")
    txn = iceberg_table(case.cfg, case.dsn).transaction()  # another writer on top
    with txn, txn.update_snapshot().fast_append():
        pass
    data_dir = next(case.warehouse.rglob("data"))
    stray = data_dir / "00000-0-stray.parquet"
    stray.write_bytes(b"not referenced")
    args = ["--pipeline-file", str(case.file), "--dsn", case.dsn,
            "--orphans-older-than-hours", "0", "--expire-snapshots-older-than-days", "0"]
    assert main(args) == 0
    assert not stray.exists()
    # everything older than the open batch went; its own snapshot stayed (not the current
    # one any more, and older than "0 days": kept only for the open batch)
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"  # found its snapshot: not appended again
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    case.assert_exactly_once()


@pytest.mark.parametrize("sink_table,alias", [("{t}", "offsetflow.{t}"),
                                              ("offsetflow.{t}", "{t}"),
                                              ("lake.{t}", "lake.{t}")])
def test_backfill_naming_the_pipelines_own_table_in_another_spelling_is_live_guarded(
        case: IcebergCase, sink_table: str, alias: str) -> None:
    """`offsetflow.<t>` and `<t>` are one Iceberg table (namespace offsetflow by default):
    a backfill past the live position into it, however spelled, is refused (Iceberg has
    no coordinates index to stop the live batches writing those offsets again)."""
    case.raw["sink"]["table"] = sink_table.format(t=case.table)
    case.write_config()
    case.workload.mixed(300, random.Random(41))
    cfg = case.cfg
    req = parse_request("backfill", {"pipeline": cfg.name, "topic": case.workload.topic,
                                     "partitions": "0", "from_offset": 0, "until_offset": 100,
                                     "target_table": alias.format(t=case.table)})
    with Ledger(case.dsn) as ledger:
        wp = plan_window(cfg, ledger, kafka_for(cfg), req)
        assert wp.refused is not None and "pipeline's own table" in wp.refused
        with pytest.raises(RequestError, match=r"cannot backfill .*\[0\] \[0, 100\) into the "
                                               r"pipeline's own table"):
            submit_window(cfg, ledger, wp, "test")


def test_a_snapshot_with_the_batch_id_but_other_ranges_is_an_error_not_found(
        case: IcebergCase, spark: Any) -> None:
    """A ledger restored or rebuilt (or a second deployment on the table) reuses batch
    ids: a snapshot naming this pipeline and batch id with other ranges is not this batch.
    Taking it as "found" would complete the ledger without writing and lose the records."""
    case.workload.mixed(300, random.Random(42))
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.workload.mixed(300, random.Random(43))
    bid = plan_only(case.cfg, case.dsn).batch
    assert bid is not None
    table = iceberg_table(case.cfg, case.dsn)  # the old ledger's batch of the same id
    stale = snapshot_summary(case.cfg.name, bid.batch_id, "live",
                             [(case.workload.topic, 0, 0, 5)], 5, 0)
    with table.transaction() as txn, txn.update_snapshot(
            snapshot_properties=stale).fast_append():
        pass
    positions = case.positions()
    with pytest.raises(BatchIdentityError, match=(
            rf"batch {bid.batch_id} of pipeline {case.cfg.name}: Iceberg snapshot \d+ of "
            rf"lake\.{case.table} names this batch with ranges .*\[0, 5\).* but the ledger's "
            rf"batch has .*; a ledger restored or rebuilt, or two deployments")):
        run_batch(spark, case.cfg, bid.batch_id, case.dsn)
    assert case.positions() == positions  # nothing moved, nothing lost
    assert case.batch(bid.batch_id).status != "committed"


@pytest.mark.parametrize("change", ["name", "warehouse", "uri"])
def test_a_catalog_change_between_plan_and_run_is_a_config_change(
        case: IcebergCase, spark: Any, change: str) -> None:
    """An attempt may have committed to catalog A and died; its retry against catalog B
    would miss that snapshot and put the batch into a second table. So the catalog's
    identity is part of the config fingerprint: the retry stops with the drift error."""
    bid = case.planned_batch(200, seed=44)
    cat = case.raw["sink"]["catalog"]
    if change == "name":
        cat["name"] = "other"
    elif change == "warehouse":
        other = case.warehouse.with_name("warehouse2")
        other.mkdir()
        cat["warehouse"] = f"file://{other}"
    else:  # the catalog in another database of the same server
        cat["uri"] = sqlalchemy_url(case.dsn).rsplit("/", 1)[0] + "/postgres"
    case.write_config()
    with pytest.raises(BatchStateError, match=rf"config changed since batch {bid} was "
                                              rf"planned"):
        run_batch(spark, case.cfg, bid, case.dsn)
    assert case.batch(bid).status != "committed"


def test_reset_position_back_under_rows_in_the_iceberg_table_is_refused_unless_forced(
        case: IcebergCase, spark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Iceberg has no coordinates index: a backward reset would have the next batches
    append again every row at or past the new position. Refused, naming the table and the
    rows; --force applies it (and the rows are appended again, as asked)."""
    from offsetflow.cli import main as cli

    case.workload.mixed(600, random.Random(45))
    run_until_caught_up(case.cfg, case.dsn, spark)
    positions = case.positions()
    topic = case.workload.topic
    assert positions[(topic, 0)] > 100
    base = ["--dsn", case.dsn, "reset-position", "--pipeline-file", str(case.file),
            "--topic", topic, "--partition", "0", "--offset", "100", "--reason", "test"]
    assert cli(base) == 2
    err = capsys.readouterr().err
    assert re.search(rf"lake\.{case.table} holds \d+ rows of {topic} at offsets >= 100 "
                     rf"\(partition\(s\) \[0\]\).*would append them again.*--force", err), err
    assert case.positions() == positions  # nothing moved
    assert cli([*base, "--archive-to", "lake.archive"]) == 2
    assert "--archive-to moves PostgreSQL sink rows" in capsys.readouterr().err
    assert case.positions() == positions
    assert cli([*base, "--force"]) == 0
    assert case.positions()[(topic, 0)] == 100
    rows = len(iceberg_sink_rows(case.cfg, case.dsn))
    run_until_caught_up(case.cfg, case.dsn, spark)
    again = sum(1 for p in case.workload.produced.values()
                if p.committed and p.partition == 0 and p.offset >= 100)
    assert len(iceberg_sink_rows(case.cfg, case.dsn)) == rows + again  # forced: as asked


def test_orphan_sweep_refuses_when_none_of_the_referenced_files_is_listed(
        case: IcebergCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """A path spelling the sweep does not understand (no referenced file matches the
    listing) is not "every file is an orphan": it refuses and deletes nothing."""
    import pyarrow as pa

    from offsetflow.sinks.iceberg import IcebergSink
    from offsetflow.sinks.iceberg import files as sink_iceberg_files

    cfg = case.cfg
    assert cfg.sink.iceberg is not None
    sink = IcebergSink(cfg.sink.iceberg, case.dsn, None, [("topic", "text"),  # type: ignore[arg-type]
                                                          ("partition", "integer"),
                                                          ("offset", "bigint")], cfg.sink.table)
    table = sink.table(cfg.sink.iceberg.identifier)
    table.append(pa.table({"topic": ["t"], "partition": pa.array([0], pa.int32()),
                           "offset": [0], LINEAGE_COLUMN: [1]}, schema=table.schema().as_arrow()))
    files = case.data_files()
    assert files
    canonical = sink_iceberg_files.canonical_path
    monkeypatch.setattr(sink_iceberg_files, "canonical_path",
                        lambda p: "elsewhere:" + canonical(p))
    with pytest.raises(sink_iceberg_files.OrphanSweepRefusedError,
                       match=r"reference 1 data files .* but none of the 1 files listed .*"
                             r"nothing deleted"):
        remove_orphan_files(iceberg_table(cfg, case.dsn), older_than_s=0)
    assert case.data_files() == files


def test_a_layout_edit_to_an_existing_table_is_reported_not_silently_ignored(
        case: IcebergCase, spark: Any, caplog: pytest.LogCaptureFixture) -> None:
    """partition_by / sort_by / target_file_mb apply when OffsetFlow creates the table; an
    edit afterwards changes nothing there, and the sink says so (naming both layouts)."""
    import logging

    case.workload.mixed(300, random.Random(46))
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.workload.mixed(100, random.Random(48))
    with caplog.at_level(logging.WARNING, logger="offsetflow.sinks.iceberg"):
        run_until_caught_up(case.cfg, case.dsn, spark)  # the same layout: not a word
    layout = "offsetflow.sinks.iceberg.layout"  # (other records name the tmp path, "layout")
    assert not [r for r in caplog.records if r.name == layout]
    case.raw["sink"]["partition_by"] = ["bucket(4, event_id)"]
    case.raw["sink"]["sort_by"] = ["offset desc"]
    case.raw["sink"]["target_file_mb"] = 64
    case.write_config()
    case.workload.mixed(300, random.Random(47))
    with caplog.at_level(logging.WARNING, logger="offsetflow.sinks.iceberg"):
        runs = [r for r in run_until_caught_up(case.cfg, case.dsn, spark)
                if r.report is not None]
    warned = [r.getMessage() for r in caplog.records if r.name == layout]
    assert 1 <= len(warned) <= len(runs), warned  # once per batch, not per table load
    assert re.search(rf"lake\.{case.table}.*partitioned by \[partition\].*partition_by "
                     rf"says \[bucket\[4\]\(event_id\)\].*sorted by \[offset asc\].*sort_by "
                     rf"says \[offset desc\].*128 MB.*target_file_mb says 64", warned[0])
    case.assert_exactly_once()


def test_snapshot_expiry_keeps_an_open_batchs_snapshot_whatever_the_clocks_say(
        case: IcebergCase, spark: Any) -> None:
    """The expiry floor compared PostgreSQL's planned_at with the driver's snapshot
    timestamps: a driver clock behind the database's let an open batch's snapshot expire,
    and its retry appended the batch again. The floor is now the chain itself: the
    oldest ancestor naming an open batch, and everything after it, stay."""
    case.workload.mixed(300, random.Random(49))
    run_until_caught_up(case.cfg, case.dsn, spark)
    bid = case.planned_batch(200, seed=50)
    # its snapshot is in Iceberg, its ledger row open (the driver dies in this process)
    case.died_between_the_commits(spark, bid, "iceberg")
    with Ledger(case.dsn) as ledger, ledger.transaction() as cur:  # the driver's clock
        cur.execute("UPDATE offsetflow.batches SET planned_at = now() + interval '1 hour' "
                    "WHERE batch_id = %s", (bid,))  # an hour behind the database's
    txn = iceberg_table(case.cfg, case.dsn).transaction()  # another writer on top
    with txn, txn.update_snapshot().fast_append():
        pass
    assert main(["--pipeline-file", str(case.file), "--dsn", case.dsn,
                 "--orphans-older-than-hours", "0", "--expire-snapshots-older-than-days",
                 "0"]) == 0
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert snapshot_batches(case.cfg, case.dsn) == [bid]  # found: not appended again
    case.assert_exactly_once()
