"""Example: OffsetFlow in your own DAG, with no pipeline YAML. Copy and adapt.

`orders_to_warehouse` reads the `orders` topic exactly once into `public.orders_example`,
with credentials from the Airflow connections `offsetflow_kafka` (type kafka) and
`offsetflow_postgres` (type postgres). `orders_report` runs after every committed batch: it
is scheduled on the batch's Asset event and reads its extras (batch id, kind, ranges, rows).

Both are manual (schedule=None) and paused when created, so they never run against your
stack by themselves; unpause and trigger `orders_to_warehouse` to try them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import DAG, AssetAlias, task

from offsetflow.orchestration.assets import alias_name
from offsetflow.orchestration.operators import offsetflow_pipeline_tasks

ORDERS = {
    "name": "orders_example",
    "kafka": {"conn_id": "offsetflow_kafka", "isolation_level": "read_committed"},
    "source": {"topics": ["orders"], "max_records_per_partition": 5000},
    "format": {"type": "json", "schema": {"order_id": "string", "customer": "string",
                                          "amount": "double", "quantity": "long",
                                          "created_at": "timestamp"}},
    "sink": {"conn_id": "offsetflow_postgres", "table": "public.orders_example"},
    "bad_records": "dead_letter",
}

with DAG(dag_id="orders_to_warehouse", schedule=None, start_date=datetime(2026, 1, 1),
         catchup=False, max_active_runs=1, is_paused_upon_creation=True,
         tags=["offsetflow", "example"]):
    # plan >> has_batch >> run_batch (spark-submit) >> publish (emits the Asset event);
    # or use OffsetFlowPlanOperator / OffsetFlowRunBatchOperator / OffsetFlowPublishOperator
    offsetflow_pipeline_tasks(config=ORDERS, group_id="orders")

with DAG(dag_id="orders_report", schedule=[AssetAlias(alias_name("orders_example"))],
         start_date=datetime(2026, 1, 1), catchup=False, is_paused_upon_creation=True,
         tags=["offsetflow", "example"]):

    @task
    def report(**context: Any) -> list[dict[str, Any]]:
        """What a downstream job would use: the committed batch and its offset ranges."""
        events = context["triggering_asset_events"]
        # one event may be listed under the alias and the asset: one row per batch
        return list({e.extra["batch_id"]: dict(e.extra) for evs in events.values()
                     for e in evs}.values())

    report()
