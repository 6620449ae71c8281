"""Metrics that alert (issue 31 item 4): while a pipeline's batch keeps failing, every plan
and every failed run still sends the lag and the oldest-unread age, so the lag gauge keeps
rising, and the failure and retry counters count each run. Read from a real StatsD listener
(a UDP socket of this test) through Airflow's own Stats, with InfluxDB-style tags: the
pipeline is a tag, not part of the name. Real Kafka, PostgreSQL and Spark."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer

from offsetflow.errors import OffsetFlowError
from offsetflow.job import run_batch
from offsetflow.orchestration import tasks
from tests.tooling.pipeline_data import pipeline_for, produce_plain
from tests.tooling.statsd_listener import StatsdListener


@pytest.fixture
def statsd(monkeypatch: pytest.MonkeyPatch) -> Iterator[StatsdListener]:
    """Airflow's Stats pointed at a listener of this test, as `[metrics]` would configure it
    (statsd_on, statsd_influxdb_enabled), and back to no stats afterwards."""
    from airflow.sdk.observability.metrics import stats_utils
    from airflow.sdk.observability.stats import initialize

    listener = StatsdListener()
    for k, v in {"STATSD_ON": "True", "STATSD_HOST": "127.0.0.1",
                 "STATSD_PORT": str(listener.port), "STATSD_PREFIX": "airflow",
                 "STATSD_INFLUXDB_ENABLED": "True"}.items():
        monkeypatch.setenv(f"AIRFLOW__METRICS__{k}", v)
    initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)
    try:
        yield listener
    finally:
        initialize(factory=stats_utils.NoStatsLogger, export_legacy_names=False)
        listener.close()


def test_failing_pipeline_keeps_sending_a_rising_lag_and_counts_failures(
        statsd: StatsdListener, spark: Any, pg_dsn: str, kafka_bootstrap: str,
        make_topic: Any, unique: str) -> None:
    topic = make_topic("fm", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, b"{not json", partition=0)  # bad_records: fail -> every run fails
    assert p.flush(30) == 0
    produce_plain(kafka_bootstrap, topic, 20, f"fm{unique}", 1)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"fm_{unique}")
    tag = f",pipeline={cfg.name}"
    for i in range(3):
        bid = tasks.plan_task(cfg, "test")  # the same open batch every time
        assert bid is not None
        with pytest.raises(OffsetFlowError, match="JSON|json"):
            tasks.observed_run(cfg, [bid], lambda b=bid: run_batch(spark, cfg, b, pg_dsn))
        statsd.wait_for(f"airflow.offsetflow.batches_failed{tag}", i + 1)
        produce_plain(kafka_bootstrap, topic, 30, f"fm{unique}", 1, start_seq=100 * (i + 1))

    lag = [v for v, kind in statsd.wait_for(f"airflow.offsetflow.lag{tag}", 6)]
    # a plan and a failure per round, 30 more records between rounds: 21, 51, 81
    assert lag == [21, 21, 51, 51, 81, 81], statsd.lines
    assert statsd.values(f"airflow.offsetflow.batches_failed{tag}") == [(1.0, "c")] * 3
    assert statsd.values(f"airflow.offsetflow.batches_retried{tag}") == [(1.0, "c")] * 2
    ages = [v for v, kind in statsd.values(f"airflow.offsetflow.oldest_unread_age{tag}")]
    assert len(ages) == 6 and ages == sorted(ages) and ages[0] >= 0, ages
    # nothing carries the pipeline in its name
    assert not [line for line in statsd.lines if f"offsetflow.{cfg.name}" in line]


def test_the_lag_of_a_failure_with_kafka_unreachable_does_not_hold_the_task(
        statsd: StatsdListener, pg_dsn: str, unique: str) -> None:
    """A run (or plan) that failed because Kafka is unreachable measures the lag for its
    metrics from Kafka again: that must be one short try, not the planner's retry budget
    per call (a minute or more before the task may fail and Airflow retry it)."""
    with socket.socket() as s:  # a port nothing listens on: Kafka down
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cfg = pipeline_for("gone", pg_dsn, dead, f"fk_{unique}")
    raised: list[float] = []
    t0 = time.monotonic()

    def boom() -> None:
        raise RuntimeError("Kafka is down")

    def run() -> None:
        with pytest.raises(RuntimeError, match="Kafka is down"):
            tasks.observed_run(cfg, [], boom)
        raised.append(time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert raised and raised[0] < 15, f"the failure was held {time.monotonic() - t0:.0f}s+"
    assert statsd.wait_for(f"airflow.offsetflow.batches_failed,pipeline={cfg.name}", 1)
