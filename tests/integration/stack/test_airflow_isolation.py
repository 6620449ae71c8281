"""Tests leave the user's Airflow clean (issue 20 item 10): a DAG an Airflow test registers
lands in the tests' own metadata database, never in the stack's (what `make demo` and the
user's UI show). The session fixture `airflow_test_env` also checks this at the very end for
every offsetflow_dagtest_*/offsetflow_rest_* DAG the whole session registered."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.tooling.airflow_test_db import registered_test_dags

pytestmark = pytest.mark.slow  # one `airflow dags test`

ROOT = Path(__file__).resolve().parents[3]

DAG_FILE = '''
from datetime import datetime

from airflow.sdk import DAG, task

with DAG(dag_id="{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    @task
    def hello() -> int:
        return 1

    hello()
'''


def test_dags_an_airflow_test_registers_stay_out_of_the_stacks_metadata_db(
        tmp_path: Path, airflow_test_env: dict[str, str], unique: str) -> None:
    if not airflow_test_env:
        pytest.fail("the stack's Airflow is not configured (source .stack/env.sh / make up)")
    dag_id = f"offsetflow_dagtest_iso_{unique}"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{dag_id}.py").write_text(DAG_FILE.format(dag_id=dag_id))
    # exactly what the DAG tests do: os.environ plus their own DAGs folder
    env: dict[str, Any] = {**os.environ, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    p = subprocess.run(["airflow", "dags", "test", dag_id], env=env, capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    stack = registered_test_dags(airflow_test_env["OFFSETFLOW_AIRFLOW_STACK_DSN"])
    assert dag_id not in stack, "the test's DAG was registered in the stack's metadata DB"
    assert dag_id in registered_test_dags(airflow_test_env["OFFSETFLOW_AIRFLOW_TEST_DSN"])
