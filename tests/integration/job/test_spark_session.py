"""The session a run builds (job/spark_session.py) under spark-submit: OffsetFlow's default
executor conf (job/executor_conf.py) never replaces what spark-submit was given. That the
default reaches a cluster's executors is test_cluster_spark.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from offsetflow.job.executor_conf import C1_ONLY, EXECUTOR_JAVA_OPTIONS

ROOT = Path(__file__).resolve().parents[3]

SESSION_CONF = """
import json, sys
from offsetflow.config import load_pipeline
from offsetflow.job import build_spark, drop_session
spark = build_spark(load_pipeline(sys.argv[1]), "session-conf")
print("CONF=" + json.dumps(spark.sparkContext.getConf().get(sys.argv[2], "<unset>")))
drop_session(spark)
"""


@pytest.mark.parametrize("given", ["-Dofflauncher=1", ""])
def test_spark_submits_conf_wins_over_the_default_even_empty(tmp_path: Path,
                                                             given: str) -> None:
    """An Airflow operator's conf (or spark-defaults.conf) reaches the driver only as
    spark-submit's conf: its executor JVM options, even an empty value (the way to turn the
    default off there), stand for a pipeline whose own spark.conf is silent."""
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(yaml.safe_dump({
        "name": "session_conf", "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "source": {"topics": ["t"]}, "format": {"type": "json", "schema": {"id": "string"}},
        "sink": {"connection": "postgresql://u@127.0.0.1:1/db", "table": "t"}}))
    script = tmp_path / "session_conf.py"
    script.write_text(SESSION_CONF)
    p = subprocess.run(
        ["spark-submit", "--master", "local[1]", "--conf", f"{EXECUTOR_JAVA_OPTIONS}={given}",
         str(script), str(pipeline), EXECUTOR_JAVA_OPTIONS],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable,
             "OFFSETFLOW_SPARK_LOG_LEVEL": "ERROR"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    [line] = [s for s in p.stdout.splitlines() if s.startswith("CONF=")]
    # Spark puts its own module options before the value it was given
    options = json.loads(line.removeprefix("CONF=")).split()
    assert C1_ONLY not in options, options
    assert given in ("", options[-1]), options
