"""The Iceberg sink's table is the table its ledger knows (issue 28, class 2): the ledger
records the table's identity (Iceberg table-uuid, location, catalog, identifier, and the
metadata of its last commit) and every run, find and maintenance checks it before anything
is written. A table dropped, renamed, replaced, registered from older metadata, or found
through another catalog, namespace or table name is refused naming the ledger's record, what
was found and the way out; the orphan sweep never deletes a file another table at the same
location references. Real PostgreSQL catalog, Spark local[2], pyiceberg checker."""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from offsetflow.cli import main as cli
from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.config.iceberg_sink import sqlalchemy_url
from offsetflow.errors import IcebergTableReplacedError, OffsetFlowError
from offsetflow.job import run_batch
from offsetflow.ops import plan_only, run_until_caught_up
from offsetflow.sinks.iceberg.files import remove_orphan_files
from offsetflow.sinks.iceberg.maint import main as maint
from offsetflow.sinks.iceberg.sink import load_catalog
from tests.tooling.iceberg_case import IcebergCase
from tests.tooling.iceberg_rows import iceberg_sink_rows, snapshot_batches
from tests.tooling.pipeline_data import ledger_database

IDENTITY_ERROR = "IcebergTableIdentityError"


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> IcebergCase:
    topic = make_topic("iceid", 2)
    return IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)


def _catalog(case: IcebergCase) -> Any:
    assert case.cfg.sink.iceberg is not None
    return load_catalog(case.cfg.sink.iceberg, case.dsn)


def _ident(case: IcebergCase) -> str:
    assert case.cfg.sink.iceberg is not None
    return case.cfg.sink.iceberg.identifier


def _refused(case: IcebergCase, spark: Any, *more: str) -> str:
    """The next run is refused with the identity error; nothing moved. Its message."""
    positions = case.positions()
    with pytest.raises(OffsetFlowError) as ei:
        run_until_caught_up(case.cfg, case.dsn, spark)
    assert ei.type.__name__ == IDENTITY_ERROR, ei.value
    msg = str(ei.value)
    for m in more:
        assert m in msg, msg
    assert case.positions() == positions
    return msg


def test_a_dropped_table_is_refused_not_recreated_and_its_metadata_registered_back_resumes(
        case: IcebergCase, spark: Any) -> None:
    """Issue 28: a table dropped by mistake made the next run create an empty one at the
    same location and carry on (rc 0), and the maintenance sweep then deleted the old
    table's files, so registering its metadata again failed (FileNotFoundError). Now the
    run is refused naming the ledger's record and the metadata file to register, the
    maintenance command refuses too, and registering that file back resumes the pipeline,
    each record once."""
    case.workload.mixed(400, random.Random(71))
    run_until_caught_up(case.cfg, case.dsn, spark)
    ident, catalog = _ident(case), _catalog(case)
    old = catalog.load_table(ident)
    uuid, location, meta = str(old.metadata.table_uuid), old.location(), old.metadata_location
    files = case.data_files()
    catalog.drop_table(ident)  # by mistake; its files stay (no purge)
    case.workload.mixed(200, random.Random(72))
    msg = _refused(case, spark, ident, uuid, location, meta, "register")
    assert "no table" in msg, msg
    assert not catalog.table_exists(ident), "the run created a new table"
    args = ["--pipeline-file", str(case.file), "--dsn", case.dsn,
            "--orphans-older-than-hours", "0", "--expire-snapshots-older-than-days", "0"]
    assert maint(args) == 2  # refused: the table is not the ledger's (it is missing)
    assert case.data_files() == files
    catalog.register_table(ident, meta)  # the way out the message names
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_a_catalog_namespace_or_table_name_changed_between_batches_is_refused(
        case: IcebergCase, spark: Any, admin_dsn: str, unique: str) -> None:
    """`sink.catalog.name` (or its uri, the namespace, the table name) changed between
    batches found no table there, so the next run created a new empty one and carried on
    (issue 28). Each is now refused before anything is read or created; back to the
    ledger's table, the batch commits once."""
    case.workload.mixed(300, random.Random(73))
    run_until_caught_up(case.cfg, case.dsn, spark)
    bid = case.planned_batch(200, seed=74)
    original = copy.deepcopy(case.raw["sink"])
    with ledger_database(admin_dsn, f"offsetflow_test_{os.getpid()}_cat_{unique}") as other:
        changes: dict[str, Any] = {
            "catalog name": lambda s: s["catalog"].update(name="other"),
            "catalog uri": lambda s: s["catalog"].update(uri=sqlalchemy_url(other)),
            "namespace": lambda s: s.update(table=f"lake2.{case.table}"),
            "table name": lambda s: s.update(table=f"lake.{case.table}_v2"),
        }
        for what, change in changes.items():
            case.raw["sink"] = copy.deepcopy(original)
            change(case.raw["sink"])
            case.write_config()
            cfg = case.cfg
            with pytest.raises(OffsetFlowError) as ei:
                run_batch(spark, cfg, bid, case.dsn, accept_config_change=True)
            assert ei.type.__name__ == IDENTITY_ERROR, (what, ei.value)
            assert f"lake.{case.table}" in str(ei.value), (what, ei.value)
            assert cfg.sink.iceberg is not None
            assert not load_catalog(cfg.sink.iceberg, case.dsn).table_exists(
                cfg.sink.iceberg.identifier), f"{what}: a new table was created"
            assert case.batch(bid).status != "committed"
    case.raw["sink"] = original
    case.write_config()
    assert run_batch(spark, case.cfg, bid, case.dsn,
                     accept_config_change=True).result.status == "committed"
    case.assert_exactly_once()


