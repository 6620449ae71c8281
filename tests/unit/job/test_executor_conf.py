"""OffsetFlow's default executor conf (executor_conf): C1-only executor JVMs for a pipeline
without a transform, never where the pipeline, its launcher or Spark Connect decides."""

from __future__ import annotations

from typing import Any

import pytest

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.job.executor_conf import C1_ONLY, EXECUTOR_JAVA_OPTIONS, default_conf

C1 = {EXECUTOR_JAVA_OPTIONS: C1_ONLY}


def pipeline(spark: dict[str, Any] | None = None, **over: Any) -> PipelineConfig:
    raw: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:19092"},
        "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "string"}},
        "sink": {"connection": "postgresql://u@h:1/db", "table": "raw.orders"},
        "spark": spark or {}, **over}
    return parse_pipeline(raw, "orders.yaml", {})


def test_a_pipeline_without_a_transform_gets_c1_only_executors() -> None:
    assert C1_ONLY == "-XX:TieredStopAtLevel=1"
    assert default_conf(pipeline()) == C1
    assert default_conf(pipeline({"master": "spark://h:7077",
                                  "conf": {"spark.executor.cores": "1"}})) == C1


def test_a_transforms_executors_run_spark_sql_and_keep_the_jvms_default() -> None:
    assert default_conf(pipeline(transform="mypackage.transforms.enrich")) == {}


@pytest.mark.parametrize("value", ["-XX:+UseG1GC -Dx=1", ""])
def test_the_pipelines_own_value_wins_even_an_empty_one(value: str) -> None:
    cfg = pipeline({"conf": {EXECUTOR_JAVA_OPTIONS: value}})
    assert cfg.spark.conf[EXECUTOR_JAVA_OPTIONS] == value  # the parser keeps "" as it is
    assert default_conf(cfg) == {}


def test_the_launchers_conf_wins() -> None:
    """spark-submit's --conf (an Airflow operator's conf among it) or spark-defaults.conf."""
    assert default_conf(pipeline(), {EXECUTOR_JAVA_OPTIONS, "spark.master"}) == {}
    assert default_conf(pipeline(), {"spark.master", "spark.app.name"}) == C1


def test_no_default_on_a_spark_connect_server() -> None:
    """Its executors are already running: the conf could not reach them."""
    assert default_conf(pipeline({"launch": "connect"})) == {}
