"""A run of a batch whose parts are staged already (the re-run after a driver died past its
tasks) keeps Spark's Python workers: its tasks skip their parts and must still read their
input, else Spark kills each such worker instead of reusing it, and the next task pays a
new worker's start (~1.15 CPU-s of imports; on a warm Spark Connect server, the warm
workers). Real Kafka, PostgreSQL and the test's local Spark session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offsetflow.commit import protocol
from offsetflow.job import run_batch
from tests.tooling.fault_case import Case


def _pids(batches: Iterator[Any]) -> Iterator[Any]:
    import pyarrow as pa

    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist([{"pid": os.getpid()}])


def _worker_pids(spark: Any) -> set[int]:
    """The Python workers that run a small `mapInArrow` job's tasks (the pool the job's
    own `mapInArrow` tasks use: an RDD's Python tasks have another)."""
    rows = spark.range(0, 8, 1, 8).mapInArrow(_pids, "pid long").collect()
    return {r["pid"] for r in rows}


def test_a_rerun_whose_parts_are_staged_reuses_the_python_workers(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(tmp_path, pg_dsn, kafka_bootstrap, make_topic("reuse", 2), 2, unique)
    bid = case.planned_batch(400, seed=71)

    def die(*_: Any) -> None:
        raise RuntimeError("test: died after the tasks")

    with monkeypatch.context() as m:  # every part staged, the ledger's commit never made
        m.setattr(protocol, "record_batch", die)
        with pytest.raises(RuntimeError, match="test: died"):
            run_batch(spark, case.cfg, bid, pg_dsn)
    workers = _worker_pids(spark) | _worker_pids(spark)
    rep = run_batch(spark, case.cfg, bid, pg_dsn)  # every task finds its part staged
    assert rep.result.status == "committed"
    case.assert_exactly_once()
    new = _worker_pids(spark) - workers
    assert not new, f"the re-run's tasks left their workers unusable: new workers {new}"
