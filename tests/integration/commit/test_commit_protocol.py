"""The commit protocol on real services (issue 15): quality-gate dead letters are part of the
commit, a commit never waits forever on a lock, OffsetFlow's sessions are READ COMMITTED
whatever the server's default, and guard indexes are unique per table."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
from psycopg2 import sql

from offsetflow.commit import ensure_target
from offsetflow.errors import CommitLockTimeoutError
from offsetflow.job import run_batch
from offsetflow.job.tasks import stage_columns
from offsetflow.ledger import Ledger, connect
from offsetflow.ops import plan_only
from offsetflow.ops.runner import run_cycle
from tests.tooling import chaos
from tests.tooling.pipeline_data import (
    ledger_database,
    pipeline_for,
    produce_plain,
    produce_with_negative_amounts,
    query,
)


def test_quality_dead_letters_survive_a_failed_commit_and_its_retry(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        gx_root: Path) -> None:
    topic = make_topic("gxr", 1)
    bad = produce_with_negative_amounts(kafka_bootstrap, topic)
    table = f"gxr_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table,
                       quality={"suite": "amounts", "on_failure": "dead_letter"},
                       dead_letter_table=f"gxrdead_{unique}")
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    errors: list[BaseException] = []

    def first_run() -> None:
        try:
            run_batch(spark, cfg, bid, pg_dsn)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with chaos.hold_positions(pg_dsn, cfg.name):  # the commit blocks at its fence
        t = threading.Thread(target=first_run)
        t.start()
        chaos.wait_for(lambda: chaos.commit_waiting(pg_dsn), 300, "the commit to start")
        assert chaos.cut_commit_connection(pg_dsn) >= 1  # the commit dies after routing
        t.join(timeout=120)
    assert errors, "the first commit should have failed"
    res = run_batch(spark, cfg, bid, pg_dsn)  # the retry
    assert res.result.status == "committed"
    dl = query(pg_dsn, f"SELECT \"offset\", count(*) FROM gxrdead_{unique} GROUP BY 1 "
                       f"ORDER BY 1")
    assert dl == [(o, 1) for o in bad]  # each failing row exactly once
    offsets = sorted(r[0] for r in query(pg_dsn, f"SELECT \"offset\" FROM {table}"))
    assert offsets == sorted(set(range(100)) - set(bad))
    assert res.result.rows_written == 100 - len(bad)


def test_commit_waiting_on_a_lock_gives_up_naming_batch_and_holder(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFSETFLOW_COMMIT_LOCK_TIMEOUT_S", "3")
    topic = make_topic("lock", 2)
    produce_plain(kafka_bootstrap, topic, 200, f"l{unique}", 2)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"lock_{unique}")
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    outcome: list[BaseException | str] = []

    def run() -> None:
        try:
            outcome.append(run_batch(spark, cfg, bid, pg_dsn).result.status)
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    # a session that took the positions' row locks and went silent, like a driver whose
    # host died mid-commit
    with chaos.hold_positions(pg_dsn, cfg.name):
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=240)
        assert not t.is_alive(), "the commit still waits on the lock"
    assert len(outcome) == 1 and isinstance(outcome[0], CommitLockTimeoutError), outcome
    msg = str(outcome[0])
    assert f"batch {bid}: the commit waited more than 3s" in msg
    assert "offsetflow-chaos" in msg  # the holder, by application_name
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"


def test_lock_timeout_names_only_the_session_that_blocks(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the commit's own session, not a healthy commit of another pipeline that holds row
    locks on other ledger rows meanwhile: only the real blocker (review item 7)."""
    monkeypatch.setenv("OFFSETFLOW_COMMIT_LOCK_TIMEOUT_S", "3")
    topic = make_topic("lockb", 1)
    produce_plain(kafka_bootstrap, topic, 50, f"lb{unique}", 1)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"lockb_{unique}")
    other = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"lockother_{unique}")
    assert run_cycle(cfg, pg_dsn, spark).report is not None  # positions exist
    produce_plain(kafka_bootstrap, topic, 50, f"lb2{unique}", 1)
    planned, other_planned = plan_only(cfg, pg_dsn), plan_only(other, pg_dsn)
    assert planned.batch is not None and other_planned.batch is not None
    healthy = psycopg2.connect(pg_dsn, application_name="healthy-other-commit")
    try:
        with healthy.cursor() as cur:  # another pipeline's commit, in the middle of step 1
            cur.execute("SELECT 1 FROM offsetflow.batches WHERE batch_id = %s FOR UPDATE",
                        (other_planned.batch.batch_id,))
            with chaos.hold_positions(pg_dsn, cfg.name), \
                    pytest.raises(CommitLockTimeoutError) as err:
                run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
        healthy.rollback()
    finally:
        healthy.close()
    msg = str(err.value)
    assert "offsetflow-chaos" in msg
    assert "healthy-other-commit" not in msg and msg.count("pid ") == 1, msg
    assert run_batch(spark, cfg, planned.batch.batch_id, pg_dsn).result.status == "committed"


