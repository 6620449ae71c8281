"""`airflow standalone` for integration tests: DAG files synced, started in its own process
group on its own port, healthy, an admin token; the whole group stopped afterwards. And the
one the orchestration modules share (`shared_standalone`, `SharedStandalone`): the window
DAGs with a test pipeline per module, and the public API test's DAGs and connections."""

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

# An Airflow of the tests gets its DAG files before it starts and never sees them change,
# so its dag-processor parses each file once at start (a file not yet parsed goes to the
# front of the queue whatever the interval, and a file whose mtime changes is parsed again
# at once), instead of every 5 s as the stack's env.sh has it for a user editing DAGs
# (include/stack/stack.sh): each parse is a process importing OffsetFlow and the DAG file,
# ~6 files every 5 s for the minutes the shared standalone lives.
TEST_TUNING = {"AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
               "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "3600",
               "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}


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
    env = {**env, **TEST_TUNING, "OFFSETFLOW_PIPELINES_DIR": str(pipelines),
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


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it): an Airflow of the tests on it
    cannot meet another test run's on a fixed port."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def window_pipeline(pipelines: Path, pg_dsn: str, kafka_bootstrap: str,
                    prefix: str, connect_url: str | None = None) -> dict[str, Any]:
    """A test pipeline (YAML in `pipelines`) on a topic of its own with 2 partitions, for the
    window DAGs (replay, backfill); the caller deletes the topic (`delete_topic`). With
    `connect_url` its batches run on that Spark Connect server (`spark.launch: connect`), else
    with spark-submit."""
    from confluent_kafka.admin import AdminClient, NewTopic

    uid = uuid.uuid4().hex[:8]  # topics outlive a test session's database
    topic = f"{prefix}-{uid}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    name = f"{prefix}_{uid}"
    (pipelines / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": name, "schedule": None, "retries": 0,
        "kafka": {"bootstrap_servers": kafka_bootstrap}, "source": {"topics": [topic]},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": f"{prefix}_{uid}"},
        **({"spark": {"launch": "connect", "connect_url": connect_url}} if connect_url
           else {})}))
    return {"name": name, "topic": topic, "table": f"{prefix}_{uid}", "pipelines": pipelines}


