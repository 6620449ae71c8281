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
