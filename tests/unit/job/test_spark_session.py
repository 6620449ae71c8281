"""`offsetflow.job.spark_session.tasks_here`: whether a session's tasks run on the driver's
host, which decides `sink.task_files: auto` (issue 32)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from offsetflow.config import parse_pipeline
from offsetflow.job.spark_session import tasks_here


def _cfg(launch: str = "submit") -> object:
    cfg = parse_pipeline({
        "name": "orders", "kafka": {"bootstrap_servers": "k:9092"},
        "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "long"}},
        "sink": {"type": "kafka", "connection": "postgresql://x/y", "topic": "o"}},
        "orders.yaml", {})
    return dataclasses.replace(cfg, spark=dataclasses.replace(cfg.spark, launch=launch))


def _session(master: str) -> SimpleNamespace:
    return SimpleNamespace(sparkContext=SimpleNamespace(master=master))


@pytest.mark.parametrize(("master", "here"), [
    ("local[2]", True), ("local", True), ("local[*]", True), ("local-cluster[2,1,1024]", True),
    ("spark://127.0.0.1:7077", False), ("yarn", False), ("k8s://https://api:6443", False)])
def test_the_running_sessions_master_decides(master: str, here: bool) -> None:
    """The master the session runs (under spark-submit, spark-submit's, whatever the
    pipeline's spark.master says)."""
    assert tasks_here(_cfg(), _session(master)) is here


def test_a_spark_connect_session_is_never_here() -> None:
    """The Connect server's executors may be on other hosts; its session has no
    SparkContext to ask."""
    assert tasks_here(_cfg("connect"), object()) is False
