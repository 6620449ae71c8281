"""The README's recipes for reading an Iceberg table OffsetFlow wrote (issue 17), run for real:
Spark SQL through Iceberg's Spark runtime and JDBC catalog (the same catalog tables as the
sink's pyiceberg SQL catalog), and DuckDB over a pyiceberg scan, must read back exactly the
rows the pyiceberg checker reads (count and a digest of every row's coordinates and payload).

Spark SQL runs in the Iceberg Spark environment (`include/bench/iceberg_spark.py`: pyspark
4.1, as no Iceberg runtime loads on Spark 4.2); it is created once with uv and its jars are
fetched once into Ivy's cache. Without network for either, the Spark SQL test is skipped,
naming what could not be fetched."""

from __future__ import annotations

import hashlib
import random
import sys
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from offsetflow.ops import run_until_caught_up
from tests.tooling.iceberg_case import IcebergCase, window
from tests.tooling.iceberg_rows import iceberg_sink_rows, iceberg_table
from tests.tooling.registry_case import new_topic

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "include" / "bench"))
from iceberg_spark import (  # noqa: E402  (include/bench is not a package)
    IcebergSparkUnavailable,
    ensure_env,
    run_sql,
    spark_conf,
)

COLUMNS = ("topic", "partition", "offset", "event_id", "checksum")


def digest(rows: Iterable[Sequence[Any]]) -> tuple[int, str]:
    """(count, sha256 of the sorted rows): equal only if both hold the same rows, each the
    same number of times."""
    lines = sorted("|".join(str(v) for v in r) for r in rows)
    return len(lines), hashlib.sha256("\n".join(lines).encode()).hexdigest()


@pytest.fixture(scope="module")
def written(tmp_path_factory: Any, pg_dsn: str, kafka_bootstrap: str, spark: Any
            ) -> IcebergCase:
    """A table OffsetFlow wrote: several batches, then a replay of part of it (a delete and
    an append in one commit), so readers must apply deletes too. Built once for both
    readers: DuckDB only reads it; the Spark SQL test, which compacts it and writes on top,
    runs after it (and reads the checker, not a count fixed before)."""
    case = IcebergCase(tmp_path_factory.mktemp("readers"), pg_dsn, kafka_bootstrap,
                       new_topic(kafka_bootstrap, "icer", 2), 2, uuid.uuid4().hex[:8])
    case.raw["sink"]["catalog"]["name"] = "lake"  # readers use the sink's catalog name
    case.raw["source"]["max_records_per_partition"] = 400
    case.write_config()
    case.workload.mixed(900, random.Random(17))
    assert run_until_caught_up(case.cfg, case.dsn, spark)
    assert len(window(case, spark, "replay", partitions="0", from_offset=0,
                       until_offset=200)) == 1
    case.assert_exactly_once()
    return case


def checker_digest(case: IcebergCase) -> tuple[int, str]:
    return digest((r.topic, r.partition, r.offset, r.record_id, r.checksum)
                  for r in iceberg_sink_rows(case.cfg, case.dsn))


def test_duckdb_reads_the_same_rows_as_the_checker(written: IcebergCase) -> None:
    """README: `table.scan().to_duckdb(...)` (pyiceberg plans the scan, deletes applied;
    DuckDB's own iceberg extension needs a download this recipe does not)."""
    table = iceberg_table(written.cfg, written.dsn)
    con = table.scan(selected_fields=COLUMNS).to_duckdb(table_name="events")
    rows = con.execute('SELECT topic, "partition", "offset", event_id, checksum '
                       "FROM events").fetchall()
    want = checker_digest(written)
    assert want[0] == written.workload.committed_count
    assert digest(rows) == want


@pytest.mark.slow
def test_spark_sql_reads_the_same_rows_as_the_checker_and_compacts_the_table(
        written: IcebergCase, tmp_path: Path, spark: Any) -> None:
    """README: Spark SQL with iceberg-spark-runtime and Iceberg's JDBC catalog on the
    catalog's PostgreSQL, named as `sink.catalog.name`; then the README's compaction
    (`rewrite_data_files`) changes no row, and OffsetFlow's next batches land once on top."""
    ice = written.cfg.sink.iceberg
    assert ice is not None
    tbl = f"{ice.catalog_name}.{ice.identifier}"
    select = f"SELECT topic, `partition`, `offset`, event_id, checksum FROM {tbl}"
    try:
        python = ensure_env()
        conf = spark_conf(ice.catalog_name, written.dsn, ice.properties["warehouse"])
        rows, count, batches, rewrite, after = run_sql(python, conf, [
            select, f"SELECT count(*) AS n FROM {tbl}",
            f"SELECT summary['offsetflow.batch-id'] AS batch FROM {tbl}.snapshots",
            # the table named in full: 'lake.t' would be read as catalog lake, table t
            f"CALL {ice.catalog_name}.system.rewrite_data_files(table => '{tbl}', "
            f"options => map('min-input-files', '2'))",
            select], tmp_path / "spark-sql")
    except IcebergSparkUnavailable as e:
        pytest.skip(f"Iceberg's Spark runtime could not be fetched: {e}")
    want = checker_digest(written)
    assert digest([r[c] for c in COLUMNS] for r in rows) == want
    assert count == [{"n": want[0]}]
    assert len(batches) > 1 and all(b["batch"] is not None for b in batches)  # all OffsetFlow's
    assert rewrite[0]["rewritten_data_files_count"] > rewrite[0]["added_data_files_count"] > 0
    assert digest([r[c] for c in COLUMNS] for r in after) == want == checker_digest(written)
    # the compaction's replace snapshot is on top of main; the sink's next batch finds its
    # base moved, commits on top of it, and the whole table is still each record once
    written.workload.mixed(300, random.Random(18))
    assert run_until_caught_up(written.cfg, written.dsn, spark)
    written.assert_exactly_once()
