"""The shipped pipelines take the warm path by default (issue 19, item 2): a scheduled DAG
run of them goes to the Spark Connect server `make up` starts, at the stack's own port."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from offsetflow.config import parse_pipeline

PIPELINES = sorted((Path(__file__).resolve().parents[3] / "include" / "pipelines")
                   .glob("*.yaml"))


@pytest.mark.parametrize("path", PIPELINES, ids=[p.stem for p in PIPELINES])
def test_shipped_pipelines_launch_on_the_warm_connect_server(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    cfg = parse_pipeline(raw, str(path), {"OFFSETFLOW_SPARK_CONNECT_URL": "sc://h:25002"})
    assert cfg.spark.launch == "connect"
    assert cfg.spark.connect_url == "sc://h:25002"  # the stack's port, from .stack/env.sh
    assert parse_pipeline(raw, str(path), {}).spark.connect_url == "sc://127.0.0.1:15002"

