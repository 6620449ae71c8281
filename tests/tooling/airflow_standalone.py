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
    Airflow processes (the DAG folder, port and API URLs are added here, and a metadata
    database of its own: `own_database`); the pipelines' generated DAGs go to
    `dag_dir/pipelines`."""
    with own_database(env) as env:
        yield from _standalone(base, pipelines, dag_dir, port, env, health_timeout_s)


@contextlib.contextmanager
def own_database(env: Mapping[str, str]) -> Iterator[dict[str, str]]:
    """`env` with a metadata database of its own, copied from the migrated template the
    test session made (tests/conftest.py) and dropped afterwards: a scheduler sees only its
    own DAG runs, never those of an Airflow another pytest-xdist worker runs at the same
    time (which it would run with the wrong DAG folder). Without the template (not the
    local stack), `env` as it is."""
    import fcntl

    import psycopg2
    from psycopg2 import sql

    template = env.get("OFFSETFLOW_AIRFLOW_TEMPLATE_DB")
    url = env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "")
    admin = env.get("OFFSETFLOW_AIRFLOW_TEST_DSN")  # any database of that server will do
    if not template or not admin or not url.startswith("postgresql"):
        yield dict(env)
        return
    name = f"airflow_sa_{uuid.uuid4().hex[:8]}"

    def run(statement: sql.Composable) -> None:
        conn = psycopg2.connect(admin, connect_timeout=30)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
        finally:
            conn.close()

    # one copy at a time: a template being copied cannot be copied again at once
    with open(env["OFFSETFLOW_AIRFLOW_TEST_LOCK"], "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                             sql.Identifier(template)))
    try:
        yield {**env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{url.rpartition('/')[0]}/{name}"}
    finally:
        run(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _standalone(base: Path, pipelines: Path, dag_dir: Path, port: int,
                env: Mapping[str, str], health_timeout_s: float) -> Iterator[tuple[str, str]]:
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
