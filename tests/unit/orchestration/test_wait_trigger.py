"""The waiting trigger's contract with Airflow (no services): what the triggerer rebuilds it
from, and event-driven scheduling (an AssetWatcher on it) serializes into a DAG."""

from __future__ import annotations

from datetime import datetime

import pytest


def test_trigger_round_trips_through_its_serialized_form() -> None:
    from offsetflow.orchestration.triggers import NewOffsetsTrigger

    path, kwargs = NewOffsetsTrigger(pipeline="orders", poll_interval=5,
                                     min_offsets=10).serialize()
    assert path == "offsetflow.orchestration.triggers.NewOffsetsTrigger"
    assert NewOffsetsTrigger(**kwargs).serialize() == (path, kwargs)


def test_asset_watcher_schedules_a_dag_when_data_arrives() -> None:
    from airflow.sdk import DAG, Asset, AssetWatcher, task
    from airflow.serialization.serialized_objects import DagSerialization

    from offsetflow.orchestration.triggers import NewOffsetsEventTrigger

    arrived = Asset("offsetflow-orders-new-data", watchers=[AssetWatcher(
        name="orders_new_offsets", trigger=NewOffsetsEventTrigger(pipeline="orders"))])
    with DAG(dag_id="when_data_arrives", schedule=[arrived],
             start_date=datetime(2026, 1, 1)) as dag:
        @task
        def noop() -> None:
            return None

        noop()
    text = str(DagSerialization.to_dict(dag))
    assert "offsetflow.orchestration.triggers.NewOffsetsEventTrigger" in text


def test_sensor_refuses_a_min_offsets_below_one() -> None:
    from offsetflow.orchestration.sensors import OffsetFlowNewDataSensor

    with pytest.raises(ValueError, match="min_offsets"):
        OffsetFlowNewDataSensor(task_id="w", pipeline="orders", min_offsets=0)


def test_sensor_is_deferrable_as_airflows_default_deferrable_says() -> None:
    """`deferrable` defaults to [operators] default_deferrable, as the providers' operators;
    the value is read when the module is imported, so each case is a fresh interpreter."""
    import os
    import subprocess
    import sys

    probe = ("from offsetflow.orchestration.sensors import OffsetFlowNewDataSensor as S; "
             "print(S(task_id='w', pipeline='orders').deferrable, "
             "S(task_id='v', pipeline='orders', deferrable=False).deferrable)")
    seen = {}
    for value in ("true", "false"):
        env = {**os.environ, "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": value}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        seen[value] = out.stdout.split()[-2:]
    assert seen == {"true": ["True", "False"], "false": ["False", "False"]}


def test_trigger_and_sensor_take_an_inline_config_and_connection_ids() -> None:
    from offsetflow.errors import ConfigError
    from offsetflow.orchestration.sensors import OffsetFlowNewDataSensor
    from offsetflow.orchestration.triggers import NewOffsetsTrigger

    raw = {"name": "inline_orders", "source": {"topics": ["orders"]}}
    path, kwargs = NewOffsetsTrigger(config=raw, postgres_conn_id="pg", kafka_conn_id="kf",
                                     poll_interval=5).serialize()
    assert kwargs == {"config": raw, "postgres_conn_id": "pg", "kafka_conn_id": "kf",
                      "poll_interval": 5.0, "min_offsets": 1}
    assert NewOffsetsTrigger(**kwargs).pipeline == "inline_orders"
    with pytest.raises(ConfigError, match="exactly one of pipeline"):
        NewOffsetsTrigger(pipeline="orders", config=raw)
    with pytest.raises(ConfigError, match="exactly one of pipeline"):
        OffsetFlowNewDataSensor(task_id="w")
    assert {"config", "postgres_conn_id", "kafka_conn_id"} <= set(
        OffsetFlowNewDataSensor.template_fields)