@pytest.fixture
def repeatable_read_dsn(admin_dsn: str, unique: str) -> Iterator[str]:
    """A database whose default isolation is REPEATABLE READ, with the ledger."""
    with ledger_database(admin_dsn, f"offsetflow_rr_{unique}",
                         "default_transaction_isolation = 'repeatable read'") as dsn:
        yield dsn


def test_commit_on_a_repeatable_read_server(spark: Any, repeatable_read_dsn: str,
                                            kafka_bootstrap: str, make_topic: Any,
                                            unique: str) -> None:
    dsn = repeatable_read_dsn
    plain = psycopg2.connect(dsn)
    with plain.cursor() as cur:
        cur.execute("SHOW default_transaction_isolation")
        assert cur.fetchone() == ("repeatable read",)  # the server's default really is RR
    plain.close()
    conn = connect(dsn)
    with conn.cursor() as cur:
        cur.execute("SHOW default_transaction_isolation")
        assert cur.fetchone() == ("read committed",)
        cur.execute("SHOW tcp_keepalives_idle")
        assert cur.fetchone() == ("30",)
    conn.close()
    topic = make_topic("rr", 2)
    produce_plain(kafka_bootstrap, topic, 1000, f"rr{unique}", 2)
    cfg = pipeline_for(topic, dsn, kafka_bootstrap, f"rr_{unique}", max_offsets_per_task=100)
    res = run_cycle(cfg, dsn, spark)  # append: the part-wise commit polls for markers
    assert res.report is not None and res.report.result.rows_written == 1000


def _unique_indexes(dsn: str, table: str) -> list[tuple[str, list[str]]]:
    """(index name, columns) of the table's unique indexes, read from the catalog."""
    return [(r[0], list(r[1])) for r in query(dsn, """
        SELECT c.relname, array_agg(a.attname::text ORDER BY k.ord)
          FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
          JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
         WHERE i.indrelid = %s::regclass AND i.indisunique GROUP BY c.relname""",
        (f"public.{table}",))]


def test_long_target_names_get_their_own_guard_index(pg_dsn: str, kafka_bootstrap: str,
                                                     unique: str) -> None:
    cfg = pipeline_for("t", pg_dsn, kafka_bootstrap, "x")
    cols = stage_columns(cfg)
    short = f"t{unique}_" + "x" * 45  # 55 bytes: its guard's name is cut at 63 bytes ...
    long = short + "_coords_"  # ... to this table's name (63 bytes), as is this one's own
    guard = ["partition", "offset", "topic"]
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        ensure_target(cur, long, cols, "append", [])
        ensure_target(cur, short, cols, "append", [])
    for t in (long, short):
        found = _unique_indexes(pg_dsn, t)
        assert [c for _, c in found] == [guard], (t, found)
        assert all(len(n.encode()) <= 63 for n, _ in found)
    # an existing target whose guard is gone gets it back: checked by definition
    query(pg_dsn, f"DROP INDEX {_unique_indexes(pg_dsn, short)[0][0]}")
    with Ledger(pg_dsn) as ledger, ledger.transaction() as cur:
        ensure_target(cur, short, cols, "append", [])
    assert [c for _, c in _unique_indexes(pg_dsn, short)] == [guard]


def test_sessions_render_timestamps_in_utc_whatever_the_server_default(
        repeatable_read_dsn: str, admin_dsn: str) -> None:
    """deleted_keys stores timestamptz key columns as JSON text: the session's TimeZone must
    not change it (review item 9)."""
    name = psycopg2.extensions.parse_dsn(repeatable_read_dsn)["dbname"]
    conn = psycopg2.connect(admin_dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql.SQL("ALTER DATABASE {} SET timezone = 'America/New_York'").format(
            sql.Identifier(name)))
    conn.close()
    ours = connect(repeatable_read_dsn)
    try:
        with ours, ours.cursor() as cur:
            cur.execute("SELECT current_setting('TimeZone'), "
                        "jsonb_build_array('2024-01-01 00:00:00+00'::timestamptz)::text")
            assert cur.fetchone() == ("UTC", '["2024-01-01T00:00:00+00:00"]')
    finally:
        ours.close()


def test_commit_refuses_when_another_run_changed_the_batch_config(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run still on the old config (a zombie) must not commit a stage that a run with
    --accept-config-change rebuilt under a new one (review item 6)."""
    import offsetflow.job.driver as job
    from offsetflow.errors import StaleConfigError

    topic = make_topic("cfgz", 1)
    produce_plain(kafka_bootstrap, topic, 20, f"cz{unique}", 1)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"cfgz_{unique}", mode="upsert",
                       key=["event_id"])
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    real_commit = job.commit_batch

    def adopted_meanwhile(*args: Any, **kw: Any) -> Any:
        conn = psycopg2.connect(pg_dsn)
        try:
            with conn, conn.cursor() as cur:  # what adopt_config of the other run recorded
                cur.execute("UPDATE offsetflow.batches SET config_fingerprint = 'other-run' "
                            "WHERE batch_id = %s", (bid,))
        finally:
            conn.close()
        return real_commit(*args, **kw)

    monkeypatch.setattr(job, "commit_batch", adopted_meanwhile)
    with pytest.raises(StaleConfigError, match=f"batch {bid}: its config changed"):
        run_batch(spark, cfg, bid, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM cfgz_{unique}")[0][0] == 0
