"""Spark's own path into Iceberg in the benchmark (issue 17), beside `offsetflow-iceberg`:

  spark-builtin-iceberg  Spark's Kafka batch source over the same ranges -> from_json ->
                         the same columns -> `writeTo(table).append()` through Iceberg's
                         Spark runtime and JDBC catalog (the same SQL catalog in the bench
                         database and the same warehouse as offsetflow-iceberg; one Iceberg
                         commit per run, at-least-once: a failed job run again appends again).

It runs on pyspark 4.1 in an environment of its own (`iceberg_spark.py` says why: no
Iceberg runtime loads on Spark 4.2), so the ratio to OffsetFlow also spans a Spark minor
version. Each run's table is created first by pyiceberg with the schema OffsetFlow's sink
gives the same data set, and is checked and purged afterwards as offsetflow-iceberg's are.
When the environment or a jar cannot be fetched, the engine is skipped with the reason
(the rest of the bench goes on).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dataset import DataSet
from engines import TARGET_COLUMNS, run_name, spark_ddl
from engines_iceberg import NAMESPACE, iceberg_config, verify_and_purge
from iceberg_spark import (
    IcebergSparkUnavailable,
    child_result,
    ensure_env,
    spark_conf,
    start_child,
)
from rss import PeakRss

from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.config import parse_pipeline
from offsetflow.ranges import split_ranges
from offsetflow.sinks.iceberg.sink import load_catalog
from offsetflow.sinks.iceberg.stage import arrow_schema

ENGINE = "spark-builtin-iceberg"
CATALOG = "bench"  # offsetflow-iceberg's sink.catalog.name (engines_iceberg.iceberg_config)
log = logging.getLogger("bench.iceberg_spark")


def _run_spec(ds: DataSet, name: str, ctx: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A fresh table for one run (as OffsetFlow's sink would create it) and the child's
    description of the run."""
    cfg = parse_pipeline(iceberg_config(ds, name, ctx), f"<bench {name}>", os.environ)
    ice = cfg.sink.iceberg
    assert ice is not None and ice.catalog_name == CATALOG
    catalog = load_catalog(ice, ctx["dsn"])
    catalog.create_namespace_if_not_exists(NAMESPACE)
    # the stage's columns are the target's: headers (jsonb) become JSON text, as in the sink
    catalog.create_table(ice.identifier, arrow_schema(TARGET_COLUMNS))
    return cfg, {"table": f"{CATALOG}.{ice.identifier}",
                 "starting": {ds.topic: {str(r.partition): r.from_offset for r in ds.ranges}},
                 "ending": {ds.topic: {str(r.partition): r.until_offset for r in ds.ranges}}}


def builtin_iceberg_engine(jobs: list[tuple[str, DataSet, int]], warmup: DataSet,
                           ctx: dict[str, Any]) -> dict[str, Any]:
    """The engine's result document (as worker.py writes it), or {"skipped": reason}."""
    try:
        python = ensure_env()
    except IcebergSparkUnavailable as e:
        return {"engine": ENGINE, "skipped": str(e), "results": []}
    plan = [("warmup", warmup, i) for i in range(int(ctx.get("warmup_runs", 1)))] \
        + [(label, ds, i) for label, ds, n in jobs for i in range(n)]
    cfgs, runs = [], []
    for label, ds, i in plan:
        cfg, run = _run_spec(ds, run_name(ENGINE, label, i), ctx)
        cfgs.append(cfg)
        # the same number of Spark tasks as OffsetFlow splits the ranges into
        runs.append({**run, "topic": ds.topic,
                     "tasks": len(split_ranges(ds.ranges, ctx["max_offsets_per_task"]))})
    spec = {"conf": spark_conf(CATALOG, ctx["dsn"],
                               f"file://{Path(ctx['out_dir']) / 'iceberg-warehouse'}",
                               kafka=True),
            "bootstrap": ctx["bootstrap"], "ddl": spark_ddl(),
            "lineage_column": LINEAGE_COLUMN, "runs": runs}
    proc, result = start_child(python, "bench", spec, Path(ctx["out_dir"]) / ENGINE)
    try:
        with PeakRss([proc.pid]) as rss:
            doc = child_result(proc, result)
    except IcebergSparkUnavailable as e:
        for cfg in cfgs:
            load_catalog(cfg.sink.iceberg, ctx["dsn"]).purge_table(cfg.sink.iceberg.identifier)
        return {"engine": ENGINE, "skipped": str(e), "results": []}
    results = []
    for (label, ds, i), cfg, wall in zip(plan, cfgs, doc["wall_s"], strict=True):
        checked = verify_and_purge(cfg, ctx["dsn"], ds)
        if label == "warmup":
            continue
        results.append({**rss.as_dict(), **checked, "engine": ENGINE, "label": label, "run": i,
                        "records": ds.records, "partitions": ds.partitions,
                        "records_per_s": round(ds.records / wall, 1), "wall_s": round(wall, 3),
                        "stages": {"plan_s": 0.0, "spark_start_s": 0.0,
                                   "read_parse_write_s": round(wall, 3)}})
        log.info("%s %s run %d: %d records in %.2fs = %.0f records/s", ENGINE, label, i + 1,
                 ds.records, wall, ds.records / wall)
    return {"engine": ENGINE, "spark_start_s": doc["spark_start_s"], "results": results}
