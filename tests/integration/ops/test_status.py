"""Lag as the operator sees it: `offsetflow status --json`, and the consumer-group offsets
published for Kafka's own tools (issue: operator's view of lag and batches)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from offsetflow.config import load_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import pipeline_status
from offsetflow.ops.runner import run_cycle
from offsetflow.source.lag import group_id, read_group_offsets
from tests.tooling.pipeline_data import SCHEMA, end_offsets, produce_plain


def test_status_and_consumer_group_lag_match_the_ledger(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path) -> None:
    topic = make_topic("lag", 3)
    produce_plain(kafka_bootstrap, topic, 900, f"l{unique}", 3)
    f = tmp_path / f"lag_{unique}.yaml"
    f.write_text(yaml.safe_dump({
        "name": f"lag_{unique}", "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "max_records_per_partition": 100},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": f"lag_{unique}"}}))
    cfg = load_pipeline(f)
    run_cycle(cfg, pg_dsn, spark)
    run_cycle(cfg, pg_dsn, spark)  # 200 of 300 per partition committed

    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(cfg.name)
    assert positions == {(topic, p): 200 for p in range(3)}
    # what kafka-consumer-groups would show: the group's offsets and lag
    group = read_group_offsets(cfg)
    assert group == positions
    ends = end_offsets(kafka_bootstrap, topic, 3)
    group_lag = {tp: ends[tp] - off for tp, off in group.items()}

    st = pipeline_status(cfg, pg_dsn)
    assert st["kafka_error"] is None and st["warnings"] == []
    assert {(p["topic"], p["partition"]): p["lag"] for p in st["partitions"]} == group_lag
    assert st["total_lag"] == 300
    assert all(p["lag_seconds"] is not None and p["lag_seconds"] >= 0 for p in st["partitions"])
    assert [h["lag"] for h in st["lag_history"]] == [900, 600]
    assert [b["status"] for b in st["batches"]] == ["committed", "committed"]

    out = subprocess.run(["offsetflow", "status", "--pipeline-file", str(f), "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    cli = json.loads(out)
    assert cli["total_lag"] == 300 and cli["pipeline"] == cfg.name
    assert "password" not in out and pg_dsn not in out
    assert group_id(cfg) == f"offsetflow-lag_{unique}"
