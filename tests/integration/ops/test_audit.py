"""Audit before publish on a PostgreSQL sink (issue 33), on real Kafka, PostgreSQL and Spark.

Two pipelines read one topic into tables of their own, `a` (audited replays) and `b` (direct
replays of the same windows): both run live, then both tables get the same damage (rows
deleted, changed, one row where the replay makes a dead letter), so a replay has something to
repair and its diff known counts. After publish `a` must be row by row what the direct replay
made of `b` (lineage column aside: the batch ids differ).
"""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import PipelineConfig, load_pipeline
from offsetflow.errors import AuditConflictError, AuditStateError, RequestError
from offsetflow.ledger import Ledger
from offsetflow.ops import (
    discard_audit,
    kafka_for,
    plan_window,
    publish_audit,
    run_batches,
    run_until_caught_up,
    show_audit,
    submit_window,
)
from offsetflow.plan import parse_request
from tests.tooling import chaos
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query

PER_PARTITION = 60
BAD_OFFSET = 20  # partition 0: a record that is not JSON (a dead letter)
LINEAGE = "_offsetflow_batch_id"


class Pair:
    """The audited pipeline (`a`) and its direct twin (`b`) on one topic."""

    def __init__(self, tmp: Path, dsn: str, bootstrap: str, topic: str, unique: str) -> None:
        self.dsn, self.topic, self.bootstrap = dsn, topic, bootstrap
        self.files: dict[str, Path] = {}
        for side in ("a", "b"):
            raw = {"name": f"au{side}_{unique}", "kafka": {"bootstrap_servers": bootstrap},
                   "source": {"topics": [topic], "starting": "earliest"},
                   "format": {"type": "json", "schema": dict(SCHEMA)},
                   "sink": {"connection": dsn, "table": f"au{side}_{unique}"},
                   "bad_records": "dead_letter",
                   "spark": {"master": "local[2]"}}
            self.files[side] = tmp / f"au{side}_{unique}.yaml"
            self.files[side].write_text(yaml.safe_dump(raw))
        self.a, self.b = (load_pipeline(self.files[s]) for s in ("a", "b"))

    def rows(self, cfg: PipelineConfig, where: str = "true") -> list[tuple[Any, ...]]:
        """Every column but the lineage column, in coordinate order."""
        cols = [c for c, in query(self.dsn, "SELECT column_name FROM information_schema.columns "
                                            "WHERE table_name = %s AND column_name <> %s "
                                            "ORDER BY ordinal_position",
                                  (cfg.sink.table, LINEAGE))]
        return query(self.dsn, f"SELECT {', '.join(chr(34) + c + chr(34) for c in cols)} "
                               f"FROM {cfg.sink.table} WHERE {where} "
                               f"ORDER BY partition, \"offset\"")

    def dead_letters(self, cfg: PipelineConfig) -> list[tuple[Any, ...]]:
        return query(self.dsn, f"SELECT topic, partition, \"offset\", value, stage FROM "
                               f"{cfg.dead_letter_table} WHERE pipeline = %s ORDER BY 1, 2, 3",
                     (cfg.name,))

    def damage(self, lo: int, hi: int) -> None:
        """The same damage in both tables inside [lo, hi) of both partitions: 3 rows gone,
        2 changed, and (if the bad record is in the window) a row where it is a dead
        letter."""
        for cfg in (self.a, self.b):
            t = cfg.sink.table
            query(self.dsn, f"DELETE FROM {t} WHERE partition = 1 AND \"offset\" IN "
                            f"({lo}, {lo + 1}, {lo + 2})")
            query(self.dsn, f"UPDATE {t} SET amount = -1 WHERE partition = 0 AND \"offset\" IN "
                            f"({lo}, {lo + 1})")
            if lo <= BAD_OFFSET < hi:  # a copy of the next row, at the dead letter's offset
                query(self.dsn, f"INSERT INTO {t} SELECT (jsonb_populate_record(NULL::{t}, "
                                f"to_jsonb(x) || '{{\"offset\": {BAD_OFFSET}}}')).* FROM {t} x "
                                f"WHERE partition = 0 AND \"offset\" = {BAD_OFFSET + 1}")

    def replay(self, cfg: PipelineConfig, lo: int, hi: int, spark: Any, audit: bool,
               run: bool = True) -> list[int]:
        req = parse_request("replay", {"pipeline": cfg.name, "topic": self.topic,
                                       "from_offset": lo, "until_offset": hi, "audit": audit})
        with Ledger(self.dsn) as ledger:
            ids = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req),
                                "test")
        if run:
            run_batches(cfg, self.dsn, ids, spark)
        return ids

    def audit_row(self, audit_id: int) -> dict[str, Any]:
        [(status, history, shadow)] = query(
            self.dsn, "SELECT status, history, shadow_table FROM offsetflow.audits "
                      "WHERE audit_id = %s", (audit_id,))
        return {"status": status, "history": history, "shadow": shadow}

    def exists(self, table: str) -> bool:
        return bool(query(self.dsn, "SELECT to_regclass(%s) IS NOT NULL", (table,))[0][0])


