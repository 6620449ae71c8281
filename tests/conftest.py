"""Session fixtures: the real services are started once (make up) and shared.

Integration tests each get their own topic names and their own PostgreSQL tables, so they
do not depend on order. The ledger lives in a database created fresh for the session.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV_FILE = ROOT / ".stack" / "env.sh"


def _load_stack_env() -> None:
    """Tests run under `make test`, which sources .stack/env.sh; direct pytest runs too."""
    if os.environ.get("OFFSETFLOW_PG_DSN") or not ENV_FILE.exists():
        return
    for line in ENV_FILE.read_text().splitlines():
        m = re.match(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line.strip())
        if m:
            value = shlex.split(m.group(2))[0] if m.group(2) else ""
            os.environ.setdefault(m.group(1), os.path.expandvars(value))


_load_stack_env()
# Spark's Python workers and job processes import test tooling (`tests.tooling.chaos`
# transforms): they inherit PYTHONPATH, not pytest's sys.path
if str(ROOT) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


# Every Spark driver a test starts (the session fixture, `offsetflow run-batch` processes,
# spark-submit from Airflow tasks) is a short JVM on small data: C1 only, one compiler
# thread and the serial collector halve its CPU (14 -> 8 CPU-seconds to start a local
# session and run a small job, measured here) on a suite that keeps both cores busy. The
# product's own processes (make demo, bench, the Spark Connect server) are not affected.
os.environ.setdefault("SPARK_SUBMIT_OPTS",
                      "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:+UseSerialGC")


def pytest_report_header() -> str:
    from tests.tooling import services

    return services.disk_and_memory()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tests.tooling.serial import is_serial

    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            function = getattr(item, "originalname", None) or item.name
            if is_serial(Path(str(item.fspath)), function):
                item.add_marker(pytest.mark.serial)
    # files with a cluster, then files with long (`slow`) tests first, for `make check`'s
    # `--dist load` (test by test, in this order); `make test`'s `--dist loadfile` orders
    # whole files by recorded seconds instead (tests/tooling/xdist_groups.py)
    def files(marker: str) -> set[str]:
        return {str(i.fspath) for i in items if i.get_closest_marker(marker)}

    cluster, slow = files("cluster"), files("slow")
    items.sort(key=lambda i: (str(i.fspath) not in cluster, str(i.fspath) not in slow))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: runs without xdist too
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` keeping the files that share an airflow standalone on one worker
    (tests/tooling/xdist_groups.py)."""
    from tests.tooling.xdist_groups import make_scheduler

    return make_scheduler(config, log)


@pytest.fixture(scope="session")
def _stack_services() -> Any:
    from tests.tooling import services

    return services.watch()


@pytest.fixture(autouse=True)
def _services_stay_up(request: pytest.FixtureRequest,
                      _stack_services: Any) -> Iterator[None]:
    """An integration test after which the broker or PostgreSQL is gone (and not by a fault
    test's own hand: those start it again) fails with the cause, and the service is started
    again for the tests after it; if it cannot be, the session stops with the cause instead
    of failing every later test on `Connection refused`."""
    yield
    if "integration" not in request.keywords:
        return
    for svc in _stack_services.dead():
        why = _stack_services.diagnose(svc)
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:  # in the live log, where it died
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"\n[services] {why}", red=True)
        failed = _stack_services.restart(svc)
        if failed is not None:
            pytest.exit(f"{why}\nstarting it again failed:\n{failed}", returncode=3)
        pytest.fail(f"{why}\n(started again for the next tests)", pytrace=False)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    from confluent_kafka.admin import AdminClient

    bootstrap = os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"Kafka is not reachable at {bootstrap} ({e}); start it with `make up`")
    return bootstrap


@pytest.fixture(scope="session")
def admin_dsn() -> str:
    dsn = os.environ.get("OFFSETFLOW_PG_DSN")
    if not dsn:
        pytest.fail("OFFSETFLOW_PG_DSN is not set; start the stack with `make up`")
    return dsn


@pytest.fixture(scope="session")
def pg_dsn(admin_dsn: str) -> Iterator[str]:
    """A database of its own for this test session, with the ledger migrated."""
    import psycopg2
    from psycopg2 import sql

    from offsetflow.ledger import Ledger

    name = f"offsetflow_test_{os.getpid()}"
    try:
        conn = psycopg2.connect(admin_dsn, connect_timeout=10)
    except psycopg2.OperationalError as e:
        pytest.fail(f"PostgreSQL is not reachable ({e}); start it with `make up`")
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = psycopg2.extensions.make_dsn(admin_dsn, dbname=name)
    with Ledger(dsn) as ledger:
        ledger.upgrade()
    conn.close()
    yield dsn
    _drop_auto_task_files(dsn)
    conn = psycopg2.connect(admin_dsn, connect_timeout=30)  # the server may have restarted
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))
    conn.close()