def test_a_replaced_table_is_refused_until_the_operator_adopts_it(
        case: IcebergCase, spark: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Dropped and created again under the same name (same schema: only its table-uuid
    tells), while batch 2 is committed in the old table and not in the ledger (its driver
    died between the two commits): refused naming both uuids and `adopt-table`;
    maintenance refuses and deletes nothing. `offsetflow adopt-table` records the new table
    (saying the history stays in the old one); batch 2 is then written into the new table
    (its parts, written for the old one, refused once and written again), and neither the
    sweep after it (the batch's prefix) nor the maintenance sweep deletes the old table's
    files: its metadata registered under another name still reads batches 1 and 2."""
    case.workload.mixed(400, random.Random(75))
    run_until_caught_up(case.cfg, case.dsn, spark)
    bid = case.planned_batch(200, seed=76)
    case.died_between_the_commits(spark, bid, "iceberg")
    before = case.positions()
    ident, catalog = _ident(case), _catalog(case)
    old = catalog.load_table(ident)
    assert snapshot_batches(case.cfg, case.dsn)[-1] == bid  # in the old table only
    old_rows = len(iceberg_sink_rows(case.cfg, case.dsn))
    catalog.drop_table(ident)
    new = catalog.create_table(ident, schema=old.schema(), partition_spec=old.spec(),
                               sort_order=old.sort_order(), properties=old.properties)
    assert new.location() == old.location()  # the same folder
    old_files = case.data_files()
    msg = _refused(case, spark, ident, str(old.metadata.table_uuid),
                   str(new.metadata.table_uuid), "adopt-table")
    assert catalog.load_table(ident).current_snapshot() is None, "written into the new table"
    assert maint(["--pipeline-file", str(case.file), "--dsn", case.dsn,
                  "--orphans-older-than-hours", "0"]) == 2
    assert case.data_files() == old_files, msg
    capsys.readouterr()
    assert cli(["--dsn", case.dsn, "adopt-table", "--pipeline-file", str(case.file),
                "--reason", "replaced on purpose"]) == 0
    out = capsys.readouterr().out
    assert str(new.metadata.table_uuid) in out and str(old.metadata.table_uuid) in out, out
    assert "stay in the table recorded before" in out, out
    with pytest.raises(IcebergTableReplacedError):  # its parts' files are the old table's
        run_until_caught_up(case.cfg, case.dsn, spark)
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.batch(bid).status == "committed"
    after = case.positions()
    assert len(iceberg_sink_rows(case.cfg, case.dsn)) == sum(
        1 for p in case.workload.produced.values() if p.committed
        and before[(p.topic, p.partition)] <= p.offset < after[(p.topic, p.partition)])
    assert old_files <= case.data_files(), "the batch's sweep deleted the old table's files"
    assert maint(["--pipeline-file", str(case.file), "--dsn", case.dsn,
                  "--orphans-older-than-hours", "0"]) == 0
    assert old_files <= case.data_files(), "the sweep deleted the old table's files"
    catalog.register_table(f"{ident}_old", old.metadata_location)
    assert len(catalog.load_table(f"{ident}_old").scan().to_arrow()) == old_rows


def test_a_table_registered_from_older_metadata_is_refused_naming_the_ledgers(
        case: IcebergCase, spark: Any) -> None:
    """Re-registered from a metadata file older than the ledger's last commit (the same
    table-uuid and location, but without the later batches): refused naming the metadata
    file of the ledger's last commit; registered from that one, the pipeline goes on."""
    case.workload.mixed(300, random.Random(77))
    run_until_caught_up(case.cfg, case.dsn, spark)
    ident, catalog = _ident(case), _catalog(case)
    first = catalog.load_table(ident).metadata_location
    case.workload.mixed(300, random.Random(78))
    run_until_caught_up(case.cfg, case.dsn, spark)
    latest = catalog.load_table(ident).metadata_location
    assert len(snapshot_batches(case.cfg, case.dsn)) == 2
    catalog.drop_table(ident)
    catalog.register_table(ident, first)  # a restore from the wrong file
    case.workload.mixed(100, random.Random(79))
    _refused(case, spark, ident, latest)
    catalog.drop_table(ident)
    catalog.register_table(ident, latest)
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_a_renamed_table_is_refused_and_found_again_under_its_new_name(
        case: IcebergCase, spark: Any) -> None:
    """Renamed in the catalog: the configured name finds no table (refused, not created
    again); `sink.table` set to the new name finds the ledger's very table (its uuid and
    location), which is taken without an adopt."""
    case.workload.mixed(300, random.Random(80))
    run_until_caught_up(case.cfg, case.dsn, spark)
    ident, catalog = _ident(case), _catalog(case)
    catalog.rename_table(ident, f"{ident}_renamed")
    case.workload.mixed(200, random.Random(81))
    _refused(case, spark, ident)
    assert not catalog.table_exists(ident)
    case.raw["sink"]["table"] = f"lake.{case.table}_renamed"
    case.write_config()
    open_batch = plan_only(case.cfg, case.dsn).batch  # the refused one, planned before
    assert open_batch is not None
    assert run_batch(spark, case.cfg, open_batch.batch_id, case.dsn,
                     accept_config_change=True).result.status == "committed"
    case.assert_exactly_once()


def test_a_table_replaced_while_the_commit_retries_is_never_written(
        case: IcebergCase, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver (the stage path: a transform) built its append on the ledger's table;
    the table is dropped and created again right before the catalog commit. The commit
    asserts the old table-uuid and conflicts; the retry after the refresh must not append
    the batch into the new table: refused (the identity error, not pyiceberg's ValueError
    of the refresh, as before), nothing moved, the new table empty."""
    from offsetflow.sinks.iceberg import commit

    case.raw["transform"] = "tests.tooling.chaos.maybe_fail_task"  # rows pass unchanged
    case.write_config()
    case.workload.mixed(300, random.Random(82))
    run_until_caught_up(case.cfg, case.dsn, spark)
    bid = case.planned_batch(200, seed=83)
    before = case.positions()
    ident, catalog = _ident(case), _catalog(case)

    def replace(point: str) -> None:  # another session drops and creates the table
        if point == "after-files" and catalog.load_table(ident).current_snapshot():
            old = catalog.load_table(ident)
            catalog.drop_table(ident)
            catalog.create_table(ident, schema=old.schema(), partition_spec=old.spec(),
                                 sort_order=old.sort_order(), properties=old.properties)
    monkeypatch.setattr(commit, "_fault", replace)
    with pytest.raises(OffsetFlowError) as ei:
        run_batch(spark, case.cfg, bid, case.dsn)
    assert ei.type.__name__ == IDENTITY_ERROR, ei.value
    assert catalog.load_table(ident).current_snapshot() is None, \
        "the batch was appended into the new table"
    assert case.positions() == before
    assert case.batch(bid).status != "committed"
    assert "is not the table the ledger's batches live in" in (case.batch(bid).error or "")


def test_orphan_sweep_keeps_the_files_another_table_at_the_same_location_references(
        case: IcebergCase) -> None:
    """A table dropped (files kept) and another created at its location: a sweep of the
    new one must not take the old one's data files for orphans, or registering the old
    metadata again fails (FileNotFoundError). No Spark: two pyiceberg appends."""
    ident, catalog = _ident(case), _catalog(case)
    catalog.create_namespace_if_not_exists("lake")
    schema = pa.schema([("topic", pa.string()), ("partition", pa.int32()),
                        ("offset", pa.int64()), (LINEAGE_COLUMN, pa.int64())])
    old = catalog.create_table(ident, schema=schema)
    old.append(pa.table({"topic": ["t"], "partition": pa.array([0], pa.int32()),
                         "offset": [1], LINEAGE_COLUMN: [1]}, schema=schema))
    old_meta = old.metadata_location
    catalog.drop_table(ident)
    new = catalog.create_table(ident, schema=schema)
    assert new.location() == old.location()
    new.append(pa.table({"topic": ["t"], "partition": pa.array([0], pa.int32()),
                         "offset": [2], LINEAGE_COLUMN: [2]}, schema=schema))
    files = case.data_files()
    assert len(files) == 2
    assert remove_orphan_files(catalog.load_table(ident), older_than_s=0) == []
    assert case.data_files() == files
    catalog.register_table(f"{ident}_old", old_meta)
    assert catalog.load_table(f"{ident}_old").scan().to_arrow()["offset"].to_pylist() == [1]


def test_older_metadata_registered_then_written_past_the_ledgers_sequence_is_refused(
        case: IcebergCase, spark: Any) -> None:
    """Review: registered from a metadata file older than the ledger's last commit, and then
    written by another writer until its last-sequence-number reached the ledger's again, the
    table passed the check (the ledger's last snapshot not found was taken for expired), so
    the run carried on without the ledger's later batches (lost from the table). The history
    reached from main at or below the ledger's sequence number without its last snapshot is
    a fork: refused like the older metadata it started from."""
    case.workload.mixed(300, random.Random(81))
    run_until_caught_up(case.cfg, case.dsn, spark)
    ident, catalog = _ident(case), _catalog(case)
    first = catalog.load_table(ident).metadata_location
    case.workload.mixed(300, random.Random(82))
    run_until_caught_up(case.cfg, case.dsn, spark)
    latest = catalog.load_table(ident)
    target = int(latest.metadata.last_sequence_number)
    catalog.drop_table(ident)
    table = catalog.register_table(ident, first)  # a restore from the wrong file
    while int(table.metadata.last_sequence_number) < target:  # another writer goes on
        with table.transaction() as txn, \
                txn.update_snapshot().fast_append():
            pass
        table = catalog.load_table(ident)
    case.workload.mixed(100, random.Random(83))
    _refused(case, spark, ident, latest.metadata_location)
    catalog.drop_table(ident)
    catalog.register_table(ident, latest.metadata_location)
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_main_rolled_back_past_the_ledgers_batch_and_expired_is_refused(
        case: IcebergCase, spark: Any) -> None:
    """Review: main rolled back past the ledger's last batch is refused while that snapshot
    is in the table (off main); once the rolled-back snapshot was expired too, it was taken
    for an ordinary expiry and the run carried on without that batch's rows (lost). Main's
    chain reaching an older snapshot without it is refused the same."""
    case.workload.mixed(300, random.Random(84))
    run_until_caught_up(case.cfg, case.dsn, spark)
    ident, catalog = _ident(case), _catalog(case)
    table = catalog.load_table(ident)
    first = table.current_snapshot().snapshot_id
    case.workload.mixed(300, random.Random(85))
    run_until_caught_up(case.cfg, case.dsn, spark)
    table = catalog.load_table(ident)
    latest, second = table.metadata_location, table.current_snapshot().snapshot_id
    table.manage_snapshots().rollback_to_snapshot(first).commit()
    table = catalog.load_table(ident)
    table.maintenance.expire_snapshots().by_ids([second]).commit()
    case.workload.mixed(100, random.Random(86))
    _refused(case, spark, ident, latest)
