"""`airflow standalone` for integration tests: DAG files synced, started in its own process
group on its own port, healthy, an admin token; the whole group stopped afterwards. And one
with a test pipeline on a topic of its own and the window DAGs a test names."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from offsetflow.cli import main as offsetflow_main
from tests.tooling.pipeline_data import SCHEMA

ROOT = Path(__file__).resolve().parents[2]


def http(method: str, url: str, body: Any = None, token: str | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, str(e)


@contextlib.contextmanager
def airflow_standalone(base: Path, pipelines: Path, dag_dir: Path, port: int,
                       env: Mapping[str, str], health_timeout_s: float = 300
                       ) -> Iterator[tuple[str, str]]:
    """Yields the API's URL and an admin token. `env` is the whole environment of the
    Airflow processes (the DAG folder, port and API URLs are added here); the pipelines'
    generated DAGs go to `dag_dir/pipelines`."""
    env = {**env, "OFFSETFLOW_PIPELINES_DIR": str(pipelines),
           "AIRFLOW__CORE__DAGS_FOLDER": str(dag_dir), "AIRFLOW__API__PORT": str(port),
           "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
           "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/"}
    os.environ["OFFSETFLOW_PIPELINES_DIR"] = str(pipelines)
    try:
        assert offsetflow_main(["dags", "sync", "--dags-dir", str(dag_dir / "pipelines")]) == 0
    finally:
        os.environ.pop("OFFSETFLOW_PIPELINES_DIR", None)
    log = base / "standalone.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["airflow", "standalone"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=base)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + health_timeout_s
        while http("GET", f"{url}/api/v2/monitor/health")[0] != 200:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "airflow standalone did not become healthy"
            time.sleep(2)
        pw_file = Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
        code, body = http("POST", f"{url}/auth/token", {
            "username": "admin", "password": json.loads(pw_file.read_text())["admin"]})
        assert code in (200, 201), body
        yield url, body["access_token"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def run_standalone(base: Path, pg_dsn: str, kafka_bootstrap: str, port: int,
                   dags: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """`airflow standalone` in its own process group on `port`, with a test pipeline and
    the given window DAGs; yields its URL, an admin token and the pipeline's names."""
    from confluent_kafka.admin import AdminClient, NewTopic

    uid = uuid.uuid4().hex[:8]  # topics outlive a test session's database
    topic = f"rest-{uid}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    name = f"rest_{uid}"
    pipelines, dag_dir = base / "pipelines", base / "dags"
    pipelines.mkdir()
    (dag_dir / "pipelines").mkdir(parents=True)
    (pipelines / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": name, "schedule": None, "retries": 0,
        "kafka": {"bootstrap_servers": kafka_bootstrap}, "source": {"topics": [topic]},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": f"rest_{uid}"}}))
    for f in dags:
        shutil.copy(ROOT / "dags" / f, dag_dir)
    try:
        with airflow_standalone(base, pipelines, dag_dir, port, os.environ,
                                health_timeout_s=240) as (url, token):
            yield {"url": url, "token": token, "name": name, "topic": topic,
                   "table": f"rest_{uid}", "pipelines": pipelines,
                   "log": base / "standalone.log"}
    finally:
        admin.delete_topics([topic])
