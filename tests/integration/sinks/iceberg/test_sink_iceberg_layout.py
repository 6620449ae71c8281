"""Issue 28 class 4: the docs' Iceberg config runs as written (its partition transforms
need pyiceberg-core, pinned in requirements.txt), and a partition spec this runtime cannot
compute is refused before a table is created with it, or, for a table that has it already,
before anything is written, naming the field or the table and the way out."""

from __future__ import annotations

import os
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.errors import ConfigError, IcebergLayoutError
from offsetflow.job import run_batch
from offsetflow.ops import plan_only, run_until_caught_up
from offsetflow.sinks.iceberg.sink import load_catalog
from tests.tooling.iceberg_case import IcebergCase
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches

DOCS = Path(__file__).resolve().parents[4] / "docs" / "sinks" / "iceberg.md"


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> IcebergCase:
    return IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, make_topic("icel", 2), 2, unique)


def _docs_sink() -> dict[str, Any]:
    """The `sink:` of the docs page's first yaml example (the Iceberg config)."""
    block = re.search(r"^```yaml\n(.*?)^```", DOCS.read_text(), re.M | re.S)
    assert block is not None
    sink = yaml.safe_load(block.group(1))["sink"]
    assert sink["type"] == "iceberg"
    return dict(sink)


def test_the_docs_iceberg_config_runs_as_written(case: IcebergCase, spark: Any) -> None:
    """Its partition_by (`day(timestamp)`, `bucket(16, event_id)`, `partition`) and sort_by,
    as printed: only where it connects and which table it writes are the test's."""
    sink = _docs_sink()
    sink.update(connection=case.dsn, table=f"lake.{case.table}")
    sink["catalog"] = {**sink["catalog"], "warehouse": f"file://{case.warehouse}"}
    case.raw["sink"] = sink
    case.write_config()
    case.workload.mixed(400, random.Random(60))
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()
    table = iceberg_table(case.cfg, case.dsn)
    assert [(f.name, str(f.transform)) for f in table.spec().fields] == [
        ("timestamp_day", "day"), ("event_id_bucket", "bucket[16]"),
        ("partition", "identity")]
    assert [table.schema().find_column_name(f.source_id)
            for f in table.sort_order().fields] == ["event_id", "offset"]


def test_a_transform_this_runtime_cannot_compute_creates_no_table(
        case: IcebergCase, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pyiceberg-core (hidden here) `bucket(4, event_id)` cannot be computed: the
    batch stops naming the field before the table is created, so editing partition_by is
    the way out (on main the table was created with the spec first, and failed forever)."""
    monkeypatch.setitem(sys.modules, "pyiceberg_core", None)
    case.raw["sink"]["partition_by"] = ["partition", "bucket(4, event_id)"]
    case.write_config()
    bid = case.planned_batch(200, seed=61)
    with pytest.raises(ConfigError, match=(
            rf"{re.escape(str(case.file))}: sink.partition_by\[1\]: 'bucket\(4, event_id\)' "
            rf"cannot be computed here \(NotInstalledError: pyiceberg_core needs to be "
            rf"installed.*\); nothing was created. Install pyiceberg-core==")):
        run_batch(spark, case.cfg, bid, case.dsn)
    assert case.cfg.sink.iceberg is not None
    assert not load_catalog(case.cfg.sink.iceberg, case.dsn).table_exists(
        case.cfg.sink.iceberg.identifier)
    case.raw["sink"]["partition_by"] = ["partition"]  # the way out the error names
    case.write_config()
    # partition_by shapes only a new table: not a config change of the batch
    assert run_batch(spark, case.cfg, bid, case.dsn).result.status == "committed"
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def test_a_table_whose_spec_this_runtime_cannot_compute_is_refused_before_writing(
        case: IcebergCase, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table made with a transform (by an earlier release, or another tool) where
    pyiceberg-core is missing: refused naming the table, its field and the way out,
    before anything is read or written."""
    from pyiceberg.transforms import BucketTransform

    case.workload.mixed(200, random.Random(62))
    run_until_caught_up(case.cfg, case.dsn, spark)  # partitioned by `partition`
    table = iceberg_table(case.cfg, case.dsn)
    with table.update_spec() as spec:  # what e.g. Spark's ADD PARTITION FIELD does
        spec.add_field("event_id", BucketTransform(8), "event_id_bucket")
    monkeypatch.setitem(sys.modules, "pyiceberg_core", None)
    snaps = snapshot_batches(case.cfg, case.dsn)
    positions = case.positions()
    bid = case.planned_batch(100, seed=63)
    with pytest.raises(IcebergLayoutError, match=(
            rf"Iceberg table lake\.{case.table} is partitioned by bucket\[8\]\(event_id\) "
            rf"\(partition field 1, 'event_id_bucket'\), which cannot be computed here "
            rf"\(NotInstalledError: .*\); nothing was written. Install pyiceberg-core==.*, "
            rf"or evolve the table's partition spec")):
        run_batch(spark, case.cfg, bid, case.dsn)
    assert snapshot_batches(case.cfg, case.dsn) == snaps
    assert case.positions() == positions
    monkeypatch.undo()  # pyiceberg-core back: the batch commits once
    pytest.importorskip("pyiceberg_core")
    assert run_batch(spark, case.cfg, bid, case.dsn).result.status == "committed"
    case.assert_exactly_once()


@pytest.mark.slow
def test_a_spark_worker_without_pyiceberg_core_is_one_error_naming_the_way_out(
        case: IcebergCase, spark: Any, tmp_path: Path) -> None:
    """The driver can compute the spec but the Spark workers cannot (pyiceberg-core not
    installed where they run): the tasks report it, the job prints it once, nothing is
    committed, and a run whose workers have it commits the batch once."""
    hidden = tmp_path / "no-core" / "pyiceberg_core"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ImportError('pyiceberg-core is not installed on this worker (test)')\n")
    case.raw["sink"]["partition_by"] = ["bucket(4, event_id)"]
    case.raw["spark"]["conf"] = {"spark.executorEnv.PYTHONPATH": os.pathsep.join(
        [str(hidden.parent), os.environ.get("PYTHONPATH", "")])}
    case.write_config()
    case.workload.plain(300)
    planned = plan_only(case.cfg, case.dsn).batch
    assert planned is not None
    proc = case.job(planned.batch_id)
    assert proc.wait(timeout=600) == 2, case.job_output()[-3000:]
    out = case.job_output()
    errors = [line for line in out.splitlines() if line.startswith("offsetflow: error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-4000:]
    assert re.search(rf"batch {planned.batch_id}: the Spark worker of part \d+ cannot compute "
                     rf"the partition spec of Iceberg table lake\.{case.table} .*pyiceberg_core "
                     rf"needs to be installed.*; nothing was committed. Install "
                     rf"pyiceberg-core==0.10.1 where the Spark workers run", errors[0]), errors
    assert snapshot_batches(case.cfg, case.dsn) == []
    assert set(case.positions().values()) == {0}
    assert run_batch(spark, case.cfg, planned.batch_id, case.dsn).result.status == "committed"
    case.assert_exactly_once()
