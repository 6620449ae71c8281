"""`airflow dags test` of a DAG in a test's Airflow project (see the `airflow_project`
fixture in tests/integration/conftest.py): its output, asserted to have succeeded."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def dags_test(project: dict[str, Any], dag_id: str, conf: dict[str, Any] | None = None,
              expect_ok: bool = True) -> str:
    cmd = ["airflow", "dags", "test", dag_id]
    if conf is not None:
        cmd += ["--conf", json.dumps(conf)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=project["env"], timeout=600,
                       cwd=ROOT)
    out = p.stdout + p.stderr
    if expect_ok:
        assert p.returncode == 0 and "failed" not in _final_state(out), out[-6000:]
    return out


def _final_state(out: str) -> str:
    lines = [ln for ln in out.splitlines() if "DagRun Finished" in ln or "state=" in ln]
    return lines[-1] if lines else ""


def launch_connect(project: dict[str, Any], connect_url: str) -> None:
    """The project's pipeline runs its later batches on the warm Spark Connect server
    (`spark.launch: connect`) instead of a spark-submit JVM per run: for the tests that
    assert what the DAGs do, not how spark-submit starts the job."""
    path = project["pipelines"] / f"{project['name']}.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["spark"] = {"launch": "connect", "connect_url": connect_url}
    path.write_text(yaml.safe_dump(cfg))
