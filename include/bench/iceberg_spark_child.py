"""Runs inside the Iceberg Spark environment (`iceberg_spark.py`): pyspark 4.1 with Iceberg's
Spark runtime, no OffsetFlow import (that environment has only pyspark, pyarrow, pandas).

    python iceberg_spark_child.py bench <spec.json>   Spark's built-in Kafka source writing
                                                      Iceberg tables (one untimed warm-up,
                                                      then the timed runs)
    python iceberg_spark_child.py sql <spec.json>     run SQL statements, print rows as JSON

The spec carries the Spark conf (the Iceberg catalog's keys among it). A jar Ivy cannot
resolve stops the JVM; the caller finds Ivy's report in this process's output
(`iceberg_spark.child_result`) and skips instead of failing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def session(conf: dict[str, str]) -> Any:
    from pyspark.sql import SparkSession

    b = SparkSession.builder.master("local[2]").appName("offsetflow-iceberg-spark")
    for k, v in conf.items():
        b = b.config(k, v)
    s = b.getOrCreate()
    s.sparkContext.setLogLevel("WARN")
    return s


def kafka_to_iceberg(spark: Any, run: dict[str, Any], spec: dict[str, Any]) -> float:
    """Spark's Kafka batch source over exactly the run's ranges -> from_json -> the same
    columns as OffsetFlow's table -> DataFrameWriterV2 append (one Iceberg commit)."""
    from pyspark.sql import functions as F

    t0 = time.perf_counter()
    df = (spark.read.format("kafka")
          .option("kafka.bootstrap.servers", spec["bootstrap"])
          .option("kafka.isolation.level", "read_committed")
          .option("subscribe", run["topic"])
          .option("startingOffsets", json.dumps(run["starting"]))
          .option("endingOffsets", json.dumps(run["ending"]))
          .option("includeHeaders", "true")
          .option("failOnDataLoss", "true")
          .option("minPartitions", str(run["tasks"]))
          .load())
    parsed = df.select(
        "topic", "partition", "offset", "timestamp",
        F.col("timestampType").alias("timestamp_type"), "key", "value",
        F.to_json("headers").alias("headers"),
        F.from_json(F.col("value").cast("string"), spec["ddl"]).alias("d"),
    ).select("*", "d.*").drop("d").withColumn(spec["lineage_column"], F.lit(0).cast("bigint"))
    parsed.writeTo(run["table"]).append()
    return time.perf_counter() - t0


def main(mode: str, spec_path: str) -> int:
    spec: dict[str, Any] = json.loads(Path(spec_path).read_text())
    out = Path(spec["result_file"])
    t = time.perf_counter()
    spark = session(spec["conf"])
    start_s = time.perf_counter() - t
    if mode == "sql":
        rows = [[r.asDict() for r in spark.sql(q).collect()] for q in spec["statements"]]
        out.write_text(json.dumps({"results": rows}, default=str))
    else:
        walls = [kafka_to_iceberg(spark, run, spec) for run in spec["runs"]]
        out.write_text(json.dumps({"spark_start_s": round(start_s, 3), "wall_s": walls}))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