@pytest.fixture(scope="module")
def pair(spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path_factory: Any
         ) -> Iterator[Pair]:
    topic = f"audit-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=30)
    produce_plain(kafka_bootstrap, topic, 2 * BAD_OFFSET, "r", 2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, b"not json {", partition=0)  # offset BAD_OFFSET of partition 0
    assert p.flush(30) == 0
    produce_plain(kafka_bootstrap, topic, 2 * PER_PARTITION - 2 * BAD_OFFSET - 1, "s", 2,
                  start_seq=2 * BAD_OFFSET + 1)
    pr = Pair(tmp_path_factory.mktemp("audit"), pg_dsn, kafka_bootstrap, topic,
              uuid.uuid4().hex[:8])
    for cfg in (pr.a, pr.b):
        run_until_caught_up(cfg, pg_dsn, spark)
    assert len(pr.dead_letters(pr.a)) == 1
    yield pr
    admin.delete_topics([topic])


def test_audit_stages_beside_live_diffs_and_publishes_like_a_direct_replay(
        pair: Pair, spark: Any) -> None:
    lo, hi = 10, 50
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    live_before = pair.rows(pair.a)
    with Ledger(pair.dsn) as ledger:
        positions = ledger.positions(pair.a.name)
    [audit_id, *_] = pair.replay(pair.a, lo, hi, spark, audit=True)
    # staged: the live table and the positions are untouched, the rows are in the shadow
    assert pair.rows(pair.a) == live_before
    shadow = pair.audit_row(audit_id)["shadow"]
    assert shadow == f"public.{pair.a.sink.table}__audit_{audit_id}"
    assert query(pair.dsn, f"SELECT count(*) FROM {shadow}") == [(2 * (hi - lo) - 1,)]
    with Ledger(pair.dsn) as ledger:
        assert ledger.positions(pair.a.name) == positions
    with pytest.raises(AuditStateError, match=rf"audit {audit_id} is staging.*audit show"):
        publish_audit(pair.a, pair.dsn, audit_id)  # nobody has seen the diff

    # the live pipeline keeps running meanwhile
    produce_plain(pair.bootstrap, pair.topic, 4, "live", 2, start_seq=10_000)
    for cfg in (pair.a, pair.b):
        run_until_caught_up(cfg, pair.dsn, spark)

    out = show_audit(pair.a, pair.dsn, audit_id, by="alice")
    diff = out["diff"]
    # by hand: 2 x 40 offsets, one a dead letter -> 79 staged rows; live lost 3 rows of
    # partition 1, has 2 changed in partition 0 and a row at the dead letter's offset
    assert diff["totals"] == {"added": 3, "removed": 1, "changed": 2, "same": 74,
                              "staged_rows": 79, "live_rows": 77}
    assert diff["per_range"][f"{pair.topic}/0"] == {"added": 0, "removed": 1, "changed": 2,
                                                    "same": 37}
    assert diff["per_range"][f"{pair.topic}/1"] == {"added": 3, "removed": 0, "changed": 0,
                                                    "same": 37}
    assert [s["offset"] for s in diff["samples"]["changed"]] == [lo, lo + 1]
    assert diff["samples"]["changed"][0]["live"]["amount"] == -1
    assert diff["samples"]["changed"][0]["changed_columns"] == ["amount"]
    assert diff["samples"]["removed"][0]["staged"] is None
    assert diff["quality"]["suite"] is None
    assert out["status"] == "audited" and out["audited_by"] == "alice"

    res = publish_audit(pair.a, pair.dsn, audit_id, by="bob", reason="fix amounts")
    assert {k: res[k] for k in ("audit_id", "status", "changed", "rows", "target_table")} == {
        "audit_id": audit_id, "status": "published", "changed": True, "rows": 79,
        "target_table": pair.a.sink.table}
    # what the publish's Asset and OpenLineage events carry: the window and its batches
    assert res["kind"] == "replay" and res["window"]
    assert sum(b["rows_written"] for b in res["batches"]) == 79
    assert {b["target_table"] for b in res["batches"]} == {pair.a.sink.table}
    assert pair.rows(pair.a) == pair.rows(pair.b)  # what the direct replay made, row by row
    assert pair.dead_letters(pair.a) == pair.dead_letters(pair.b)
    assert not pair.exists(shadow)
    row = pair.audit_row(audit_id)
    assert [(h["status"], h["by"]) for h in row["history"]] == [
        ("staging", "test"), ("staged", "alice"), ("audited", "alice"), ("published", "bob")]
    assert publish_audit(pair.a, pair.dsn, audit_id)["changed"] is False  # idempotent
    with pytest.raises(AuditStateError, match="published already.*replay the window"):
        discard_audit(pair.a, pair.dsn, audit_id)
    with Ledger(pair.dsn) as ledger:
        assert ledger.positions(pair.a.name) == ledger.positions(pair.b.name)
        assert {ledger.get_batch(b).target_table for b in row_batches(pair, audit_id)} == {
            pair.a.sink.table}


