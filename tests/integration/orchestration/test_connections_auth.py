"""Credentials only in Airflow connections, checked by servers that require them (issue 29
item 3): Kafka's SASL_PLAINTEXT listener (SCRAM-SHA-512, a user of this module) and a
PostgreSQL role of this module with a password (the stack's pg_hba wants scram-sha-256 over
TCP), both given as `AIRFLOW_CONN_*` connections and turned into client settings by the
providers' hooks (the Kafka one with an allow-listed callback); the pipeline YAML names only
`kafka.conn_id` and `sink.conn_id`.

One real DAG run (`airflow dags test` of the generated DAG: plan, spark-submit in local mode,
publish) commits the records exactly once; then both passwords are looked for everywhere the
run left text: its output (the task logs, the driver's output, the spark-submit command line
as Airflow logged it), the OpenLineage events, every row of every table of the ledger
database and of Airflow's metadata database (XComs, rendered template fields, the audit log)
and the OffsetFlow page. A wrong SCRAM password fails the plan task with an error naming the
connection, not the password.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import psycopg2
import pytest
import yaml
from psycopg2 import sql

from tests.tooling.airflow_dags import dags_test
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query
from tests.tooling.secured_services import (
    conn_env,
    kafka_connection,
    password_database,
    sasl_bootstrap,
    scram_user,
)

pytestmark = pytest.mark.slow  # Airflow runs the pipeline's DAG with a Spark job

RECORDS = 400
CALLBACK = "tests.tooling.kafka_callbacks.on_error"


@pytest.fixture(scope="module")
def auth(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str,
         admin_dsn: str) -> Iterator[dict[str, Any]]:
    from confluent_kafka.admin import AdminClient, NewTopic

    from offsetflow.cli import main as offsetflow_main

    try:
        sasl_bootstrap()
    except RuntimeError as e:
        pytest.fail(str(e))
    base = tmp_path_factory.mktemp("auth")
    uid = uuid.uuid4().hex[:8]
    topic, name = f"auth-{uid}", f"auth_{uid}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    with contextlib.ExitStack() as stack:
        stack.callback(admin.delete_topics, [topic])
        user, kafka_pw = stack.enter_context(scram_user(kafka_bootstrap))
        pg = stack.enter_context(password_database(admin_dsn))
        kafka_id, pg_id, bad_id = f"auth_kafka_{uid}", f"auth_pg_{uid}", f"auth_badkafka_{uid}"
        bad_pw = f"WrongPw-{uuid.uuid4().hex}"
        # with a callback, allow-listed: the driver builds the settings with the Kafka hook
        # too (a callable cannot travel as JSON) and Spark's Python workers get it by reference
        conns = dict([conn_env(kafka_id, kafka_connection(user, kafka_pw, error_cb=CALLBACK)),
                      conn_env(bad_id, kafka_connection(user, bad_pw)),
                      conn_env(pg_id, pg.connection())])
        pipelines, dags = base / "pipelines", base / "dags"
        pipelines.mkdir()
        (dags / "pipelines").mkdir(parents=True)
        for pipeline, kid in ((name, kafka_id), (f"{name}_bad", bad_id)):
            (pipelines / f"{pipeline}.yaml").write_text(yaml.safe_dump({
                "name": pipeline, "schedule": None, "retries": 0,
                "kafka": {"conn_id": kid},
                "source": {"topics": [topic], "max_records_per_partition": 1000},
                "format": {"type": "json", "schema": dict(SCHEMA)},
                "sink": {"conn_id": pg_id, "table": f"auth_{uid}"}}))
        ol_file = base / "openlineage.jsonl"
        env = {**os.environ, **conns, "OFFSETFLOW_PIPELINES_DIR": str(pipelines),
               "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
               "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(base / "logs"),
               "AIRFLOW__APACHE_KAFKA__CALLBACK_ALLOWLIST": CALLBACK,
               "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                   {"type": "file", "log_file_path": str(ol_file), "append": True}),
               "AIRFLOW__OPENLINEAGE__NAMESPACE": "offsetflow-tests"}
        for k in ("OFFSETFLOW_PG_DSN", "OFFSETFLOW_KAFKA_BOOTSTRAP", "OFFSETFLOW_TEST_DSN"):
            env.pop(k, None)  # credentials come only from the connections
        with mock.patch.dict(os.environ, {"OFFSETFLOW_PIPELINES_DIR": str(pipelines)}):
            assert offsetflow_main(["dags", "sync", "--dags-dir", str(dags / "pipelines")]) == 0
        yield {"name": name, "topic": topic, "table": f"auth_{uid}", "env": env,
               "conns": conns, "pipelines": pipelines, "base": base, "ol_file": ol_file,
               "dsn": pg.dsn, "admin_dsn": pg.admin_dsn,
               "secrets": {"Kafka SCRAM password": kafka_pw, "PostgreSQL password": pg.password,
                           "wrong SCRAM password": bad_pw},
               "bad_id": bad_id}


def _found(text: str, secrets: dict[str, str]) -> list[str]:
    return [what for what, s in secrets.items() if s in text]


def _leaks_in_tables(dsn: str, secrets: dict[str, str]) -> list[str]:
    """'schema.table: what' for every row of every table of the database holding a secret."""
    out = []
    conn = psycopg2.connect(dsn, connect_timeout=30)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT table_schema, table_name FROM information_schema.tables "
                        "WHERE table_type = 'BASE TABLE' AND table_schema NOT IN "
                        "('pg_catalog', 'information_schema')")
            tables = cur.fetchall()
            for schema, table in tables:
                for what, s in secrets.items():
                    cur.execute(sql.SQL("SELECT count(*) FROM {}.{} t WHERE strpos(t::text, %s)"
                                        " > 0").format(sql.Identifier(schema),
                                                       sql.Identifier(table)), (s,))
                    row = cur.fetchone()
                    if row and row[0]:
                        out.append(f"{schema}.{table}: {what} in {row[0]} rows")
            assert tables, f"no tables in {dsn}"
    finally:
        conn.close()
    return out


def _plugin_page(a: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> str:
    """The OffsetFlow page's HTML and JSON, rendered by the plugin's own code in this process
    (the API server adds only Airflow's login around it) from this module's pipelines and
    connections."""
    from offsetflow.orchestration.plugin import entry_status, load_entries, render_page

    for k, v in a["conns"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AIRFLOW__APACHE_KAFKA__CALLBACK_ALLOWLIST", CALLBACK)
    entries = [e for e in load_entries(a["pipelines"]) if e.name == a["name"]]
    statuses = [entry_status(e) for e in entries]
    assert statuses and not statuses[0].get("error"), statuses
    return render_page(statuses) + json.dumps(statuses)


def test_connections_only_pipeline_commits_once_and_no_secret_leaks(
        auth: dict[str, Any], kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a = auth
    produce_plain(kafka_bootstrap, a["topic"], RECORDS, f"auth{a['name']}", 2)
    out = dags_test(a, f"offsetflow_{a['name']}")
    assert "spark-submit" in out or "SparkSubmit" in out  # the command line was logged

    # exactly once, through the SCRAM listener and the password role
    rows = query(a["dsn"], f"SELECT count(*), count(DISTINCT (partition, \"offset\")) "
                           f"FROM {a['table']}")
    assert rows == [(RECORDS, RECORDS)]
    batches = query(a["dsn"], "SELECT kind, status, rows_written FROM offsetflow.batches "
                              "WHERE pipeline = %s", (a["name"],))
    assert batches == [("scheduled", "committed", RECORDS)]

    # no secret anywhere the run left text
    secrets = a["secrets"]
    leaks = [f"dags test output: {w}" for w in _found(out, secrets)]
    # `dags test` prints the task logs (above); files: the OpenLineage events, any log file
    files = [f for f in a["base"].rglob("*") if f.is_file()]
    assert a["ol_file"].exists(), "no OpenLineage events were written"
    leaks += [f"{f}: {w}" for f in files for w in _found(f.read_text(errors="replace"),
                                                         secrets)]
    leaks += [f"ledger {x}" for x in _leaks_in_tables(a["admin_dsn"], secrets)]
    # the scan reads the rows it must: the run's batch and the sink table (the pipeline's
    # name is in both: the records' ids start with it), the run's XComs and rendered fields
    seen = _leaks_in_tables(a["admin_dsn"], {"name": a["name"]})
    assert {"offsetflow.batches", f"public.{a['table']}"} <= {
        x.split(":")[0] for x in seen}, seen
    metadata = os.environ["OFFSETFLOW_AIRFLOW_TEST_DSN"]
    seen = _leaks_in_tables(metadata, {"dag": f"offsetflow_{a['name']}"})
    assert {"public.xcom", "public.rendered_task_instance_fields"} <= {
        x.split(":")[0] for x in seen}, seen
    leaks += [f"Airflow metadata {x}" for x in _leaks_in_tables(metadata, secrets)]
    page = _plugin_page(a, monkeypatch)
    assert a["name"] in page
    leaks += [f"plugin page: {w}" for w in _found(page, secrets)]
    assert not leaks, leaks


def test_wrong_scram_password_fails_naming_the_connection(auth: dict[str, Any]) -> None:
    a = auth
    t0 = time.monotonic()
    out = dags_test(a, f"offsetflow_{a['name']}_bad", expect_ok=False)
    took = time.monotonic() - t0
    assert a["bad_id"] in out and "authentication" in out.lower(), out[-6000:]
    assert not _found(out, a["secrets"]), out[-6000:]
    assert query(a["dsn"], "SELECT count(*) FROM offsetflow.batches WHERE pipeline = %s",
                 (f"{a['name']}_bad",)) == [(0,)]
    assert took < 120, f"the failure took {took:.0f} s: authentication errors are not retried"
