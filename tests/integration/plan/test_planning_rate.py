"""Adaptive batch sizing against the real ledger, Kafka and Spark: each scheduled batch
records the rate it was sized for and why (migration 0012), the estimator's state carries
from batch to batch through the ledger, and a batch never reads more than the rate allows
(nor more than the caps)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from offsetflow.errors import ConfigError
from offsetflow.job import run_batch
from offsetflow.ledger import Due
from offsetflow.ops.runner import plan_only, run_cycle
from tests.tooling.pipeline_data import pipeline_for, produce_plain, query


def test_batches_are_sized_by_the_pid_rate_and_record_why(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("rate", 2)
    produce_plain(kafka_bootstrap, topic, 8000, f"r{unique}", 2)
    # a 1 s interval: whatever the machine's speed, rate * interval is below the caps
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"rate_{unique}",
                       max_records_per_partition=1000,
                       source_rate={"adaptive": "pid", "interval_s": 1})
    ids = [run_cycle(cfg, pg_dsn, spark).plan.batch_id for _ in range(3)]
    rows = query(pg_dsn, """SELECT b.batch_id, b.rate,
                                   (SELECT sum(until_offset - from_offset)
                                      FROM offsetflow.batch_ranges r
                                     WHERE r.batch_id = b.batch_id)
                              FROM offsetflow.batches b WHERE b.batch_id = ANY(%s)
                             ORDER BY b.batch_id""", (ids,))
    (b1, r1, n1), (b2, r2, n2), (b3, r3, n3) = rows
    # nothing observed yet, then the first observation only seeds the estimator (Spark)
    assert (r1["rate"], r1["limit"], n1) == (None, "none", 2000)
    assert "no committed batch" in r1["why"]
    assert r2["rate"] is None and r2["observed"]["batch_id"] == b1 and n2 == 2000
    assert "first observation" in r2["why"] and r2["state"]["first_run"] is False
    # the third batch is sized by the rate: rate * 1 s offsets, the rate >= min_rate
    assert r3["observed"]["batch_id"] == b2 and r3["limit"] == "rate"
    assert r3["rate"] >= 100 and 0 <= r3["max_records"] - math.floor(r3["rate"]) <= 1
    assert n3 == min(r3["max_records"], 2000)
    assert r3["state"]["latest_time_ms"] > r2["state"]["latest_time_ms"]
    assert {"error", "historical_error", "d_error"} <= set(r3["terms"])


def test_a_non_finite_rate_setting_never_reaches_the_planner(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """YAML reads `.inf`, `.nan` and `1e400` as floats: a source.rate number that is not
    finite either is refused with the config, or plans (it must never pass the config check
    and then fail every plan: `ceil(inf)`, or a jsonb that refuses Infinity/NaN)."""
    topic = make_topic("rate_nonfinite", 1)
    produce_plain(kafka_bootstrap, topic, 10, f"n{unique}", 1)
    bad = [("interval_s", math.inf), ("interval_s", math.nan), ("min_rate", math.nan),
           ("proportional", math.inf), ("integral", -math.nan)]
    for i, (field, value) in enumerate(bad):
        try:
            cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"rate_nf{i}_{unique}",
                               source_rate={"adaptive": "pid", "interval_s": 1, field: value})
        except ConfigError as e:
            assert f"source.rate.{field}" in str(e) and "finite" in str(e)
            continue
        out = plan_only(cfg, pg_dsn)  # accepted: it must plan
        assert out.batch is not None, (field, value)


def test_the_estimator_reads_the_real_due_time(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The scheduling delay the PID estimator observes is the wait behind the previous run
    from the ledger's due time (`batches.due_at`, migration 0011): from due until the
    previous batch finished. A run due 40 s before it started with no run before it was
    not held back by this pipeline (Airflow start-up, a pool, a clock offset): 0, though
    its own statistics say 40 s late."""
    topic = make_topic("rate_due", 1)
    produce_plain(kafka_bootstrap, topic, 50, f"d{unique}", 1)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"rate_due_{unique}",
                       source_rate={"adaptive": "pid", "interval_s": 60})
    (now,), = query(pg_dsn, "SELECT now()")
    first = plan_only(cfg, pg_dsn, "airflow", Due(now - timedelta(seconds=40), "schedule"))
    assert first.batch is not None
    assert run_batch(spark, cfg, first.batch.batch_id, pg_dsn).result.status == "committed"

    def row(batch_id: int) -> tuple[Any, ...]:
        (r,) = query(pg_dsn, """SELECT (extract(epoch FROM started_at - due_at) * 1000)
                                       ::bigint, stats, finished_at, due_at, rate
                                  FROM offsetflow.batches WHERE batch_id = %s""", (batch_id,))
        return tuple(r)

    late_ms, stats, first_finished, _, _ = row(first.batch.batch_id)
    assert late_ms >= 40_000 and stats["scheduling_delay_s"] >= 40  # the batch's statistic
    # the second run was due 30 s ago, while the first was still running: it waited behind
    # it from its due time until the first finished
    produce_plain(kafka_bootstrap, topic, 50, f"e{unique}", 1)
    second = plan_only(cfg, pg_dsn, "airflow", Due(now - timedelta(seconds=30), "schedule"))
    assert second.batch is not None
    observed = row(second.batch.batch_id)[4]["observed"]
    assert observed["batch_id"] == first.batch.batch_id
    assert observed["scheduling_ms"] == 0, observed  # nothing to wait behind
    assert run_batch(spark, cfg, second.batch.batch_id, pg_dsn).result.status == "committed"
    _, _, _, second_due, _ = row(second.batch.batch_id)
    produce_plain(kafka_bootstrap, topic, 50, f"f{unique}", 1)
    third = plan_only(cfg, pg_dsn, "airflow", Due(now + timedelta(seconds=60), "schedule"))
    assert third.batch is not None
    observed = row(third.batch.batch_id)[4]["observed"]
    assert observed["batch_id"] == second.batch.batch_id
    behind_ms = (first_finished - second_due).total_seconds() * 1000
    assert behind_ms >= 30_000
    assert abs(observed["scheduling_ms"] - behind_ms) <= 1, (observed, behind_ms)