def row_batches(pair: Pair, audit_id: int) -> list[int]:
    [(ids,)] = query(pair.dsn, "SELECT batch_ids FROM offsetflow.audits WHERE audit_id = %s",
                     (audit_id,))
    return list(ids)


def publish_process(pair: Pair, audit_id: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "offsetflow.cli", "--dsn", pair.dsn, "audit", "publish",
         str(audit_id), "--pipeline-file", str(pair.files["a"]), "--by", "killed"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def blocked_by(dsn: str, holder_pid: int) -> dict[int, str]:
    """The OffsetFlow backends waiting for a lock `holder_pid` holds, with their statement."""
    return {int(p): q for p, q in query(
        dsn, "SELECT pid, query FROM pg_stat_activity WHERE application_name = 'offsetflow' "
             "AND %s = ANY(pg_blocking_pids(pid))", (holder_pid,))}


HOLDS = {  # each holds a lock the publish takes at one step, in the publish's order:
    # (the lock, the statement the publish is found waiting in)
    "before the audit row": ("SELECT 1 FROM offsetflow.audits WHERE audit_id = {audit} "
                             "FOR UPDATE", "FROM offsetflow.audits"),
    "before the shadow's lock": ("LOCK TABLE {shadow} IN ROW EXCLUSIVE MODE", "LOCK TABLE"),
    "before the live table lock": ("LOCK TABLE {live} IN ROW EXCLUSIVE MODE", "LOCK TABLE"),
    "after the live window is deleted": ("LOCK TABLE {shadow_dl} IN ACCESS EXCLUSIVE MODE",
                                         "INSERT INTO"),
    "after the shadow is dropped": ("SELECT 1 FROM offsetflow.batches WHERE batch_id = "
                                    "ANY('{{{batches}}}'::bigint[]) FOR UPDATE",
                                    "UPDATE offsetflow.batches SET target_table"),
}


def test_publish_killed_at_every_step_then_rerun_publishes_once(pair: Pair, spark: Any
                                                                ) -> None:
    lo, hi = 0, 10
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    assert show_audit(pair.a, pair.dsn, audit_id)["diff"]["totals"]["added"] == 3
    before = pair.rows(pair.a)
    shadow = pair.audit_row(audit_id)["shadow"]
    [(shadow_dl,)] = query(pair.dsn, "SELECT shadow_dead_letter_table FROM offsetflow.audits "
                                     "WHERE audit_id = %s", (audit_id,))
    for step, (hold, waiting_in) in HOLDS.items():
        holder = psycopg2.connect(pair.dsn, application_name="offsetflow-chaos")
        try:
            with holder.cursor() as cur:
                cur.execute(hold.format(audit=audit_id, live=pair.a.sink.table, shadow=shadow,
                                        shadow_dl=shadow_dl,
                                        batches=",".join(map(str, row_batches(pair,
                                                                              audit_id)))))
                proc = publish_process(pair, audit_id)
                pid = holder.get_backend_pid()
                chaos.wait_for(lambda p=proc, h=pid: bool(blocked_by(pair.dsn, h))  # type: ignore[misc]
                               or p.poll() is not None, 60, f"publish to wait {step}")
                assert proc.poll() is None, proc.communicate()[0].decode()
                assert [waiting_in in q for q in blocked_by(pair.dsn, pid).values()] == [True]
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                for pid in blocked_by(pair.dsn, holder.get_backend_pid()):
                    query(pair.dsn, "SELECT pg_terminate_backend(%s)", (pid,))
        finally:
            holder.rollback()
            holder.close()
        assert pair.rows(pair.a) == before, step  # nothing of a killed publish is visible
        assert pair.audit_row(audit_id)["status"] == "audited", step
        assert pair.exists(shadow), step
    proc = publish_process(pair, audit_id)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0 and "published 20 rows" in out, out
    proc = publish_process(pair, audit_id)  # a rerun after the one that got through
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0 and "already published" in out, out
    assert pair.rows(pair.a) == pair.rows(pair.b)
    assert pair.dead_letters(pair.a) == pair.dead_letters(pair.b)
    assert [h["status"] for h in pair.audit_row(audit_id)["history"]].count("published") == 1


def test_publish_refuses_a_changed_live_window_and_publishes_once_when_raced(
        pair: Pair, spark: Any) -> None:
    lo, hi = 50, 60
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    # a second audit, or a direct replay, of an open audit's coordinates is refused
    for audit in (True, False):
        with pytest.raises(RequestError, match=rf"overlaps open audit\(s\) \[{audit_id}\]"):
            pair.replay(pair.a, 55, 60, spark, audit=audit, run=False)
    show_audit(pair.a, pair.dsn, audit_id)
    # a writer changes the live window after the diff: publish is refused, nothing moves
    query(pair.dsn, f"UPDATE {pair.a.sink.table} SET amount = -2 WHERE partition = 1 AND "
                    f"\"offset\" = {lo}")
    before = pair.rows(pair.a)
    with pytest.raises(AuditConflictError, match=rf"changed since the diff.*audit show "
                                                 rf"{audit_id} --refresh"):
        publish_audit(pair.a, pair.dsn, audit_id)
    assert pair.rows(pair.a) == before
    diff = show_audit(pair.a, pair.dsn, audit_id, refresh=True)["diff"]
    assert diff["totals"]["changed"] == 1
    # two publishes at once: one publishes, the other finds it published
    results: list[Any] = []

    def publish() -> None:
        try:
            results.append(publish_audit(pair.a, pair.dsn, audit_id)["changed"])
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            results.append(e)

    threads = [threading.Thread(target=publish) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [False, True], results
    assert query(pair.dsn, f"SELECT count(*), count(DISTINCT (partition, \"offset\")) FROM "
                           f"{pair.a.sink.table} WHERE \"offset\" >= {lo} AND "
                           f"\"offset\" < {hi}") == [(20, 20)]


def test_discard_leaves_no_trace_and_a_dropped_or_renamed_live_table_refuses_publish(
        pair: Pair, spark: Any) -> None:
    lo, hi = 50, 60
    pair.damage(lo, hi)
    before, dead_before = pair.rows(pair.a), pair.dead_letters(pair.a)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    show_audit(pair.a, pair.dsn, audit_id)
    table = pair.a.sink.table
    query(pair.dsn, f"ALTER TABLE {table} RENAME TO {table}_moved")
    try:
        with pytest.raises(AuditStateError, match=rf"live table {table} is gone.*rename it "
                                                  rf"back, or discard"):
            publish_audit(pair.a, pair.dsn, audit_id)
    finally:
        query(pair.dsn, f"ALTER TABLE {table}_moved RENAME TO {table}")
    shadow = pair.audit_row(audit_id)["shadow"]
    res = discard_audit(pair.a, pair.dsn, audit_id, by="carol", reason="wrong window")
    assert res["changed"] is True
    assert not pair.exists(shadow)
    assert pair.rows(pair.a) == before and pair.dead_letters(pair.a) == dead_before
    assert discard_audit(pair.a, pair.dsn, audit_id)["changed"] is False  # idempotent
    with pytest.raises(AuditStateError, match=rf"audit {audit_id} was discarded.*carol"):
        publish_audit(pair.a, pair.dsn, audit_id)
    row = pair.audit_row(audit_id)
    assert row["status"] == "discarded"
    assert row["history"][-1]["by"] == "carol"
    assert row["history"][-1]["reason"] == "wrong window"
    # the window is free again: a direct replay repairs it
    pair.replay(pair.a, lo, hi, spark, audit=False)
    assert query(pair.dsn, f"SELECT count(*), count(*) FILTER (WHERE amount < 0) FROM {table} "
                           f"WHERE \"offset\" >= {lo} AND \"offset\" < {hi}") == [(20, 0)]


def test_discard_of_a_window_still_staging_abandons_its_batches(pair: Pair, spark: Any
                                                                ) -> None:
    ids = pair.replay(pair.a, 40, 50, spark, audit=True, run=False)  # planned, not run
    out = show_audit(pair.a, pair.dsn, ids[0])
    assert out["status"] == "staging" and "run-batch" in out["next"]
    with pytest.raises(AuditStateError, match="is staging"):
        publish_audit(pair.a, pair.dsn, ids[0])
    assert discard_audit(pair.a, pair.dsn, ids[-1])["changed"] is True  # any batch names it
    with Ledger(pair.dsn) as ledger:
        assert {ledger.get_batch(b).status for b in ids} == {"abandoned"}
    assert pair.audit_row(ids[0])["status"] == "discarded"


def test_publish_if_within_limits_publishes_only_a_small_enough_diff(pair: Pair, spark: Any
                                                                    ) -> None:
    pair.damage(30, 40)  # 3 rows gone, 2 changed: 5 changes
    [audit_id] = pair.replay(pair.a, 30, 40, spark, audit=True)
    show_audit(pair.a, pair.dsn, audit_id)
    before = pair.rows(pair.a)
    with pytest.raises(AuditStateError, match=r"changes 5 rows \(3 added, 0 removed, 2 "
                                              r"changed\), more than the 4 allowed"):
        publish_audit(pair.a, pair.dsn, audit_id, by="cron", max_changes=4)
    assert pair.rows(pair.a) == before
    assert publish_audit(pair.a, pair.dsn, audit_id, by="cron", max_changes=5)["changed"]
    assert query(pair.dsn, f"SELECT count(*), count(*) FILTER (WHERE amount < 0) FROM "
                           f"{pair.a.sink.table} WHERE \"offset\" >= 30 AND "
                           f"\"offset\" < 40") == [(20, 0)]


def test_publish_refuses_a_live_change_committed_while_the_diff_was_made(
        pair: Pair, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer commits into the live window after the diff's rows are read but before its
    digest is: the diff never showed that change, so publish must refuse it (the digest
    has to describe the very rows the diff compared)."""
    lo, hi = 0, 10
    table = pair.a.sink.table
    pair.damage(lo, hi)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    module = importlib.import_module("offsetflow.commit.audit")
    rows_at, raced = module._rows_at, []  # noqa: SLF001 - the moment between two statements

    def racing(cur: Any, t: str, at: Any) -> Any:  # the sample rows, read after the counts
        if not raced:
            raced.append(query(pair.dsn, f"UPDATE {table} SET amount = -3 WHERE partition = 1 "
                                         f"AND \"offset\" = {lo + 5} RETURNING 1"))
        return rows_at(cur, t, at)

    monkeypatch.setattr(module, "_rows_at", racing)
    diff = show_audit(pair.a, pair.dsn, audit_id)["diff"]
    monkeypatch.undo()
    assert raced and diff["totals"] == {
        "added": 3, "removed": 0, "changed": 2, "same": 15, "staged_rows": 20,
        "live_rows": 17}, diff["totals"]  # the racing change is not in the diff
    before = pair.rows(pair.a)
    try:
        with pytest.raises(AuditConflictError, match="changed since the diff"):
            publish_audit(pair.a, pair.dsn, audit_id)
        assert pair.rows(pair.a) == before
    finally:
        if pair.audit_row(audit_id)["status"] != "published":
            discard_audit(pair.a, pair.dsn, audit_id)


def test_publish_refuses_a_shadow_changed_since_the_diff(pair: Pair, spark: Any) -> None:
    """Publish makes live what the operator saw in the diff, not a shadow edited after it
    (same row counts, other content)."""
    lo, hi = 10, 20
    pair.damage(lo, hi)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    show_audit(pair.a, pair.dsn, audit_id)
    shadow = pair.audit_row(audit_id)["shadow"]
    query(pair.dsn, f"UPDATE {shadow} SET amount = 12345 WHERE partition = 0 AND "
                    f"\"offset\" = {lo + 7}")
    before = pair.rows(pair.a)
    try:
        with pytest.raises(AuditStateError, match=rf"shadow {shadow} changed since the diff"):
            publish_audit(pair.a, pair.dsn, audit_id)
        assert pair.rows(pair.a) == before
    finally:
        if pair.audit_row(audit_id)["status"] != "published":
            discard_audit(pair.a, pair.dsn, audit_id)


def test_diff_counts_live_columns_the_shadow_lacks_and_refuses_a_live_column_gone(
        pair: Pair, spark: Any) -> None:
    """Publish deletes the window's live rows and inserts the shadow's: a live column the
    pipeline does not write (added by hand) is NULL afterwards in the window, so the diff
    must show those rows as changed; a column the shadow has and the live table lost
    (renamed, dropped) is named, not a raw SQL error."""
    lo, hi = 20, 30
    table = pair.a.sink.table
    query(pair.dsn, f"ALTER TABLE {table} ADD COLUMN note text")
    try:
        query(pair.dsn, f"UPDATE {table} SET note = 'kept by hand' WHERE partition = 1 AND "
                        f"\"offset\" IN ({lo + 1}, {lo + 2}, {lo + 3})")
        [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
        query(pair.dsn, f"ALTER TABLE {table} RENAME COLUMN amount TO amount_moved")
        try:
            with pytest.raises(AuditStateError, match=rf"live table {table} lacks column\(s\) "
                                                      rf"\['amount'\].*discard"):
                show_audit(pair.a, pair.dsn, audit_id)
        finally:
            query(pair.dsn, f"ALTER TABLE {table} RENAME COLUMN amount_moved TO amount")
        diff = show_audit(pair.a, pair.dsn, audit_id)["diff"]
        assert diff["totals"]["changed"] == 3, diff["totals"]
        assert {tuple(s["changed_columns"]) for s in diff["samples"]["changed"]} == {("note",)}
        publish_audit(pair.a, pair.dsn, audit_id)
        assert query(pair.dsn, f"SELECT count(note) FROM {table} WHERE \"offset\" >= {lo} "
                               f"AND \"offset\" < {hi}") == [(0,)]  # what the diff showed
    finally:
        query(pair.dsn, f"ALTER TABLE {table} DROP COLUMN IF EXISTS note")


def test_a_window_into_the_live_table_spelled_with_its_schema_is_refused_over_an_open_audit(
        pair: Pair, spark: Any) -> None:
    """`public.t` is `t`: a backfill into the live table named with its schema covers the
    coordinates of an open audit into `t` as much as one naming it bare."""
    lo, hi = 40, 50
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    req = parse_request("backfill", {"pipeline": pair.a.name, "topic": pair.topic,
                                     "from_offset": 45, "until_offset": 55,
                                     "target_table": f"public.{pair.a.sink.table}"})
    try:
        with Ledger(pair.dsn) as ledger, pytest.raises(
                RequestError, match=rf"overlaps open audit\(s\) \[{audit_id}\]"):
            submit_window(pair.a, ledger, plan_window(pair.a, ledger, kafka_for(pair.a), req),
                          "test")
    finally:
        discard_audit(pair.a, pair.dsn, audit_id)
