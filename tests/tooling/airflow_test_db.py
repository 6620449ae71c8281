"""Which test pipelines' DAGs an Airflow metadata database holds: the tests' own database
should hold them all, the stack's own (what `make demo` and the user's UI show) none."""

from __future__ import annotations

TEST_DAG_PATTERNS = ("offsetflow\\_dagtest\\_%", "offsetflow\\_rest\\_%")


def registered_test_dags(dsn: str) -> set[str]:
    """DAGs of test pipelines registered in the metadata database at `dsn`."""
    import psycopg2

    conn = psycopg2.connect(dsn, connect_timeout=30)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT to_regclass('public.dag') IS NOT NULL")
            row = cur.fetchone()
            if not row or not row[0]:
                return set()
            cur.execute("SELECT dag_id FROM dag WHERE dag_id LIKE %s OR dag_id LIKE %s",
                        TEST_DAG_PATTERNS)
            return {r[0] for r in cur.fetchall()}
    finally:
        conn.close()
