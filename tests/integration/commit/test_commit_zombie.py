"""A zombie attempt (an older run of a batch still working) on real Kafka, PostgreSQL and
Spark: it stages under the batch's old split after a newer run rebuilt the stage for a new
one. The newer run must never skip parts on the strength of the zombie's markers (which name
other offsets under the same part numbers): the batch commits exactly once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import offsetflow.job.driver as job
from offsetflow.config import PipelineConfig
from offsetflow.errors import StagedRowsLostError
from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import (
    pipeline_for,
    produce_plain,
    produce_transactional,
    query,
)

FAIL_CONF = "offsetflow.test.zombie_fails_from_part"


def fail_from_part(df: Any) -> Any:
    """No shuffle, so the output's partitions are the sub-ranges; with FAIL_CONF set, the
    ones from that part on fail (a zombie that staged only its first parts before dying)."""
    from pyspark.sql import functions as F

    first = int(df.sparkSession.conf.get(FAIL_CONF, "-1"))
    if first < 0:
        return df
    return df.withColumn("value", F.when(F.spark_partition_id() >= first,
                                         F.raise_error(F.lit("zombie dies")))
                         .otherwise(F.col("value")))


def _topic_with_records(make_topic: Any, kafka_bootstrap: str, prefix: str, unique: str,
                        partitions: int, records: int) -> tuple[str, str]:
    """A topic with `records` plain records spread over its partitions, and a target name."""
    topic = make_topic(prefix, partitions)
    produce_plain(kafka_bootstrap, topic, records, f"{prefix}{unique}", partitions)
    return topic, f"{prefix}_{unique}"


def _planned(cfg: PipelineConfig, pg_dsn: str) -> int:
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    return planned.batch.batch_id


def _zombie_then(spark: Any, pg_dsn: str, bid: int, old: PipelineConfig,
                 monkeypatch: pytest.MonkeyPatch, before_commit: Callable[[], None] | None = None
                 ) -> list[BaseException]:
    """Start the zombie (a run of `old`) and hold it once it has taken up the batch, right
    before it stages; return a hook for the newer run, which lets the zombie stage (and
    die) once the newer run has rebuilt the stage, and waits for it."""
    zombie_held, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    real_create = job.create_stage_tables
    zombie: threading.Thread | None = None

    def create(*args: Any, **kw: Any) -> Any:
        if threading.current_thread() is zombie:
            zombie_held.set()
            assert go.wait(300)
            return real_create(*args, **kw)
        out = real_create(*args, **kw)  # the newer run: its stage is rebuilt by now
        go.set()
        assert zombie is not None
        zombie.join(300)
        assert not zombie.is_alive()
        if before_commit is not None:
            before_commit()
        return out

    def run_zombie() -> None:
        try:
            run_batch(spark, old, bid, pg_dsn)
        except BaseException as e:  # noqa: BLE001 - the zombie is expected to die
            errors.append(e)

    monkeypatch.setattr(job, "create_stage_tables", create)
    zombie = threading.Thread(target=run_zombie, name="zombie")
    zombie.start()
    assert zombie_held.wait(300), errors
    return errors


def _run_until_committed(spark: Any, cfg: PipelineConfig, bid: int, pg_dsn: str) -> None:
    """The newer run, and at most one retry after a refusal that dropped foreign parts."""
    try:
        assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    except StagedRowsLostError:
        assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"


def test_zombie_staging_under_the_old_split_never_commits_half_a_transform_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    topic, table = _topic_with_records(make_topic, kafka_bootstrap, "zt", unique, 2, 200)
    transform = "tests.integration.commit.test_commit_zombie.fail_from_part"
    old = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=50,
                       transform=transform)
    new = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=100,
                       transform=transform)
    bid = _planned(old, pg_dsn)
    try:
        # the zombie's parts: t[0] [0,50), t[0] [50,100) staged, t[1]'s two die; the newer
        # run's parts 0 and 1 are all of t[0] and all of t[1]
        spark.conf.set(FAIL_CONF, "2")
        _zombie_then(spark, pg_dsn, bid, old, monkeypatch)
        spark.conf.unset(FAIL_CONF)
        _run_until_committed(spark, new, bid, pg_dsn)
    finally:
        spark.conf.unset(FAIL_CONF)
    got = query(pg_dsn, f"SELECT partition, count(*), count(DISTINCT \"offset\") FROM {table} "
                        f"GROUP BY 1 ORDER BY 1")
    assert got == [(0, 100, 100), (1, 100, 100)]
    assert query(pg_dsn, "SELECT partition, next_offset FROM offsetflow.positions "
                         "WHERE topic = %s ORDER BY 1", (topic,)) == [(0, 100), (1, 100)]


def test_zombie_that_staged_its_old_split_and_died_does_not_wedge_the_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused path, upsert (commits from the stage): the zombie stages all four parts of its
    split and dies before its commit; the newer run's split has two."""
    topic, table = _topic_with_records(make_topic, kafka_bootstrap, "zf", unique, 2, 200)
    old = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=50,
                       mode="upsert", key=["event_id"])
    new = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=100,
                       mode="upsert", key=["event_id"])
    bid = _planned(old, pg_dsn)
    real_commit = job.commit_batch

    def zombie_dies_before_commit(*args: Any, **kw: Any) -> Any:
        if threading.current_thread().name == "zombie":
            raise RuntimeError("zombie killed before its commit")
        return real_commit(*args, **kw)

    monkeypatch.setattr(job, "commit_batch", zombie_dies_before_commit)
    _zombie_then(spark, pg_dsn, bid, old, monkeypatch)
    _run_until_committed(spark, new, bid, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT event_id) FROM {table}")[0] == \
        (200, 200)
    assert query(pg_dsn, "SELECT partition, next_offset FROM offsetflow.positions "
                         "WHERE topic = %s ORDER BY 1", (topic,)) == [(0, 100), (1, 100)]


