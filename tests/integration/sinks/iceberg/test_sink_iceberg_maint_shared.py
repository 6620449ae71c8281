"""Maintenance of an Iceberg table other pipelines write too (issue 28, class 3): snapshot
expiry and the orphan sweep run for one pipeline keep every snapshot and data file another
pipeline's open batch relies on, in this ledger (asked exactly) or in another one (told by
the snapshots' summaries: the ledger's id and the writer's oldest open batch). Real
PostgreSQL catalog and ledgers, Spark local[2], the checker per topic."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offsetflow.config.iceberg_sink import sqlalchemy_url
from offsetflow.job import run_batch
from offsetflow.ops import run_until_caught_up
from offsetflow.sinks.iceberg.files import referenced_files
from offsetflow.sinks.iceberg.maint import main as maint
from tests.tooling.iceberg_case import IcebergCase
from tests.tooling.iceberg_rows import iceberg_table
from tests.tooling.pipeline_data import ledger_database


@pytest.fixture
def other_ledger(admin_dsn: str, unique: str) -> Iterator[str]:
    """A second ledger: a database of its own, migrated."""
    with ledger_database(admin_dsn, f"offsetflow_test_{os.getpid()}_mnt_{unique}") as dsn:
        yield dsn


def _sharing(a: IcebergCase, tmp: Path, dsn: str, bootstrap: str, topic: str, unique: str,
             ledger: str | None = None) -> IcebergCase:
    """Another pipeline (its own topic, `ledger`: its own ledger) writing a's table."""
    tmp.mkdir()
    b = IcebergCase(tmp, ledger or dsn, bootstrap, topic, 2, unique)
    b.raw["sink"] = {**a.raw["sink"], "connection": ledger or dsn,
                     "catalog": {**a.raw["sink"]["catalog"], "uri": sqlalchemy_url(dsn)}}
    b.write_config()
    return b


def _expire_and_sweep(a: IcebergCase) -> None:
    assert maint(["--pipeline-file", str(a.file), "--dsn", a.dsn,
                  "--orphans-older-than-hours", "0", "--expire-snapshots-older-than-days",
                  "0"]) == 0


def _snapshot_of(a: IcebergCase, pipeline: str, batch_id: int) -> bool:
    table = iceberg_table(a.cfg, a.dsn)
    return any((s.summary.additional_properties if s.summary else {}).get(
        "offsetflow.pipeline") == pipeline and (s.summary.additional_properties or {}).get(
        "offsetflow.batch-id") == str(batch_id) for s in table.snapshots())


def test_expiry_for_one_pipeline_keeps_what_another_pipelines_open_batches_rely_on(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, spark: Any) -> None:
    """Pipelines a, b and c write one table (one ledger). b's batch committed to Iceberg
    and its driver died before the ledger did; c's tasks wrote their data files and its
    driver died before the catalog commit (in-process: the commit raises where a killed
    driver stops); a commits on top. Maintenance run for a (expiry
    of everything older than now, orphans of any age) expired b's snapshot and deleted c's
    files: b's re-run appended the batch again. Now both stay: b's re-run finds its
    snapshot, c's commits the files its tasks wrote, each record once."""
    (tmp_path / "a").mkdir()
    a = IcebergCase(tmp_path / "a", pg_dsn, kafka_bootstrap, make_topic("mnta", 2), 2,
                    f"{unique}a")
    b = _sharing(a, tmp_path / "b", pg_dsn, kafka_bootstrap, make_topic("mntb", 2),
                 f"{unique}b")
    c = _sharing(a, tmp_path / "c", pg_dsn, kafka_bootstrap, make_topic("mntc", 2),
                 f"{unique}c")
    a.workload.mixed(300, random.Random(91))
    run_until_caught_up(a.cfg, a.dsn, spark)
    b_batch = b.planned_batch(300, seed=92)
    b.died_between_the_commits(spark, b_batch, "iceberg")
    assert _snapshot_of(a, b.cfg.name, b_batch)
    c_batch = c.planned_batch(300, seed=93)
    before = a.data_files()  # the table's folder (a's warehouse): c's files go there too
    c.died_between_the_commits(spark, c_batch, "files")
    c_files = a.data_files() - before
    assert c_files, "c's tasks wrote no data files"
    a.workload.mixed(300, random.Random(94))  # a commits on top
    run_until_caught_up(a.cfg, a.dsn, spark)
    _expire_and_sweep(a)
    assert _snapshot_of(a, b.cfg.name, b_batch), "b's open batch's snapshot was expired"
    assert c_files <= a.data_files(), "c's open batch's data files were deleted"
    assert run_batch(spark, b.cfg, b_batch, b.dsn).result.status == "committed"
    assert run_batch(spark, c.cfg, c_batch, c.dsn).result.status == "committed"
    assert {str(p) for p in c_files} <= referenced_files(iceberg_table(a.cfg, a.dsn)), \
        "c's re-run wrote its files again instead of committing its tasks' files"
    for case in (a, b, c):
        case.assert_exactly_once()


def test_expiry_keeps_the_open_batch_of_a_pipeline_in_another_ledger(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, spark: Any, other_ledger: str) -> None:
    """b writes a's table from another ledger, which a's maintenance cannot ask: b's batch
    committed to Iceberg, its driver died before b's ledger committed (in-process), and a
    committed on top. a's expiry expired b's snapshot and b's re-run appended the batch again. The
    snapshots say whose they are (the ledger's id) and which of the writer's batches were
    still open when it committed: the expiry keeps b's, b's re-run finds it."""
    (tmp_path / "a").mkdir()
    a = IcebergCase(tmp_path / "a", pg_dsn, kafka_bootstrap, make_topic("mnla", 2), 2,
                    f"{unique}a")
    b = _sharing(a, tmp_path / "b", pg_dsn, kafka_bootstrap, make_topic("mnlb", 2),
                 f"{unique}b", ledger=other_ledger)
    a.workload.mixed(300, random.Random(95))
    run_until_caught_up(a.cfg, a.dsn, spark)
    b_batch = b.planned_batch(300, seed=96)
    b.died_between_the_commits(spark, b_batch, "iceberg")
    assert _snapshot_of(a, b.cfg.name, b_batch)
    a.workload.mixed(300, random.Random(97))
    run_until_caught_up(a.cfg, a.dsn, spark)
    _expire_and_sweep(a)
    assert _snapshot_of(a, b.cfg.name, b_batch), "b's open batch's snapshot was expired"
    assert run_batch(spark, b.cfg, b_batch, b.dsn).result.status == "committed"
    a.assert_exactly_once()
    b.assert_exactly_once()
