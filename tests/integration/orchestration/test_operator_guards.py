"""Guards between the Airflow side and the ledger, on real Kafka, PostgreSQL and Spark: a
driver pointed at the wrong ledger never touches another pipeline's batch, and a run-batch
task that gets no batch ids while a batch is open fails instead of skipping forever."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from offsetflow.errors import BatchStateError
from offsetflow.job import run_batch
from offsetflow.ops import plan_only
from offsetflow.orchestration.tasks import publish_task
from tests.tooling.pipeline_data import pipeline_for, produce_plain, query


def test_driver_on_another_pipelines_batch_touches_nothing(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("own", 1)
    produce_plain(kafka_bootstrap, topic, 20, "own", 1)
    mine = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"own_{unique}")
    planned = plan_only(mine, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    other = dataclasses.replace(mine, name=f"{mine.name}_other")
    with pytest.raises(BatchStateError, match=f"belongs to pipeline {mine.name}"):
        run_batch(spark, other, bid, pg_dsn)
    # untouched: still planned, no attempt counted against it
    assert query(pg_dsn, "SELECT status, attempts FROM offsetflow.batches WHERE batch_id = %s",
                 (bid,)) == [("planned", 0)]
    assert run_batch(spark, mine, bid, pg_dsn).result.status == "committed"
    # publishing it under another pipeline's name (ids from the wrong XCom) is refused too:
    # its Asset event would carry the wrong pipeline and table
    with pytest.raises(BatchStateError, match=f"belongs to pipeline {mine.name}"):
        publish_task(other, bid)


def test_run_batch_operator_without_ids_fails_while_a_batch_is_open(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    from airflow.sdk.exceptions import AirflowSkipException

    from offsetflow.orchestration.operators import OffsetFlowRunBatchOperator

    topic = make_topic("noids", 1)
    cfg = {"name": f"noids_{unique}", "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "raw"},
           "sink": {"connection": pg_dsn, "table": f"noids_{unique}"}}
    op = OffsetFlowRunBatchOperator(task_id="run_batch", config=cfg, batch_ids="None")
    with pytest.raises(AirflowSkipException):  # nothing planned: a real "nothing to do"
        op.execute({})
    produce_plain(kafka_bootstrap, topic, 10, "noids", 1)
    planned = plan_only(_cfg(cfg), pg_dsn)
    assert planned.batch is not None
    with pytest.raises(BatchStateError, match=f"batch {planned.batch.batch_id} of pipeline"):
        op.execute({})  # ids lost on the way (wrong task id): loud, not a silent skip


def _cfg(raw: dict[str, Any]) -> Any:
    from offsetflow.config import parse_pipeline

    return parse_pipeline(raw, "<test>")
