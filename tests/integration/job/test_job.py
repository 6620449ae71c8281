"""The two ways a batch reaches the stage (offsetflow.job.driver) and the Spark Connect launch, on
real Kafka, PostgreSQL and Spark.

Without a transform each Spark task reads its sub-range and COPYs it in binary itself (the
fused path); with one, records go through a DataFrame and are staged as CSV. Both must land
exactly the same rows, byte for byte, including keys, headers, timestamps and NULLs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer
from pyspark.sql import DataFrame

from offsetflow.config import parse_pipeline
from offsetflow.errors import SparkUnavailableError
from offsetflow.job import build_spark, run_batch
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import query
from tests.tooling.services import STATE

RICH_SCHEMA = {"event_id": "string", "seq": "long", "small": "int", "amount": "double",
               "ratio": "float", "ok": "boolean", "at": "timestamp", "day": "date",
               "price": "decimal(12,3)", "note": "string"}
ROOT = Path(__file__).resolve().parents[3]
NOTES = ["plain", 'quote " and, comma', "new\nline and \\ backslash", "ünïcødé ✓ 日本", "",
         None, "tab\there", "\\N looks like NULL"]


def identity_transform(df: DataFrame) -> DataFrame:
    """A transform that changes nothing, so only the path differs."""
    return df


def _rich_record(i: int) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "event_id": f"e-{i}", "seq": i * 7_919_000_001, "small": i - 50,
        "amount": i / 3, "ratio": 0.5 + i, "ok": i % 3 == 0,
        "at": f"2026-11-{1 + i % 28:02d}T{i % 24:02d}:15:30.{i:06d}Z",
        "day": f"2026-{1 + i % 12:02d}-{1 + i % 28:02d}", "price": f"{i * 12.345:.3f}",
        "note": NOTES[i % len(NOTES)]}
    if i % 11 == 0:  # some fields absent or null
        for k in ("small", "ratio", "at", "day", "price"):
            rec[k] = None
    return rec


def _produce_rich(bootstrap: str, topic: str, n: int, partitions: int) -> int:
    """Returns the base timestamp (ms): record i has base + i (recent, or retention deletes
    it)."""
    base = int(time.time() * 1000) - 60_000
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(n):
        headers: list[tuple[str, bytes | None]] | None = None
        if i % 4 == 1:
            headers = [("trace", f"t-{i}".encode()), ("empty", None),
                       ("bin", bytes([0, 255, i % 256]))]
        key = None if i % 5 == 0 else f"k-{i}".encode()
        p.produce(topic, json.dumps(_rich_record(i)).encode(), key=key, partition=i % partitions,
                  headers=headers, timestamp=base + i)
    assert p.flush(30) == 0
    return base


def _config(topic: str, dsn: str, bootstrap: str, table: str, transform: str | None = None,
            **spark: Any) -> Any:
    raw: dict[str, Any] = {
        "name": table, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(RICH_SCHEMA)},
        "sink": {"connection": dsn, "table": table},
        "spark": {"master": "local[2]", "max_offsets_per_task": 70, **spark}}
    if transform:
        raw["transform"] = transform
    return parse_pipeline(raw, f"<test {table}>", {})


def _all_rows(dsn: str, table: str) -> tuple[list[tuple[str, str]], list[tuple[Any, ...]]]:
    cols = query(dsn, "SELECT column_name, data_type FROM information_schema.columns "
                      "WHERE table_name = %s AND column_name <> '_offsetflow_batch_id' "
                      "ORDER BY ordinal_position", (table,))
    names = ", ".join(f'"{c}"' for c, _ in cols)
    rows = query(dsn, f'SELECT {names} FROM {table} ORDER BY partition, "offset"')
    return [(c, t) for c, t in cols], rows


def _plan_and_run(spark: Any, cfg: Any, dsn: str) -> None:
    out = plan_only(cfg, dsn, started_by="test")
    assert out.batch is not None
    report = run_batch(spark, cfg, out.batch.batch_id, dsn)
    assert report.result.status == "committed", report.result


def test_fused_and_dataframe_paths_land_identical_rows(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    n, parts = 400, 3
    topic = make_topic("paths", parts)
    base = _produce_rich(kafka_bootstrap, topic, n, parts)
    fused = _config(topic, pg_dsn, kafka_bootstrap, f"fused_{unique}")
    framed = _config(topic, pg_dsn, kafka_bootstrap, f"framed_{unique}",
                     transform="tests.integration.job.test_job.identity_transform")
    assert fused.transform is None and framed.transform
    _plan_and_run(spark, fused, pg_dsn)
    _plan_and_run(spark, framed, pg_dsn)

    fused_cols, fused_rows = _all_rows(pg_dsn, fused.sink.table)
    framed_cols, framed_rows = _all_rows(pg_dsn, framed.sink.table)
    assert fused_cols == framed_cols
    assert len(fused_rows) == n
    for a, b in zip(fused_rows, framed_rows, strict=True):
        assert a == b
    # and both equal what was produced, field by field
    names = [c for c, _ in fused_cols]
    by_seq = {r[names.index("event_id")]: dict(zip(names, r, strict=True)) for r in fused_rows}
    for i in range(n):
        src, row = _rich_record(i), by_seq[f"e-{i}"]
        assert row["partition"] == i % parts
        key = None if row["key"] is None else bytes(row["key"])
        assert key == (None if i % 5 == 0 else f"k-{i}".encode())
        assert row["timestamp"] == datetime.fromtimestamp((base + i) / 1000, UTC)
        assert row["seq"] == src["seq"] and row["small"] == src["small"]
        assert row["amount"] == src["amount"] and row["ok"] == src["ok"]
        assert row["note"] == src["note"]
        assert json.loads(bytes(row["value"])) == src
        if src["at"] is None:
            assert row["at"] is None and row["day"] is None and row["price"] is None
        else:
            assert row["at"] == datetime.fromisoformat(src["at"])
            assert row["day"] == date.fromisoformat(src["day"])
            assert row["price"] == Decimal(src["price"])
        if i % 4 == 1:
            headers = row["headers"] if isinstance(row["headers"], list) else \
                json.loads(row["headers"])
            assert [h["key"] for h in headers] == ["trace", "empty", "bin"]
            assert headers[1]["value"] is None
        else:
            assert row["headers"] in (None, [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_connect_launch_without_a_server_fails_fast_and_names_the_url(
        pg_dsn: str, kafka_bootstrap: str, unique: str) -> None:
    port = _free_port()
    cfg = _config("t", pg_dsn, kafka_bootstrap, f"nc_{unique}", launch="connect",
                  connect_url=f"sc://127.0.0.1:{port}/;token=s3cret")
    with pytest.raises(SparkUnavailableError) as e:
        build_spark(cfg, "offsetflow-test")
    assert f"sc://127.0.0.1:{port}" in str(e.value) and "connect-start" in str(e.value)
    assert "s3cret" not in str(e.value)


def test_offsetflow_run_on_warm_spark_connect_server(
        spark_connect_url: str, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, tmp_path: Path) -> None:
    """`spark.launch: connect` from the CLI, in a process of its own (a process holding a
    local SparkSession cannot open a remote one)."""
    n, parts = 300, 3
    topic = make_topic("connect", parts)
    _produce_rich(kafka_bootstrap, topic, n, parts)
    table = f"sc_{unique}"
    raw = {"name": table, "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "json", "schema": dict(RICH_SCHEMA)},
           "sink": {"connection": "${OFFSETFLOW_TEST_CONNECT_DSN}", "table": table},
           "spark": {"launch": "connect", "connect_url": spark_connect_url,
                     "max_offsets_per_task": 60}}
    path = tmp_path / f"{table}.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "OFFSETFLOW_TEST_CONNECT_DSN": pg_dsn}
    server_log = STATE / "connect" / "connect.log"
    seen = len(server_log.read_bytes())
    p = subprocess.run([str(Path(sys.executable).parent / "offsetflow"), "run",
                        "--pipeline-file", str(path), "--max-batches", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = query(pg_dsn, f'SELECT partition, "offset", event_id FROM {table}')
    assert sorted((pt, o) for pt, o, _ in rows) == sorted(
        (pt, o) for pt in range(parts) for o in range(n // parts))
    assert {e for *_, e in rows} == {f"e-{i}" for i in range(n)}
    # the run used the server (a session of its own there), not a Spark of its own
    assert b"sessionId" in server_log.read_bytes()[seen:]