def _drop_auto_task_files(dsn: str) -> None:
    """The task files this session's ledger left in `sink.task_files: auto`'s directory of
    this host (batches the tests leave open keep theirs, and the ledger that could sweep
    them is dropped next): without this every `make test` left a few in /tmp for good."""
    import psycopg2

    from offsetflow.ledger import ledger_files_glob, ledger_identity
    from offsetflow.sinks.kafka.taskfile import auto_directory

    with contextlib.suppress(Exception):  # best effort: the ledger may be gone already
        with contextlib.closing(psycopg2.connect(dsn, connect_timeout=10)) as conn, \
                conn.cursor() as cur:
            ident = ledger_identity(cur).installation_id
        for f in Path(auto_directory(None)).glob(ledger_files_glob(ident)):
            f.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def secret_dsn(pg_dsn: str, admin_dsn: str) -> Iterator[tuple[str, str]]:
    """A DSN whose password is unique, so tests can prove it never leaks: (dsn, password)."""
    import psycopg2
    from psycopg2 import sql

    role = f"of_secret_{os.getpid()}"
    password = f"S3cret-{uuid.uuid4().hex}"
    conn = psycopg2.connect(pg_dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        cur.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD %s").format(
            sql.Identifier(role)), (password,))
    conn.close()
    yield psycopg2.extensions.make_dsn(pg_dsn, user=role, password=password), password


# -- Airflow of the tests ------------------------------------------------------------------
# Tests that run Airflow (dags test, standalone, api-server) register their DAGs in a metadata
# database; the stack's own (`airflow`, what `make demo` and the user's UI show) must not fill
# up with offsetflow_dagtest_*/offsetflow_rest_* DAGs whose files live in pytest's temporary
# folders. Integration sessions therefore point every Airflow process they start at a
# database `airflow_test` and a home `.stack/airflow-test` of their own.
AIRFLOW_TEST_DB = "airflow_test"
AIRFLOW_TEMPLATE_DB = "airflow_test_template"
AIRFLOW_TEST_HOME = ROOT / ".stack" / "airflow-test"


def _alchemy_db(url: str, db: str) -> str:
    """The SQLAlchemy URL `url` with its database replaced by `db`."""
    base, _, _ = url.rpartition("/")
    return f"{base}/{db}"


def _stack_fernet_key() -> str | None:
    """The stack's Fernet key, so connection rows copied from its database decrypt."""
    if os.environ.get("AIRFLOW__CORE__FERNET_KEY"):
        return os.environ["AIRFLOW__CORE__FERNET_KEY"]
    cfg = Path(os.environ.get("AIRFLOW_HOME", "")) / "airflow.cfg"
    if cfg.is_file():
        m = re.search(r"^fernet_key\s*=\s*(\S+)\s*$", cfg.read_text(), re.M)
        if m:
            return m.group(1)
    return None


def _copy_connections(src_dsn: str, dst_dsn: str) -> None:
    """The stack's Airflow connections (spark_default, offsetflow_*), rows as they are."""
    import psycopg2
    from psycopg2 import sql

    src = psycopg2.connect(src_dsn, connect_timeout=30)
    dst = psycopg2.connect(dst_dsn, connect_timeout=30)
    try:
        with src, src.cursor() as cur:
            cur.execute("SELECT * FROM connection")
            cols = [d.name for d in cur.description if d.name != "id"]
            rows = cur.fetchall()
            id_at = [d.name for d in cur.description].index("id")
        with dst, dst.cursor() as cur:
            cur.execute("DELETE FROM connection")
            q = sql.SQL("INSERT INTO connection ({}) VALUES ({})").format(
                sql.SQL(", ").join(map(sql.Identifier, cols)),
                sql.SQL(", ").join(sql.Placeholder() * len(cols)))
            for r in rows:
                cur.execute(q, [v for i, v in enumerate(r) if i != id_at])
    finally:
        src.close()
        dst.close()


