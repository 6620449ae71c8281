"""Issue 28 class 5: a warehouse that cannot be written (read-only, full) stops the batch
with one WarehouseWriteError naming the batch, the warehouse, the OS error, that nothing
was committed and the way out: from a Spark task's data files, from the catalog commit's
manifests and metadata, from a new table's first metadata. Once the warehouse is
writable again, the batch commits exactly once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from offsetflow.errors import WarehouseWriteError
from offsetflow.job import run_batch
from offsetflow.ops import plan_only, run_until_caught_up
from tests.tooling import mounts
from tests.tooling.iceberg_case import IcebergCase
from tests.tooling.iceberg_rows import snapshot_batches


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> IcebergCase:
    return IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, make_topic("icew", 2), 2, unique)


def _table_dir(case: IcebergCase, sub: str) -> Path:
    found = [p for p in case.warehouse.rglob(sub) if p.is_dir()]
    assert len(found) == 1, found
    return found[0]


def _unreferenced(case: IcebergCase) -> set[str]:
    from offsetflow.sinks.iceberg.files import referenced_files
    from tests.tooling.iceberg_rows import iceberg_table

    return {str(p) for p in case.data_files()} - referenced_files(
        iceberg_table(case.cfg, case.dsn))


def _nothing_committed(case: IcebergCase, bid: int, snaps: list[int],
                       positions: dict[tuple[str, int], int]) -> None:
    assert snapshot_batches(case.cfg, case.dsn) == snaps
    assert case.positions() == positions
    batch = case.batch(bid)
    assert batch.status == "failed" and "cannot write to the Iceberg warehouse" in (
        batch.error or "")


@pytest.mark.parametrize("path", ["tasks", "stage", "upsert"])
def test_a_read_only_warehouse_at_the_commit_commits_nothing_and_names_the_way_out(
        case: IcebergCase, spark: Any, path: str) -> None:
    """The table's metadata folder read-only: the catalog commit cannot write its
    manifests (the tasks' files path, the driver's stage path, the upsert's rewrite)."""
    if path == "stage":  # a transform: the driver reads the stage and writes the files
        case.raw["transform"] = "tests.tooling.chaos.maybe_fail_task"
    if path == "upsert":
        case.raw["sink"].update(mode="upsert", key=["event_id"])
    case.write_config()
    case.workload.plain(40)
    run_until_caught_up(case.cfg, case.dsn, spark)
    snaps, positions = snapshot_batches(case.cfg, case.dsn), case.positions()
    bid = case.planned_batch(200, seed=71)
    metadata = _table_dir(case, "metadata")
    with mounts.read_only(metadata), pytest.raises(WarehouseWriteError, match=(
            rf"batch {bid}: cannot write to the Iceberg warehouse at file://{case.warehouse}/"
            rf"lake(\.db)?/{case.table} \(writing the batch's files and metadata for its "
            rf"catalog commit\): \[Errno 30\] .*Read-only file system; nothing was committed "
            rf"\(the table and the ledger are as before\). Make it writable .* and run batch "
            rf"{bid} again .*: it commits once")):
        run_batch(spark, case.cfg, bid, case.dsn)
    _nothing_committed(case, bid, snaps, positions)
    assert run_batch(spark, case.cfg, bid, case.dsn).result.status == "committed"
    assert snapshot_batches(case.cfg, case.dsn) == [*snaps, bid]
    case.assert_exactly_once()


@pytest.mark.slow
def test_a_full_warehouse_under_the_tasks_is_one_error_not_a_spark_traceback(
        case: IcebergCase, spark: Any) -> None:
    """Partition 0's data folder full (a 4 KiB tmpfs) while the Spark tasks write their
    files: the job process prints the error once, no Python or Spark traceback, and commits
    nothing; with room again, the batch commits once (its dead attempt's files swept).
    Parts that wrote only partition 1 keep their markers and files: the retry commits
    those very files and writes the rest."""
    case.workload.plain(40)
    run_until_caught_up(case.cfg, case.dsn, spark)
    snaps, positions = snapshot_batches(case.cfg, case.dsn), case.positions()
    case.workload.plain(500)
    planned = plan_only(case.cfg, case.dsn).batch
    assert planned is not None
    bid = planned.batch_id
    with mounts.full(_table_dir(case, "partition=0"), "4k"):
        proc = case.job(bid)
        assert proc.wait(timeout=600) == 2, case.job_output()[-3000:]
    out = case.job_output()
    errors = [line for line in out.splitlines() if line.startswith("offsetflow: error:")]
    assert len(errors) == 1, out[-4000:]
    assert f"batch {bid}: cannot write to the Iceberg warehouse" in errors[0]
    assert "No space left on device" in errors[0] and "nothing was committed" in errors[0]
    assert "Traceback" not in out and "PythonException" not in out, out[-4000:]
    assert out.count("No space left on device") == 1, out[-4000:]
    _nothing_committed(case, bid, snaps, positions)
    assert run_batch(spark, case.cfg, bid, case.dsn).result.status == "committed"
    assert snapshot_batches(case.cfg, case.dsn) == [*snaps, bid]
    case.assert_exactly_once()
    assert not _unreferenced(case)  # the failed attempt's partition-1 files: swept


def test_a_read_only_warehouse_before_the_table_exists_names_the_table(
        case: IcebergCase, spark: Any) -> None:
    bid = case.planned_batch(200, seed=74)
    with mounts.read_only(case.warehouse), pytest.raises(WarehouseWriteError, match=(
            rf"cannot write to the Iceberg warehouse at file://{case.warehouse} \(creating "
            rf"table lake\.{case.table}\): .*Read-only file system; nothing was committed")):
        run_batch(spark, case.cfg, bid, case.dsn)
    assert not list(case.warehouse.iterdir())
    assert run_batch(spark, case.cfg, bid, case.dsn).result.status == "committed"
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()
