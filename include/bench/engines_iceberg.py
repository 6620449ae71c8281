"""The Iceberg sink in the benchmark (issue 17): the same ranges into an Iceberg table.

  offsetflow-iceberg  plan + read + stage + one Iceberg snapshot per batch
                      (`sink.type: iceberg`, pyiceberg SQL catalog in the bench database,
                      a file warehouse under the results folder), warm local Spark.

Every run writes a fresh table, is checked by a pyiceberg scan (row count, distinct
coordinates, the quantity checksum, no null payloads) and the table is purged afterwards.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc
from dataset import DataSet
from engines import expected_quantity_sum, offsetflow_config, timed_batch

from offsetflow.config import parse_pipeline
from offsetflow.sinks.iceberg.sink import load_catalog

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

NAMESPACE = "offsetflow_bench"


def iceberg_config(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    raw = offsetflow_config(ds, name, "OFFSETFLOW_BENCH_DSN", ctx["bootstrap"], "submit",
                            ctx["connect_url"], ctx["max_offsets_per_task"])
    warehouse = Path(ctx["out_dir"]) / "iceberg-warehouse"
    warehouse.mkdir(parents=True, exist_ok=True)
    raw["sink"] = {"type": "iceberg", "connection": "${OFFSETFLOW_BENCH_DSN}",
                   "table": f"{NAMESPACE}.{name}",
                   "catalog": {"name": "bench", "warehouse": f"file://{warehouse}"}}
    return raw


def offsetflow_iceberg_run(spark: SparkSession, ds: DataSet, name: str, ctx: dict[str, Any]
                           ) -> dict[str, Any]:
    cfg = parse_pipeline(iceberg_config(ds, name, ctx), f"<bench {name}>", os.environ)
    return {**timed_batch(spark, cfg, ds, ctx), **verify_and_purge(cfg, ctx["dsn"], ds)}


def verify_and_purge(cfg: Any, dsn: str, ds: DataSet) -> dict[str, Any]:
    """The run counts only if the table holds each record exactly once with its payload."""
    catalog = load_catalog(cfg.sink.iceberg, dsn)
    ident = cfg.sink.iceberg.identifier
    data = catalog.load_table(ident).scan(
        selected_fields=("partition", "offset", "quantity", "event_id", "value")).to_arrow()
    rows = data.num_rows
    distinct = len(set(zip(data["partition"].to_pylist(), data["offset"].to_pylist(),
                           strict=True)))
    qsum = int(pc.sum(data["quantity"]).as_py() or 0)
    nulls = data["event_id"].null_count + data["value"].null_count
    catalog.purge_table(ident)
    want = expected_quantity_sum(ds.records)
    if rows != ds.records or distinct != ds.records or qsum != want or nulls:
        raise AssertionError(f"{ident}: {rows} rows, {distinct} distinct offsets, quantity sum "
                             f"{qsum}, {nulls} null payloads; expected {ds.records} rows and "
                             f"quantity sum {want}")
    return {"verified_rows": rows}
