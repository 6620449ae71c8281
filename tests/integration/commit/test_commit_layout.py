"""The transform path's staging layout on real services (review item 4): Spark's partitions
of a transform's output are the stage parts, so a changed `spark.sql.shuffle.partitions`
between attempts of a batch must drop earlier staging, never commit half of it or wedge."""

from __future__ import annotations

from typing import Any

import pytest

from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import pipeline_for, produce_plain, query

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
                       transform="tests.integration.commit.test_commit_layout.repartition_by_conf")
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


def repartition_by_offset(df: Any) -> Any:
    """A shuffle AQE may coalesce (by column, no count): how many parts the output has, and
    which rows each holds, follows the data's size, the advisory partition size and (by
    default) the core count. With FAIL_CONF set, parts from 4 on fail."""
    from pyspark.sql import functions as F

    out = df.repartition("offset")
    if df.sparkSession.conf.get(FAIL_CONF, "false") == "true":
        out = out.withColumn("value", F.when(F.spark_partition_id() >= 4,
                                             F.raise_error(F.lit("injected task failure")))
                             .otherwise(F.col("value")))
    return out


def test_aqe_coalescing_another_way_on_the_retry_restages_the_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The same shuffle settings, but AQE coalesces the retry's shuffle into other parts (here
    by the advisory size; on a cluster the core count does it): none of the first attempt's
    parts may be taken for the retry's part of the same number."""
    topic = make_topic("aqe", 1)
    produce_plain(kafka_bootstrap, topic, 400, f"aq{unique}", 1)
    table = f"aqe_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table,
                       transform="tests.integration.commit.test_commit_layout.repartition_by_offset")
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    keys = {"spark.sql.shuffle.partitions": "16", "spark.sql.adaptive.enabled": "true",
            "spark.sql.adaptive.coalescePartitions.enabled": "true",
            "spark.sql.adaptive.coalescePartitions.parallelismFirst": "false",
            "spark.sql.adaptive.coalescePartitions.minPartitionSize": "1",
            "spark.sql.adaptive.advisoryPartitionSizeInBytes": "1"}
    before = {k: spark.conf.get(k, None) for k in keys}
    try:
        for k, v in keys.items():
            spark.conf.set(k, v)
        spark.conf.set(FAIL_CONF, "true")
        with pytest.raises(Exception, match="injected task failure"):
            run_batch(spark, cfg, bid, pg_dsn)  # 16 parts, the first ones staged
        staged = query(pg_dsn, "SELECT count(*) FROM offsetflow.staged_parts "
                               "WHERE batch_id = %s AND kind = 'rows'", (bid,))[0][0]
        assert 0 < staged < 16
        spark.conf.set(FAIL_CONF, "false")
        spark.conf.set("spark.sql.adaptive.advisoryPartitionSizeInBytes", str(64 << 20))
        assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)
        spark.conf.unset(FAIL_CONF)
    got = query(pg_dsn, f"SELECT count(*), count(DISTINCT \"offset\") FROM {table}")[0]
    assert got == (400, 400)


FAIL_FROM_2 = "offsetflow.test.fail_from_part_2"


def repartition_by_offset_failing_from_2(df: Any) -> Any:
    """repartition_by_offset; with FAIL_FROM_2 set, parts from 2 on fail (on local[2] the
    first two parts are staged before the job dies)."""
    from pyspark.sql import functions as F

    out = df.repartition("offset")
    if df.sparkSession.conf.get(FAIL_FROM_2, "false") == "true":
        out = out.withColumn("value", F.when(F.spark_partition_id() >= 2,
                                             F.raise_error(F.lit("injected task failure")))
                             .otherwise(F.col("value")))
    return out


