"""Credentials the stack's servers check, for tests whose pipelines read them from Airflow
connections: a SCRAM-SHA-512 user of Kafka's SASL listener (`OFFSETFLOW_KAFKA_SASL_BOOTSTRAP`)
and a PostgreSQL role that logs in with a password, each with a unique password (so a test can
grep for it) and removed afterwards; and their `AIRFLOW_CONN_*` values."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from offsetflow.ledger import Ledger


def sasl_bootstrap() -> str:
    """The stack's SASL_PLAINTEXT listener (SCRAM-SHA-512 logins only)."""
    bootstrap = os.environ.get("OFFSETFLOW_KAFKA_SASL_BOOTSTRAP")
    if not bootstrap:
        raise RuntimeError("OFFSETFLOW_KAFKA_SASL_BOOTSTRAP is not set: source .stack/env.sh "
                           "of a stack with the SASL listener (include/stack/stack.sh up)")
    return bootstrap


def _scram_change(bootstrap: str, user: str, password: str | None) -> None:
    from confluent_kafka.admin import (
        AdminClient,
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialDeletion,
        UserScramCredentialUpsertion,
    )

    admin = AdminClient({"bootstrap.servers": bootstrap})
    change: Any = (UserScramCredentialDeletion(user, ScramMechanism.SCRAM_SHA_512)
                   if password is None else
                   UserScramCredentialUpsertion(user, ScramCredentialInfo(
                       ScramMechanism.SCRAM_SHA_512, 4096), password.encode()))
    for f in admin.alter_user_scram_credentials([change]).values():
        f.result(30)


@contextlib.contextmanager
def scram_user(plain_bootstrap: str) -> Iterator[tuple[str, str]]:
    """(user, password) of a new SCRAM-SHA-512 user, made through the unauthenticated
    listener (the stack has no authorizer) and deleted afterwards."""
    user, password = f"of_scram_{uuid.uuid4().hex[:8]}", f"KafkaPw-{uuid.uuid4().hex}"
    _scram_change(plain_bootstrap, user, password)
    try:
        yield user, password
    finally:
        with contextlib.suppress(Exception):
            _scram_change(plain_bootstrap, user, None)


def kafka_connection(user: str, password: str, **extra: Any) -> dict[str, Any]:
    """An Airflow `kafka` connection (as `AIRFLOW_CONN_*` JSON) to the SASL listener."""
    return {"conn_type": "kafka", "extra": {
        "bootstrap.servers": sasl_bootstrap(), "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": user, "sasl.password": password,
        **extra}}


@dataclass(frozen=True)
class PasswordDatabase:
    role: str
    password: str
    database: str
    dsn: str  # as the role
    admin_dsn: str  # the same database as the stack's superuser

    def connection(self) -> dict[str, Any]:
        """An Airflow `postgres` connection (as `AIRFLOW_CONN_*` JSON) as the role."""
        p = psycopg2.extensions.parse_dsn(self.dsn)
        return {"conn_type": "postgres", "host": p["host"], "port": int(p["port"]),
                "schema": self.database, "login": self.role, "password": self.password}


@contextlib.contextmanager
def password_database(admin_dsn: str) -> Iterator[PasswordDatabase]:
    """A role that is no superuser, logging in with a unique password (the stack's pg_hba
    wants scram-sha-256 over TCP), owning a database of its own with the ledger migrated by
    it; both dropped afterwards."""
    uid = uuid.uuid4().hex[:8]
    role, password, db = f"of_app_{uid}", f"PgPw-{uuid.uuid4().hex}", f"of_auth_{uid}"
    su = psycopg2.connect(admin_dsn, connect_timeout=10)
    su.autocommit = True
    try:
        with su.cursor() as cur:
            cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(
                sql.Identifier(role)), (password,))
            cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(db), sql.Identifier(role)))
        dsn = psycopg2.extensions.make_dsn(admin_dsn, dbname=db, user=role, password=password)
        with Ledger(dsn) as ledger:
            ledger.upgrade()
        yield PasswordDatabase(role, password, db, dsn,
                               psycopg2.extensions.make_dsn(admin_dsn, dbname=db))
    finally:
        with su.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(db)))
            cur.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))
        su.close()


def conn_env(conn_id: str, value: dict[str, Any]) -> tuple[str, str]:
    """The environment variable Airflow reads connection `conn_id` from."""
    return f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(value)
