"""`evolve_target` (format.schema_evolution's DDL in the commit's transaction) on a real
PostgreSQL, where two commits and a hand-made column meet: a second commit that wanted
the same column waits for the first and then adds nothing; one that finds a column of
another type made meanwhile is refused before a row moves. No Kafka or Spark needed."""

from __future__ import annotations

import threading
import uuid

import psycopg2
import pytest

from offsetflow.commit.tables import evolve_target, target_column_types
from offsetflow.errors import SchemaMismatchError
from tests.tooling import chaos

ADD = (("coupon", "text"), ("qty", "bigint"))


def _table(dsn: str) -> str:
    name = f"public.evo_{uuid.uuid4().hex[:8]}"
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {name} (id bigint, qty integer)")
        cur.execute(f"INSERT INTO {name} VALUES (1, 1)")
    conn.close()
    return name


def test_two_commits_adding_the_same_column_the_second_waits_then_adds_nothing(
        pg_dsn: str) -> None:
    table = _table(pg_dsn)
    first = psycopg2.connect(pg_dsn, application_name="offsetflow-chaos")  # the blocker
    second = psycopg2.connect(pg_dsn, application_name="offsetflow")
    try:
        with first.cursor() as cur:
            assert evolve_target(cur, table, ADD) == ["add coupon text", "widen qty bigint"]
        done: list[object] = []

        def run() -> None:
            try:
                with second, second.cursor() as cur:
                    done.append(evolve_target(cur, table, ADD))
            except Exception as e:  # noqa: BLE001 - reported below
                done.append(e)

        t = threading.Thread(target=run)
        t.start()
        chaos.wait_for(lambda: chaos.commit_waiting(pg_dsn), 30,
                       "the second commit to wait for the first one's ALTER")
        first.commit()
        t.join(30)
        # it waited for the lock, then found both columns as it wants them
        assert done == [[]], done
    finally:
        first.close()
        second.close()
    assert target_column_types_of(pg_dsn, table) == {
        "id": "bigint", "qty": "bigint", "coupon": "text"}


def test_a_column_of_another_type_made_by_hand_meanwhile_is_refused_in_the_commit(
        pg_dsn: str) -> None:
    table = _table(pg_dsn)
    with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"ALTER TABLE {table} ADD COLUMN coupon bigint")  # by hand
    conn.close()
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur, pytest.raises(SchemaMismatchError) as e:
            evolve_target(cur, table, ADD)
        conn.rollback()
    finally:
        conn.close()
    assert "has column 'coupon' of type bigint, but the reader schema's field 'coupon' " \
           "needs text" in str(e.value)
    # nothing of the evolution applied: qty is not widened either
    assert target_column_types_of(pg_dsn, table)["qty"] == "integer"


def target_column_types_of(dsn: str, table: str) -> dict[str, str]:
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        out = target_column_types(cur, table)
    conn.close()
    return out
