"""The default scheduled path reuses one Spark Connect session per pipeline (issue 19).

Every DAG run of a `spark.launch: connect` pipeline used to open a new server-side session
and release it at the end; each session started its own Python worker daemon and workers,
which outlived the session: the server's memory grew with every scheduled run, and every run
paid a cold Python worker start. Each run here is a process of its own, like an Airflow task.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from tests.tooling.chaos import proc_table
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query
from tests.tooling.services import STATE

ROOT = Path(__file__).resolve().parents[3]
STACK = ROOT / "include" / "stack" / "stack.sh"
PID_FILE = STATE / "connect" / "connect.pid"

# one scheduled DAG run's plan and run tasks (tasks.plan_task, tasks.connect_run_task)
RUN = """
import json, logging, os, sys, yaml
from offsetflow.config import parse_pipeline
from offsetflow.orchestration.tasks import connect_run_task, plan_task
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
path = sys.argv[1]
cfg = parse_pipeline(yaml.safe_load(open(path)), path, os.environ)
bid = plan_task(cfg, "test")
print(json.dumps({"batch_id": bid, "messages": connect_run_task(cfg, bid) if bid else []}))
"""

SESSION_RE = re.compile(r"Spark Connect session ([0-9a-f-]{36})")


def _pipeline(tmp_path: Path, name: str, topic: str, bootstrap: str, url: str) -> Path:
    raw = {"name": name, "kafka": {"bootstrap_servers": bootstrap},
           "source": {"topics": [topic], "starting": "earliest"},
           "format": {"type": "json", "schema": dict(SCHEMA)},
           "sink": {"connection": "${OFFSETFLOW_TEST_CONNECT_DSN}", "table": name},
           "spark": {"launch": "connect", "connect_url": url}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _dag_run(path: Path, dsn: str) -> tuple[dict[str, Any], str]:
    """One DAG run's tasks in a fresh process; returns its output and the session it used."""
    p = subprocess.run([sys.executable, "-c", RUN, str(path)], capture_output=True, text=True,
                       env={**os.environ, "OFFSETFLOW_TEST_CONNECT_DSN": dsn}, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    sessions = set(SESSION_RE.findall(p.stderr))
    assert len(sessions) <= 1, f"expected one session logged, got {sessions}"
    return json.loads(p.stdout.strip().splitlines()[-1]), next(iter(sessions), "")


def _server_python_processes() -> int:
    """Python processes under the Connect server's JVM (its worker daemons and workers)."""
    table = proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo, found = [int(PID_FILE.read_text().strip())], 0
    while todo:
        for c in children.get(todo.pop(), []):
            found += "python" in table[c][2]
            todo.append(c)
    return found


def _settled_python_processes(at_most: int | None, within_s: float = 10.0) -> int:
    """The server's Python process count once the run's workers are back in the daemon's
    idle pool: as soon as it is `at_most` or fewer, or (none given) the same in two reads
    0.2 s apart; else its last count when `within_s` has passed (the caller's assert then
    shows the growth)."""
    deadline = time.monotonic() + within_s
    last = _server_python_processes()
    while time.monotonic() < deadline:
        if at_most is not None and last <= at_most:
            return last
        time.sleep(0.2)
        now = _server_python_processes()
        if at_most is None and now == last:
            return now
        last = now
    return last


def _produce(bootstrap: str, topic: str, n: int, prefix: str, start: int) -> None:
    produce_plain(bootstrap, topic, n, prefix, 2, start_seq=start)


def test_consecutive_dag_runs_reuse_one_session_and_do_not_grow_the_servers_workers(
        spark_connect_url: str, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, tmp_path: Path) -> None:
    topic = make_topic("csess", 2)
    name = f"csess_{unique}"
    path = _pipeline(tmp_path, name, topic, kafka_bootstrap, spark_connect_url)
    counts: list[int] = []
    sessions: list[str] = []
    for run in range(3):
        _produce(kafka_bootstrap, topic, 200, name, run * 200)
        out, session = _dag_run(path, pg_dsn)
        assert out["batch_id"] is not None
        sessions.append(session)
        counts.append(_settled_python_processes(None if run == 0 else counts[0]))
    assert query(pg_dsn, f"SELECT count(*) FROM {name}") == [(600,)]
    assert max(counts[1:]) <= counts[0], f"server Python processes after each run: {counts}"
    assert len(set(sessions)) == 1 and sessions[0], sessions


def test_pipelines_do_not_share_a_session_and_a_run_after_a_server_restart_works(
        spark_connect_url: str, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, tmp_path: Path) -> None:
    topic = make_topic("csess2", 2)
    a, b = f"csa_{unique}", f"csb_{unique}"
    path_a = _pipeline(tmp_path, a, topic, kafka_bootstrap, spark_connect_url)
    path_b = _pipeline(tmp_path, b, topic, kafka_bootstrap, spark_connect_url)
    _produce(kafka_bootstrap, topic, 100, a, 0)
    _, session_a = _dag_run(path_a, pg_dsn)
    _, session_b = _dag_run(path_b, pg_dsn)
    assert session_a and session_b and session_a != session_b
    # a session the server closed (released, or expired by its idle timeout) cannot be
    # reopened under its id: the next run must get a working session all the same
    _release(spark_connect_url, session_a)
    _produce(kafka_bootstrap, topic, 100, a, 100)
    out, _ = _dag_run(path_a, pg_dsn)
    assert out["batch_id"] is not None
    # the server dies (kill -9) and comes back: it knows no session at all
    pid = int(PID_FILE.read_text().strip())
    os.kill(pid, 9)
    host, port = spark_connect_url.removeprefix("sc://").split("/")[0].rsplit(":", 1)
    deadline = time.monotonic() + 60
    while _listening(host, int(port)) and time.monotonic() < deadline:
        time.sleep(0.2)  # gone, or connect-start finds it still up
    subprocess.run(["bash", str(STACK), "connect-start"], check=True, timeout=300)
    _produce(kafka_bootstrap, topic, 100, a, 200)
    out, after = _dag_run(path_a, pg_dsn)
    assert out["batch_id"] is not None
    assert query(pg_dsn, f"SELECT count(*) FROM {a}") == [(300,)]
    assert query(pg_dsn, f"SELECT count(*) FROM {b}") == [(100,)]


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def _release(url: str, session_id: str) -> None:
    code = ("import sys\nfrom pyspark.sql import SparkSession\n"
            "s = SparkSession.builder.remote(sys.argv[1]).create()\ns.range(1).collect()\n"
            "s.stop()\n")
    sep = ";" if ";" in url else "/;"
    subprocess.run([sys.executable, "-c", code, f"{url.rstrip('/')}{sep}session_id={session_id}"],
                   check=True, timeout=300, capture_output=True)