@pytest.mark.parametrize("foreign", ["generation", "offsets"])
def test_commit_refuses_a_part_of_another_layout_and_the_retry_commits_once(
        foreign: str, spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a zombie task leaves when it passed its generation check just before a newer
    run rebuilt the stage: a marker of the old generation (or, for a marker that does not
    record one, offsets of another sub-range under its part number). The commit refuses it
    before moving a row; the part is dropped and the next run stages it again."""
    topic, table = _topic_with_records(make_topic, kafka_bootstrap, "zc", unique, 2, 200)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=50,
                       mode="upsert", key=["event_id"])
    bid = _planned(cfg, pg_dsn)
    real_commit = job.commit_batch

    def zombie_marker(*args: Any, **kw: Any) -> Any:
        if foreign == "generation":
            query(pg_dsn, "UPDATE offsetflow.staged_parts SET generation = generation - 1 "
                          "WHERE batch_id = %s AND kind = 'rows' AND part = 1 RETURNING 1",
                  (bid,))
        else:  # part 1 is t[0] [50, 100): claim t[0] [0, 50) instead, same count
            query(pg_dsn, "UPDATE offsetflow.staged_parts SET per_partition = "
                          "jsonb_build_object(%s, jsonb_build_array(50, 0, 49)) "
                          "WHERE batch_id = %s AND kind = 'rows' AND part = 1 RETURNING 1",
                  (f"{topic}/0", bid))
        monkeypatch.setattr(job, "commit_batch", real_commit)
        return real_commit(*args, **kw)

    monkeypatch.setattr(job, "commit_batch", zombie_marker)
    match = "stage generation" if foreign == "generation" else r"outside its sub-range"
    with pytest.raises(StagedRowsLostError, match=match):
        run_batch(spark, cfg, bid, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 0
    assert query(pg_dsn, "SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s "
                         "AND part = 1", (bid,))[0][0] == 0  # dropped: staged again
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT event_id) FROM {table}")[0] == \
        (200, 200)


def test_a_late_forget_of_a_refused_commit_leaves_a_rebuilt_stage_alone(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """forget_parts runs after the refused commit rolled back, without the batch lock: a
    newer run may rebuild the stage and stage its own parts in between. The late forget
    must not drop the newer run's parts of the same numbers."""
    import offsetflow.commit.protocol as commit_mod

    topic, table = _topic_with_records(make_topic, kafka_bootstrap, "zl", unique, 2, 200)
    old = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=50,
                       mode="upsert", key=["event_id"])
    new = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=100,
                       mode="upsert", key=["event_id"])
    bid = _planned(old, pg_dsn)
    real_commit, real_forget = job.commit_batch, commit_mod.forget_parts
    newer: list[Any] = []

    def lose_a_row(*args: Any, **kw: Any) -> Any:  # the first run: part 1 lost a row
        query(pg_dsn, f"DELETE FROM offsetflow_stage.b{bid}_p1 WHERE ctid IN (SELECT ctid "
                      f"FROM offsetflow_stage.b{bid}_p1 LIMIT 1) RETURNING 1")
        monkeypatch.setattr(job, "commit_batch", real_commit)
        return real_commit(*args, **kw)

    def late_forget(*fargs: Any, **fkw: Any) -> None:
        monkeypatch.setattr(commit_mod, "forget_parts", real_forget)

        def forget_lands_now(*args: Any, **kw: Any) -> Any:  # after the newer run staged
            real_forget(*fargs, **fkw)
            monkeypatch.setattr(job, "commit_batch", real_commit)
            return real_commit(*args, **kw)

        monkeypatch.setattr(job, "commit_batch", forget_lands_now)
        newer.append(run_batch(spark, new, bid, pg_dsn))

    monkeypatch.setattr(job, "commit_batch", lose_a_row)
    monkeypatch.setattr(commit_mod, "forget_parts", late_forget)
    run_batch(spark, old, bid, pg_dsn)  # refused; the newer run committed meanwhile
    assert newer and newer[0].result.status == "committed"
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT event_id) FROM {table}")[0] == \
        (200, 200)