def delete_topic(kafka_bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    AdminClient({"bootstrap.servers": kafka_bootstrap}).delete_topics([topic])


class SharedStandalone:
    """One `airflow standalone` for the test modules that need one (the window forms in a
    browser, replay through the REST API, the public API's DAGs): starting one costs ~40 s of
    a loaded machine's two cores, and each module started its own. Started by the first
    `get()`, stopped by `stop()` (tests/integration/orchestration/conftest.py: after the
    last test that uses it, so it does not idle beside the worker's later tests) or at the
    end of the session; a `get()` after a `stop()` starts a new one. `start` builds it (a
    context manager yielding what `get()` returns)."""

    def __init__(self, start: Any) -> None:
        self._start = start
        self._stack: contextlib.ExitStack | None = None
        self._info: dict[str, Any] | None = None

    def get(self) -> dict[str, Any]:
        if self._info is None:
            stack = contextlib.ExitStack()
            try:
                self._info = stack.enter_context(self._start())
            except BaseException:
                stack.close()
                raise
            self._stack = stack
        return self._info

    def stop(self) -> None:
        stack, self._stack, self._info = self._stack, None, None
        if stack is not None:
            stack.close()


PUBLIC_API_DAGS = '''
from datetime import datetime
from typing import Any

from airflow.sdk import DAG, Asset, task

from offsetflow.orchestration.operators import offsetflow_pipeline_tasks

CONFIG = {config!r}

with DAG(dag_id="offsetflow_rest_api_{uid}", schedule="@hourly", catchup=False,
         start_date=datetime(2026, 1, 1), max_active_runs=1, is_paused_upon_creation=True):
    offsetflow_pipeline_tasks(config=CONFIG, group_id="ingest")

with DAG(dag_id="offsetflow_rest_consumer_{uid}", is_paused_upon_creation=True,
         schedule=(Asset({inline_uri!r}) | Asset({yaml_uri!r})),
         start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=1):

    @task
    def seen(**context: Any) -> list[dict[str, Any]]:
        events = context["triggering_asset_events"]
        return [dict(e.extra, uri=e.asset.uri) for evs in events.values() for e in evs]

    seen()
'''


def public_api_project(pipelines: Path, dag_dir: Path, secret_dsn: tuple[str, str],
                       kafka_bootstrap: str, connect_url: str | None = None) -> dict[str, Any]:
    """The public API test's part of an Airflow project (test_public_api.py): credentials
    only in `AIRFLOW_CONN_*` connections (`conns`, for the Airflow processes' environment), a
    DAG written only with `offsetflow.orchestration.operators` (inline config) and one
    scheduled on the Asset events of its table and of a YAML pipeline's backfill side table;
    the YAML pipeline (connections only) in `pipelines`, its batches on the Spark Connect
    server at `connect_url` when given (the inline DAG's run with spark-submit). The caller
    deletes the topic."""
    import psycopg2.extensions
    from confluent_kafka.admin import AdminClient, NewTopic

    from offsetflow.orchestration.assets import table_uri

    uid = uuid.uuid4().hex[:8]
    topic = f"api-{uid}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    dsn, password = secret_dsn
    p = psycopg2.extensions.parse_dsn(dsn)
    kafka_id, pg_id = f"t_kafka_{uid}", f"t_pg_{uid}"
    conns = {
        f"AIRFLOW_CONN_{kafka_id.upper()}": json.dumps(
            {"conn_type": "kafka", "extra": {"bootstrap.servers": kafka_bootstrap}}),
        f"AIRFLOW_CONN_{pg_id.upper()}": json.dumps(
            {"conn_type": "postgres", "host": p["host"], "port": int(p["port"]),
             "schema": p["dbname"], "login": p["user"], "password": password})}
    inline = {"name": f"inl_{uid}", "kafka": {"conn_id": kafka_id},
              "source": {"topics": [topic], "max_records_per_partition": 1000},
              "format": {"type": "json", "schema": dict(SCHEMA)},
              "sink": {"conn_id": pg_id, "table": f"inl_{uid}"}, "retries": 0}
    yaml_name = f"rest_yaml_{uid}"
    (pipelines / f"{yaml_name}.yaml").write_text(yaml.safe_dump({
        **{k: v for k, v in inline.items() if k != "name"}, "name": yaml_name,
        "schedule": None, "sink": {"conn_id": pg_id, "table": f"yml_{uid}"},
        **({"spark": {"launch": "connect", "connect_url": connect_url}} if connect_url
           else {})}))
    inline_uri = table_uri(dsn, f"inl_{uid}")
    yaml_uri = table_uri(dsn, f"side_{uid}")  # the backfill's side table
    (dag_dir / f"api_{uid}.py").write_text(PUBLIC_API_DAGS.format(
        config=inline, uid=uid, inline_uri=inline_uri, yaml_uri=yaml_uri))
    return {"uid": uid, "topic": topic, "inline": inline, "yaml_name": yaml_name,
            "inline_uri": inline_uri, "yaml_uri": yaml_uri, "password": password,
            "conns": conns, "dag_ids": (f"offsetflow_rest_api_{uid}",
                                        f"offsetflow_rest_consumer_{uid}",
                                        f"offsetflow_{yaml_name}")}


@contextlib.contextmanager
def shared_standalone(base: Path, pg_dsn: str, secret_dsn: tuple[str, str],
                      kafka_bootstrap: str, connect_url: str | None = None
                      ) -> Iterator[dict[str, Any]]:
    """`airflow standalone` in its own process group on a free port, with what the modules
    sharing it need: both window DAGs, a window pipeline for the forms test (`forms`) and
    one for the REST test (`rest`), the public API test's DAGs, pipeline and connections
    (`api`). Credentials of the public API's DAGs come only from their connections: the
    stack's DSN and brokers are not in the Airflow processes' environment (the window
    pipelines name theirs in their YAML). Task logs go to `logs`.

    With `connect_url`, both window pipelines (the forms' and the REST test's) and the
    public API's YAML pipeline run their batches on that warm Spark Connect server: those
    tests assert what the form, `offsetflow replay` through the REST API, the backfill and
    its Asset events do, not spark-submit; the public API's inline DAG still runs its batch
    with spark-submit (the operator's spark-submit path through this real scheduler and
    executor; the REST replay's was the same operator's again)."""
    pipelines, dag_dir, logs = base / "pipelines", base / "dags", base / "logs"
    pipelines.mkdir()
    (dag_dir / "pipelines").mkdir(parents=True)
    for f in ("offsetflow_replay.py", "offsetflow_backfill.py"):
        shutil.copy(ROOT / "dags" / f, dag_dir)
    with contextlib.ExitStack() as stack:
        parts: dict[str, dict[str, Any]] = {}
        for prefix in ("ui", "rest"):
            part = window_pipeline(pipelines, pg_dsn, kafka_bootstrap, prefix, connect_url)
            stack.callback(delete_topic, kafka_bootstrap, part["topic"])
            parts["forms" if prefix == "ui" else "rest"] = part
        api = public_api_project(pipelines, dag_dir, secret_dsn, kafka_bootstrap,
                                 connect_url)
        stack.callback(delete_topic, kafka_bootstrap, api["topic"])
        env = {**os.environ, **api["conns"], "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(logs)}
        for k in ("OFFSETFLOW_PG_DSN", "OFFSETFLOW_KAFKA_BOOTSTRAP", "OFFSETFLOW_TEST_DSN"):
            env.pop(k, None)  # the public API's credentials come only from the connections
        url, token = stack.enter_context(
            airflow_standalone(base, pipelines, dag_dir, free_port(), env))
        yield {"url": url, "token": token, "log": base / "standalone.log", "logs": logs,
               "base": base, "pipelines": pipelines, "api": api, **parts}
