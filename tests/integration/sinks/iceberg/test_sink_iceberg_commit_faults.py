"""The Iceberg append's task-files path (`sink_iceberg_tasks`) between the tasks' data files
and the commit, on the real services: the table replaced under the same name meanwhile,
and PostgreSQL crashing (`pg_ctl -m immediate`: the markers, UNLOGGED, are emptied) after
the catalog commit and before the ledger's. The checker reads the table back with a
pyiceberg scan: 0 lost, 0 duplicated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from offsetflow.ledger import connect
from offsetflow.ops import run_until_caught_up
from offsetflow.sinks import task_data_files
from offsetflow.sinks.iceberg.files import referenced_files
from offsetflow.sinks.iceberg.sink import load_catalog
from offsetflow.sinks.iceberg.tasks import TASK_FAULT_ENV
from tests.tooling import chaos
from tests.tooling.iceberg_case import IcebergCase
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches

pytestmark = pytest.mark.slow  # each test runs a job as a process and breaks something


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> IcebergCase:
    topic = make_topic("icef", 2)
    c = IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)
    assert task_data_files(c.cfg)  # the tasks write the data files, the driver commits
    return c


def _unreferenced(case: IcebergCase) -> set[str]:
    referenced = referenced_files(iceberg_table(case.cfg, case.dsn))
    return {str(p) for p in case.data_files()} - referenced


def _markers(dsn: str, batch_id: int) -> int:
    conn = connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s "
                        "AND data_files IS NOT NULL", (batch_id,))
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def test_a_table_replaced_between_the_tasks_files_and_the_commit_is_refused(
        case: IcebergCase, spark: Any, tmp_path: Path) -> None:
    """The tasks write their data files for the table as the driver loaded it; before the
    commit the table is dropped and created again under the same name (same schema and
    spec: nothing but its UUID tells them apart). The files carry the old table's field
    ids and sit in its location: the commit refuses them naming the table and both UUIDs,
    commits nothing (no snapshot, no position moved), drops their parts, and the re-run
    writes the batch into the new table once."""
    bid = case.planned_batch(800, seed=61)
    before = case.positions()
    flag = tmp_path / "paused"
    proc = case.job_with(bid, **{TASK_FAULT_ENV: f"pause-after-files:{flag}"})
    try:
        chaos.wait_for(flag.exists, 300, "part 0 to write its files")
        assert case.cfg.sink.iceberg is not None
        ident = case.cfg.sink.iceberg.identifier
        catalog = load_catalog(case.cfg.sink.iceberg, case.dsn)
        old = catalog.load_table(ident)
        catalog.drop_table(ident)  # its files stay: no purge
        new = catalog.create_table(ident, schema=old.schema(), partition_spec=old.spec(),
                                   sort_order=old.sort_order(), properties=old.properties)
    finally:
        flag.unlink(missing_ok=True)
    old_uuid, new_uuid = str(old.metadata.table_uuid), str(new.metadata.table_uuid)
    assert old_uuid != new_uuid
    proc.wait(timeout=300)
    out = case.job_output()
    assert snapshot_batches(case.cfg, case.dsn) == [], \
        "the commit put the files the tasks wrote for the dropped table into the new one"
    assert case.batch(bid).status == "failed", out[-3000:]
    assert case.positions() == before
    assert out.count("was replaced (dropped and created again)") == 1, out[-3000:]
    assert ident in out and old_uuid in out and new_uuid in out, out[-3000:]
    error = case.batch(bid).error or ""
    assert old_uuid in error and new_uuid in error and ident in error, error
    assert _markers(case.dsn, bid) == 0, "the refused parts were not dropped"
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.batch(bid).status == "committed"
    assert snapshot_batches(case.cfg, case.dsn)[0] == bid
    assert str(iceberg_table(case.cfg, case.dsn).metadata.table_uuid) == new_uuid
    case.assert_exactly_once()
    assert _unreferenced(case) == set()  # the files written for the old table are swept


def test_postgresql_crash_after_the_catalog_commit_of_the_tasks_files_commits_once(
        case: IcebergCase, spark: Any, spark_connect_url: str) -> None:
    """The driver commits the tasks' files to Iceberg and is killed before the ledger's
    COMMIT; then PostgreSQL crashes (`pg_ctl -m immediate`), which empties the UNLOGGED
    markers listing those files. The re-run finds no marker, so its tasks write the batch's
    files again, but the commit finds the batch's snapshot and appends nothing: the batch
    is committed once, and the re-run's own files, referenced by no snapshot, are swept."""
    bid = case.planned_batch(800, seed=62)
    before = case.positions()
    # the kill is in the driver's commit, after the tasks: a thin Spark Connect client
    proc = case.job_with(bid, spark_connect_url, OFFSETFLOW_ICEBERG_FAULT="after-commit")
    assert proc.wait(timeout=600) != 0, case.job_output()[-3000:]
    assert "after-commit: killing this driver" in case.job_output()
    assert snapshot_batches(case.cfg, case.dsn) == [bid]  # in Iceberg, not in the ledger
    assert case.batch(bid).status != "committed" and case.positions() == before
    assert _markers(case.dsn, bid) >= 2
    committed = referenced_files(iceberg_table(case.cfg, case.dsn))
    try:
        chaos.stack("pg-crash")
    finally:
        chaos.stack("pg-start")
    assert _markers(case.dsn, bid) == 0, "the crash should have emptied the markers"
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.batch(bid).status == "committed"
    assert snapshot_batches(case.cfg, case.dsn).count(bid) == 1
    assert committed <= referenced_files(iceberg_table(case.cfg, case.dsn))
    assert _unreferenced(case) == set(), "the re-run's files of the found batch stay"
    case.assert_exactly_once()
