"""`airflow dags test` of a DAG in a test's Airflow project (see the `airflow_project`
fixture in tests/integration/conftest.py): its output, asserted to have succeeded."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from tests.tooling.airflow_fork import dags_test_process

ROOT = Path(__file__).resolve().parents[2]


def dag_file(env: dict[str, str], dag_id: str) -> Path | None:
    """The file of `dag_id` in a test project's DAG folder (the window DAGs' files at its
    top, a pipeline's generated one in `pipelines/`), if it is there."""
    folder = env.get("AIRFLOW__CORE__DAGS_FOLDER")
    if not folder or not dag_id.startswith("offsetflow_"):
        return None
    name = dag_id.removeprefix("offsetflow_")
    for path in (Path(folder) / f"{dag_id}.py", Path(folder) / "pipelines" / f"{name}.py"):
        if path.is_file():
            return path
    return None


def dags_test(project: dict[str, Any], dag_id: str, conf: dict[str, Any] | None = None,
              expect_ok: bool = True) -> str:
    """`airflow dags test` of one DAG; Airflow parses (and writes to its database) only
    that DAG's file, not every DAG of the folder, when the file is known."""
    cmd = ["airflow", "dags", "test", dag_id]
    path = dag_file(project["env"], dag_id)
    if path is not None:
        cmd += ["--dagfile-path", str(path)]
    if conf is not None:
        cmd += ["--conf", json.dumps(conf)]
    with tempfile.TemporaryDirectory(prefix="dags-test-") as tmp:
        out_file = Path(tmp) / "out.txt"
        rc = run_airflow(cmd, project["env"], out_file)
        out = out_file.read_text(errors="replace")
    if expect_ok:
        assert rc == 0 and "failed" not in _final_state(out), out[-6000:]
    return out


def run_airflow(cmd: list[str], env: dict[str, str], out: Path, timeout: float = 600) -> int:
    """`cmd` (`airflow dags test ...`) with `env`, stdout and stderr to `out`: in a child
    forked from the warm Airflow process (tests/tooling/airflow_fork.py), or a process of
    its own with OFFSETFLOW_TESTS_DAGS_TEST_FORK=0 (in the session's environment or in
    `env`). Its exit code."""
    if env.get("OFFSETFLOW_TESTS_DAGS_TEST_FORK",
               os.environ.get("OFFSETFLOW_TESTS_DAGS_TEST_FORK", "1")) != "0":
        return dags_test_process().run(cmd, env, ROOT, out, timeout)
    with out.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout, cwd=ROOT).returncode


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
