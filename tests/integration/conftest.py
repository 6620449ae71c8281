"""Fixtures more than one integration test module uses: a Great Expectations project with the
quality suites, a pipelines + DAGs folder for `airflow dags test`, and the three-broker Kafka
cluster (`kafka3`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.tooling.cluster import SharedKafkaCluster
from tests.tooling.pipeline_data import SCHEMA

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gx_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import great_expectations as gx
    import great_expectations.expectations as gxe

    from offsetflow.job.quality import configure_project

    ctx = gx.get_context(mode="file", project_root_dir=str(tmp_path))
    ctx.suites.add_or_update(gx.ExpectationSuite(name="amounts", expectations=[
        gxe.ExpectColumnValuesToBeBetween(column="amount", min_value=0, max_value=1000),
        gxe.ExpectColumnValuesToNotBeNull(column="event_id"),
    ]))
    ctx.suites.add_or_update(gx.ExpectationSuite(name="seqs", expectations=[
        gxe.ExpectColumnValuesToBeBetween(column="seq", min_value=0, max_value=49),
    ]))
    configure_project(ctx)  # set-up time, once: runs only read it
    monkeypatch.setenv("OFFSETFLOW_GX_ROOT", str(tmp_path))
    return tmp_path


@pytest.fixture
def airflow_project(tmp_path: Path, secret_dsn: tuple[str, str], kafka_bootstrap: str,
                    make_topic: Any, unique: str) -> dict[str, Any]:
    """A pipelines folder with one test pipeline and a DAGs folder generated for it."""
    from offsetflow.cli import main as offsetflow_main

    topic = make_topic("dag", 2)
    name = f"dagtest_{unique}"
    pipelines = tmp_path / "pipelines"
    dags = tmp_path / "dags"
    pipelines.mkdir()
    (dags / "pipelines").mkdir(parents=True)
    cfg = {"name": name, "schedule": None, "retries": 0,
           "kafka": {"bootstrap_servers": kafka_bootstrap},
           "source": {"topics": [topic], "max_records_per_partition": 400},
           "format": {"type": "json", "schema": dict(SCHEMA)},
           "sink": {"connection": "${OFFSETFLOW_TEST_DSN}", "table": f"dag_{unique}"}}
    (pipelines / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    for f in ("offsetflow_backfill.py", "offsetflow_replay.py"):
        shutil.copy(ROOT / "dags" / f, dags / f)
    env = {**os.environ, "OFFSETFLOW_PIPELINES_DIR": str(pipelines),
           "AIRFLOW__CORE__DAGS_FOLDER": str(dags), "OFFSETFLOW_TEST_DSN": secret_dsn[0]}
    os.environ["OFFSETFLOW_TEST_DSN"] = secret_dsn[0]
    old = os.environ.get("OFFSETFLOW_PIPELINES_DIR")
    os.environ["OFFSETFLOW_PIPELINES_DIR"] = str(pipelines)
    try:
        assert offsetflow_main(["dags", "sync", "--dags-dir", str(dags / "pipelines")]) == 0
    finally:
        if old is None:
            os.environ.pop("OFFSETFLOW_PIPELINES_DIR")
        else:
            os.environ["OFFSETFLOW_PIPELINES_DIR"] = old
    return {"name": name, "topic": topic, "table": f"dag_{unique}", "env": env,
            "dags": dags, "pipelines": pipelines, "password": secret_dsn[1]}


_kafka3: list[SharedKafkaCluster] = []  # the session's, for the teardown hook below


@pytest.fixture(scope="session")
def _shared_kafka3() -> Iterator[SharedKafkaCluster]:
    shared = SharedKafkaCluster()
    _kafka3.append(shared)
    yield shared
    shared.stop()
    _kafka3.remove(shared)


@pytest.fixture
def kafka3(_shared_kafka3: SharedKafkaCluster) -> str:
    """The three-broker Kafka cluster's bootstrap servers (tests/tooling/cluster.py): one
    start for the files that use it (test_cluster_kafka.py, test_sink_kafka_cluster.py),
    not one per module: three broker JVMs started and stopped once less."""
    return _shared_kafka3.get()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop the three-broker cluster after a test that used it when the next one does not."""
    yield
    if "kafka3" not in getattr(item, "fixturenames", ()):
        return
    if nextitem is not None and "kafka3" in getattr(nextitem, "fixturenames", ()):
        return
    for shared in _kafka3:
        shared.stop()