@pytest.fixture(scope="session")
def airflow_test_env(admin_dsn: str) -> Iterator[dict[str, str]]:
    """Environment for Airflow processes of the tests: own metadata database (migrated once
    per Airflow version and PostgreSQL cluster) and home, the stack's connections copied in.
    At the end, fails if the stack's own metadata database gained test DAGs."""
    import subprocess

    import psycopg2
    from psycopg2 import sql

    from tests.tooling.airflow_test_db import registered_test_dags

    stack_url = os.environ.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "")
    if not stack_url.startswith("postgresql"):
        # not the local stack's Airflow (its env.sh was not sourced): nothing to protect here,
        # and Airflow tests that need the stack fail on their own with a clearer message
        yield {}
        return
    stack_dsn = psycopg2.extensions.make_dsn(admin_dsn, dbname=stack_url.rpartition("/")[2])
    test_dsn = psycopg2.extensions.make_dsn(admin_dsn, dbname=AIRFLOW_TEST_DB)
    before = registered_test_dags(stack_dsn)
    AIRFLOW_TEST_HOME.mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers share the database: one creates and migrates it, the others
    # wait for that and find it done
    lock = open(AIRFLOW_TEST_HOME / ".migrate.lock", "w")  # noqa: SIM115 - held to the end
    fcntl.flock(lock, fcntl.LOCK_EX)
    conn = psycopg2.connect(admin_dsn, connect_timeout=10)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (AIRFLOW_TEST_DB,))
        if cur.fetchone() is None:
            cur.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(AIRFLOW_TEST_DB)))
        cur.execute("SELECT system_identifier FROM pg_control_system()")
        row = cur.fetchone()
        cluster = str(row[0]) if row else "?"
    conn.close()
    env = {"AIRFLOW_HOME": str(AIRFLOW_TEST_HOME),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": _alchemy_db(stack_url, AIRFLOW_TEST_DB)}
    key = _stack_fernet_key()
    if key:
        env["AIRFLOW__CORE__FERNET_KEY"] = key
    from importlib.metadata import version

    stamp = AIRFLOW_TEST_HOME / ".migrated"
    want = f"{version('apache-airflow')}@{cluster}"
    try:
        migrated = stamp.exists() and stamp.read_text() == want and bool(
            query_one(test_dsn, "SELECT to_regclass('public.alembic_version') IS NOT NULL"))
        if not migrated:
            p = subprocess.run(["airflow", "db", "migrate"], env={**os.environ, **env},
                               capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                pytest.fail(f"airflow db migrate of {AIRFLOW_TEST_DB} failed:\n"
                            f"{p.stderr[-3000:]}")
            stamp.write_text(want)
        _copy_connections(stack_dsn, test_dsn)
        _refresh_template(admin_dsn, again=not migrated)
    finally:
        lock.close()  # releases the lock
    yield {**env, "OFFSETFLOW_AIRFLOW_TEST_DSN": test_dsn,
           "OFFSETFLOW_AIRFLOW_STACK_DSN": stack_dsn,
           "OFFSETFLOW_AIRFLOW_TEMPLATE_DB": AIRFLOW_TEMPLATE_DB,
           "OFFSETFLOW_AIRFLOW_TEST_LOCK": str(AIRFLOW_TEST_HOME / ".migrate.lock")}
    leaked = registered_test_dags(stack_dsn) - before
    if leaked:
        pytest.fail(f"tests registered DAGs in the stack's own Airflow metadata database "
                    f"(what `make demo` shows): {sorted(leaked)}")


def _refresh_template(admin_dsn: str, again: bool) -> None:
    """A copy of the migrated test database, connections included, that nothing connects
    to: each `airflow standalone` of the tests gets a database of its own from it in a
    second (tests/tooling/airflow_standalone.py), so two of them on two pytest-xdist workers
    never run each other's DAG runs. Made again after a migration (`again`), else only when
    missing: copying needs the test database unused, and the first worker through the
    migration lock may be running tests on it by now."""
    import psycopg2
    from psycopg2 import sql

    conn = psycopg2.connect(admin_dsn, connect_timeout=10)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (AIRFLOW_TEMPLATE_DB,))
            if cur.fetchone() is not None and not again:
                return
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(AIRFLOW_TEMPLATE_DB)))
            cur.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(AIRFLOW_TEMPLATE_DB), sql.Identifier(AIRFLOW_TEST_DB)))
    finally:
        conn.close()


def query_one(dsn: str, q: str) -> Any:
    import psycopg2

    conn = psycopg2.connect(dsn, connect_timeout=30)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(q)
            row = cur.fetchone()
            return row[0] if row else None
    finally:
        conn.close()


@pytest.fixture(scope="session", autouse=True)
def _airflow_of_the_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every Airflow process an integration session starts (they inherit os.environ) uses
    the tests' own metadata database; unit-only sessions skip this."""
    if not any("/integration/" in str(i.fspath) for i in request.session.items):
        yield
        return
    with mock.patch.dict(os.environ, request.getfixturevalue("airflow_test_env")):
        yield


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for the whole session (it takes ~10 s to start)."""
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    s = (SparkSession.builder.master("local[2]").appName("offsetflow-tests")
         .config("spark.sql.session.timeZone", "UTC").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def spark_connect_url() -> Iterator[str]:
    """The project's warm Spark Connect server (stack.sh connect-start, ~6 s); stopped at the
    end of the session only if this session started it."""
    import subprocess

    stack = str(ROOT / "include" / "stack" / "stack.sh")
    was_up = subprocess.run(["bash", stack, "status"], capture_output=True, text=True)
    started = "connect   up" not in was_up.stdout
    subprocess.run(["bash", stack, "connect-start"], check=True, timeout=180)
    yield os.environ.get("OFFSETFLOW_SPARK_CONNECT_URL", "sc://127.0.0.1:15002")
    if started:
        subprocess.run(["bash", stack, "connect-stop"], check=False, timeout=120)


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def make_topic(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    created: list[str] = []

    def make(prefix: str = "t", partitions: int = 3, config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        fut = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})])
        fut[name].result(timeout=30)
        created.append(name)
        return name

    yield make
    if created:
        for f in admin.delete_topics(created).values():
            with contextlib.suppress(Exception):
                f.result(timeout=30)
