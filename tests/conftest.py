"""Session fixtures: the real services are started once (make up) and shared.

Integration tests each get their own topic names and their own PostgreSQL tables, so they
do not depend on order. The ledger lives in a database created fresh for the session.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


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
    conn = psycopg2.connect(admin_dsn, connect_timeout=30)  # the server may have restarted
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))
    conn.close()


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