def test_zombie_of_the_old_config_never_stages_under_the_adopted_one(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review F1: a zombie checked the old config, stalled, and a newer run adopted a new
    one (read_committed instead of read_uncommitted). The zombie must not stage under the
    adopted generation: the newer run would skip its parts and commit aborted records."""
    topic = make_topic("zo", 1)
    produced = produce_transactional(kafka_bootstrap, topic, [(40, True), (40, False), (40, True)],
                                     f"zo{unique}", 1)
    table = f"zo_{unique}"

    def cfg(level: str) -> PipelineConfig:
        return pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert",
                            key=["event_id"], kafka={"bootstrap_servers": kafka_bootstrap,
                                                     "isolation_level": level})

    old, new = cfg("read_uncommitted"), cfg("read_committed")
    bid = _planned(old, pg_dsn)
    held, go = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    statuses: list[str] = []
    real_gen, real_create = job.stage_generation, job.create_stage_tables
    zombie: threading.Thread | None = None

    def gen(*args: Any, **kw: Any) -> Any:  # the zombie stalls before it claims the stage
        if threading.current_thread() is zombie:
            held.set()
            assert go.wait(300)
        return real_gen(*args, **kw)

    def create(*args: Any, **kw: Any) -> Any:  # the newer run has adopted and claimed
        if threading.current_thread() is not zombie and not go.is_set():
            go.set()
            assert zombie is not None
            zombie.join(300)
            assert not zombie.is_alive()
            statuses.append(query(pg_dsn, "SELECT status FROM offsetflow.batches "
                                          "WHERE batch_id = %s", (bid,))[0][0])
        return real_create(*args, **kw)

    def run_zombie() -> None:
        try:
            run_batch(spark, old, bid, pg_dsn)
        except BaseException as e:  # noqa: BLE001 - the zombie is expected to die
            errors.append(e)

    monkeypatch.setattr(job, "stage_generation", gen)
    monkeypatch.setattr(job, "create_stage_tables", create)
    zombie = threading.Thread(target=run_zombie, name="zombie")
    zombie.start()
    assert held.wait(300), errors
    assert run_batch(spark, new, bid, pg_dsn, accept_config_change=True).result.status == \
        "committed"
    # the stale zombie's death is its own: the live run's batch stays running meanwhile
    assert [type(e).__name__ for e in errors] == ["StaleConfigError"]
    assert statuses == ["running"]
    ids = {r[0] for r in query(pg_dsn, f"SELECT event_id FROM {table}")}
    assert ids & produced.aborted == set()
    assert ids == set(produced.committed)


def test_a_zero_row_zombie_part_beyond_the_new_split_does_not_wedge_the_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review F3: a zombie of an older split committed a zero-row marker for a part number
    the new split has no table for. The commit refuses it with StagedRowsLostError (not a
    raw UndefinedTable), drops the marker, and the next run commits."""
    topic, table = _topic_with_records(make_topic, kafka_bootstrap, "zw", unique, 2, 200)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, max_offsets_per_task=100,
                       mode="upsert", key=["event_id"])
    bid = _planned(cfg, pg_dsn)
    real_commit = job.commit_batch

    def zombie_part(*args: Any, **kw: Any) -> Any:
        query(pg_dsn, "INSERT INTO offsetflow.staged_parts (batch_id, kind, part, chunk, "
                      "rows_staged, bad_records, per_partition, generation) SELECT %s, 'rows', "
                      "7, 0, 0, 0, '{}', stage_generation - 1 FROM offsetflow.batches "
                      "WHERE batch_id = %s RETURNING 1", (bid, bid))
        monkeypatch.setattr(job, "commit_batch", real_commit)
        return real_commit(*args, **kw)

    monkeypatch.setattr(job, "commit_batch", zombie_part)
    with pytest.raises(StagedRowsLostError, match="stage generation"):
        run_batch(spark, cfg, bid, pg_dsn)
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT event_id) FROM {table}")[0] == \
        (200, 200)


