"""The transform path's staging layout on real services (review item 4): Spark's partitions
of a transform's output are the stage parts, so a changed `spark.sql.shuffle.partitions`
between attempts of a batch must drop earlier staging, never commit half of it or wedge."""

from __future__ import annotations

from typing import Any

import pytest

from offsetflow.job import run_batch
from offsetflow.runner import plan_only
from tests.integration.helpers import pipeline_for, produce_plain, query

FAIL_CONF = "offsetflow.test.fail_upper_half"


def repartition_by_conf(df: Any) -> Any:
    """Shuffles into spark.sql.shuffle.partitions parts (explicit, so AQE keeps the count);
    with FAIL_CONF set, the upper half of them fails, as a task killed mid-batch would."""
    from pyspark.sql import functions as F

    conf = df.sparkSession.conf
    n = int(conf.get("spark.sql.shuffle.partitions"))
    out = df.repartition(n)
    if conf.get(FAIL_CONF, "false") == "true":
        out = out.withColumn("value", F.when(F.spark_partition_id() >= n // 2,
                                             F.raise_error(F.lit("injected task failure")))
                             .otherwise(F.col("value")))
    return out


def test_changed_shuffle_partitions_between_attempts_restage_the_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("lay", 1)
    produce_plain(kafka_bootstrap, topic, 400, f"ly{unique}", 1)
    table = f"lay_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=50,
                       transform="tests.integration.test_commit_layout.repartition_by_conf")
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    before = spark.conf.get("spark.sql.shuffle.partitions")
    try:
        spark.conf.set("spark.sql.shuffle.partitions", "8")
        spark.conf.set(FAIL_CONF, "true")
        with pytest.raises(Exception, match="injected task failure"):
            run_batch(spark, cfg, bid, pg_dsn)
        staged = query(pg_dsn, "SELECT count(*) FROM offsetflow.staged_parts "
                               "WHERE batch_id = %s AND kind = 'rows'", (bid,))[0][0]
        assert 0 < staged < 8  # the lower parts were staged before the job failed
        spark.conf.set(FAIL_CONF, "false")
        spark.conf.set("spark.sql.shuffle.partitions", "4")
        assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)
        spark.conf.unset(FAIL_CONF)
    got = query(pg_dsn, f"SELECT count(*), count(DISTINCT \"offset\") FROM {table}")[0]
    assert got == (400, 400)
