"""The ledger's schema migrations: applied in order by `offsetflow db upgrade`, and a
ledger a newer OffsetFlow migrated refused at every plan and run.

Why the refusal: a deploy rolled back after `db upgrade` runs code that does not honour what
the newer migrations record (e.g. the Kafka sink's commit records named by the ledger
identity would not be found, and a batch produced again).
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from typing import Any

import psycopg2.extensions

from offsetflow.errors import LedgerVersionError

LOCK = "offsetflow:migrations"


def upgrade(cur: psycopg2.extensions.cursor) -> list[str]:
    """Apply the pending migrations in order, once each, under an advisory lock; returns
    the versions applied now."""
    applied_now: list[str] = []
    cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (LOCK,))
    cur.execute("CREATE SCHEMA IF NOT EXISTS offsetflow")
    cur.execute("""CREATE TABLE IF NOT EXISTS offsetflow.schema_migrations (
                       version text PRIMARY KEY,
                       applied_at timestamptz NOT NULL DEFAULT now())""")
    cur.execute("SELECT version FROM offsetflow.schema_migrations")
    done = {row[0] for row in cur.fetchall()}
    refuse_unknown(done)
    for f in _migration_files():
        version = f.name.removesuffix(".sql")
        if version in done:
            continue
        cur.execute(f.read_text())
        cur.execute("INSERT INTO offsetflow.schema_migrations (version) VALUES (%s)",
                    (version,))
        applied_now.append(version)
    return applied_now


def _migration_files() -> list[Any]:
    return sorted((f for f in resources.files("offsetflow.migrations").iterdir()
                   if f.name.endswith(".sql")), key=lambda f: f.name)


def refuse_unknown(applied: Iterable[str]) -> None:
    """Refuse a ledger with migrations this version does not know (module docstring)."""
    known = {f.name.removesuffix(".sql") for f in _migration_files()}
    if not known:
        raise LedgerVersionError("this installation of OffsetFlow has no ledger migrations "
                                 "(offsetflow/migrations/*.sql is missing from the package): "
                                 "reinstall it")
    unknown = sorted(set(applied) - known)
    if unknown:
        raise LedgerVersionError(
            f"the ledger was migrated by a newer OffsetFlow (migrations {', '.join(unknown)} "
            f"are unknown to this version, which knows up to {max(known)}); run the version "
            f"that applied them, or newer")


def refuse_newer_ledger(cur: psycopg2.extensions.cursor) -> None:
    """`refuse_unknown` on the ledger behind `cur`, for every step that writes it (plans,
    window requests, position resets, a run's claim, the commit, abandon). Holds the
    migrations lock shared until `cur`'s transaction ends: a `db upgrade` waits for the
    steps under way and the steps after it see its migrations."""
    cur.execute("SELECT pg_advisory_xact_lock_shared(hashtext(%s))", (LOCK,))
    cur.execute("SELECT to_regclass('offsetflow.schema_migrations') IS NOT NULL")
    row = cur.fetchone()
    if not (row and row[0]):
        return
    cur.execute("SELECT version FROM offsetflow.schema_migrations")
    refuse_unknown(r[0] for r in cur.fetchall())