def test_rows_landing_after_the_check_are_never_upserted(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review F4: a late writer (a zombie task) commits a row into the stage between the
    commit's checks (step 2) and the upsert that reads the stage again: the commit must
    never apply it. Here it lands (or tries to) right after check_staged."""
    import offsetflow.commit.protocol as commit_mod

    topic, table = _topic_with_records(make_topic, kafka_bootstrap, "zu", unique, 1, 100)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table, mode="upsert", key=["event_id"])
    bid = _planned(cfg, pg_dsn)
    real_check = commit_mod.check_staged
    writers: list[threading.Thread] = []
    failed: list[BaseException] = []

    def late_write(row: str) -> None:
        """Like a zombie task's COPY: its first lock on the stage is the write's."""
        try:
            query(pg_dsn, f"INSERT INTO offsetflow_stage.b{bid} SELECT (jsonb_populate_record("
                          f"NULL::offsetflow_stage.b{bid}, %s::jsonb)).* RETURNING 1", (row,))
        except BaseException as e:  # noqa: BLE001 - the stage is gone once the commit ends
            failed.append(e)

    def check_then_late_row(*args: Any, **kw: Any) -> Any:
        out = real_check(*args, **kw)
        row = query(pg_dsn, f"SELECT (to_jsonb(s) || '{{\"event_id\": \"zombie-row\"}}')::text "
                            f"FROM offsetflow_stage.b{bid} s LIMIT 1")[0][0]
        w = threading.Thread(target=late_write, args=(row,))
        writers.append(w)
        w.start()
        w.join(5)  # lands now, or waits for the commit's lock
        return out

    monkeypatch.setattr(commit_mod, "check_staged", check_then_late_row)
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    for w in writers:
        w.join(60)
    assert writers
    assert query(pg_dsn, f"SELECT count(*) FROM {table} WHERE event_id = 'zombie-row'")[0][0] == 0
    assert query(pg_dsn, f"SELECT count(*), count(DISTINCT event_id) FROM {table}")[0] == \
        (100, 100)