def test_two_transform_runs_never_share_a_stage_generation(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review F2: a run restarted the stage and stalled; another restarted it again and
    claimed. The first must never stage under the second's generation: the second's tasks
    would skip the parts it staged under another partitioning (8 parts vs 2) and commit a
    quarter of the batch."""
    import threading

    import offsetflow.job.driver as job

    topic = make_topic("gen", 1)
    produce_plain(kafka_bootstrap, topic, 400, f"gn{unique}", 1)
    table = f"gen_{unique}"
    cfg = pipeline_for(
        topic, pg_dsn, kafka_bootstrap, table,
        transform="tests.integration.commit.test_commit_layout.repartition_by_offset_failing_from_2")
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    keys = {"spark.sql.shuffle.partitions": "2", "spark.sql.adaptive.enabled": "false"}
    before = {k: spark.conf.get(k, None) for k in keys}
    held, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    real_gen, real_create = job.stage_generation, job.create_stage_tables
    zombie: threading.Thread | None = None

    def gen(*args: Any, **kw: Any) -> Any:
        if threading.current_thread() is zombie:
            held.set()
            assert go.wait(300)
        return real_gen(*args, **kw)

    def create(*args: Any, **kw: Any) -> Any:
        if threading.current_thread() is not zombie and not go.is_set():
            spark.conf.set("spark.sql.shuffle.partitions", "8")
            spark.conf.set(FAIL_FROM_2, "true")
            go.set()
            assert zombie is not None
            zombie.join(300)
            assert not zombie.is_alive()
            spark.conf.set("spark.sql.shuffle.partitions", "2")
            spark.conf.set(FAIL_FROM_2, "false")
        return real_create(*args, **kw)

    def run_zombie() -> None:
        try:
            run_batch(spark, cfg, bid, pg_dsn)
        except BaseException as e:  # noqa: BLE001 - the zombie is expected to die
            errors.append(e)

    try:
        for k, v in keys.items():
            spark.conf.set(k, v)
        monkeypatch.setattr(job, "stage_generation", gen)
        monkeypatch.setattr(job, "create_stage_tables", create)
        zombie = threading.Thread(target=run_zombie, name="zombie")
        zombie.start()
        assert held.wait(300), errors
        try:
            committed = run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
        except Exception:  # noqa: BLE001 - refused as stale: the zombie restarted after it
            committed = False
        assert errors, "the zombie was meant to die"
        if not committed:
            assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)
        spark.conf.unset(FAIL_FROM_2)
    got = query(pg_dsn, f"SELECT count(*), count(DISTINCT \"offset\") FROM {table}")[0]
    assert got == (400, 400)


def union_with_a_copy(df: Any) -> Any:
    """One-to-many: every record becomes two rows (the copy under another key)."""
    from pyspark.sql import functions as F

    return df.unionByName(df.withColumn("event_id", F.concat(F.col("event_id"), F.lit("-copy"))))


def test_a_transform_emitting_two_rows_per_record_commits(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Review F5: README allows a transform to turn one record into several rows; the
    batch must commit them (upsert on a key the copies do not share), not be refused on
    every run."""
    topic = make_topic("two", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"tw{unique}", 1)
    table = f"two_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"],
                       transform="tests.integration.commit.test_commit_layout.union_with_a_copy")
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT event_id), count(DISTINCT \"offset\") "
                         f"FROM {table}")[0] == (200, 200, 100)
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "already_committed"


def test_a_run_reaching_its_claim_after_another_committed_the_batch_stages_nothing(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review F6: a transform run took the batch up, and another run committed it before
    this one claimed its stage generation. The claim must see the batch is closed: no new
    generation for a committed batch, no read, no stage tables left behind."""
    import offsetflow.job.driver as job

    topic = make_topic("cc", 1)
    produce_plain(kafka_bootstrap, topic, 100, f"cc{unique}", 1)
    table = f"cc_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table,
                       transform="tests.integration.commit.test_commit_layout.union_with_a_copy",
                       mode="upsert", key=["event_id"])
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    real_gen = job.stage_generation
    other: list[Any] = []

    def another_run_commits_first(*args: Any, **kw: Any) -> Any:
        if not other:
            other.append(None)
            other[0] = run_batch(spark, cfg, bid, pg_dsn)  # goes through: `other` is set
        return real_gen(*args, **kw)

    monkeypatch.setattr(job, "stage_generation", another_run_commits_first)
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "already_committed"
    assert other[0].result.status == "committed"
    assert query(pg_dsn, "SELECT to_regclass(%s) IS NULL",
                 (f"offsetflow_stage.b{bid}",))[0][0], "stage tables were left behind"
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 200
