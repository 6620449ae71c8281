"""Audit before publish on an Iceberg sink (issue 33): the window commits on a branch
`audit-<id>` of the live table, is diffed against main, then published into main in one
catalog commit (a fast-forward, or what a direct replay commits when main moved), on real
Kafka, PostgreSQL, Spark and a file warehouse.

As in ops/test_audit.py, two pipelines read one topic into tables of their own: `a`
(audited replays) and `b` (direct replays of the same windows), with the same damage done to
both tables first, so the diff has known counts and `a` after publish must be row by row
what the direct replay made of `b` (lineage column aside: the batch ids differ).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from pyiceberg import expressions

from offsetflow.config import PipelineConfig, load_pipeline
from offsetflow.errors import AuditConflictError, AuditStateError
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
from offsetflow.sinks.iceberg import audit as iceberg_audit
from offsetflow.sinks.iceberg import auditing
from tests.tooling.iceberg_rows import iceberg_table
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query

PER_PARTITION = 60
BAD_OFFSET = 20  # partition 0: a record that is not JSON (a dead letter)
ex: Any = expressions  # pydantic models: mypy cannot read their positional signatures
LINEAGE = "_offsetflow_batch_id"


class Pair:
    """The audited pipeline (`a`) and its direct twin (`b`) on one topic, each into an
    Iceberg table of its own in one warehouse."""

    def __init__(self, tmp: Path, dsn: str, bootstrap: str, topic: str, unique: str) -> None:
        self.dsn, self.topic, self.bootstrap = dsn, topic, bootstrap
        warehouse = tmp / "warehouse"
        warehouse.mkdir()
        self.files: dict[str, Path] = {}
        for side in ("a", "b"):
            raw = {"name": f"iau{side}_{unique}", "kafka": {"bootstrap_servers": bootstrap},
                   "source": {"topics": [topic], "starting": "earliest"},
                   "format": {"type": "json", "schema": dict(SCHEMA)},
                   "sink": {"type": "iceberg", "connection": dsn,
                            "table": f"lake.iau{side}_{unique}",
                            "catalog": {"warehouse": f"file://{warehouse}"},
                            "partition_by": ["partition"], "sort_by": ["offset"]},
                   "bad_records": "dead_letter",
                   "spark": {"master": "local[2]"}}
            self.files[side] = tmp / f"iau{side}_{unique}.yaml"
            self.files[side].write_text(yaml.safe_dump(raw))
        self.a, self.b = (load_pipeline(self.files[s]) for s in ("a", "b"))

    def table(self, cfg: PipelineConfig) -> Any:
        return iceberg_table(cfg, self.dsn)

    def rows(self, cfg: PipelineConfig, ref: str = "main") -> list[tuple[Any, ...]]:
        """Every column but the lineage column, in coordinate order, of `ref`'s head."""
        table = self.table(cfg)
        snap = table.current_snapshot() if ref == "main" else table.snapshot_by_name(ref)
        data = table.scan(snapshot_id=snap.snapshot_id).to_arrow().drop_columns([LINEAGE])
        return sorted((tuple(r.values()) for r in data.to_pylist()),
                      key=lambda r: (r[data.column_names.index("partition")],
                                     r[data.column_names.index("offset")]))

    def dead_letters(self, cfg: PipelineConfig) -> list[tuple[Any, ...]]:
        return query(self.dsn, f"SELECT topic, partition, \"offset\", value, stage FROM "
                               f"{cfg.dead_letter_table} WHERE pipeline = %s ORDER BY 1, 2, 3",
                     (cfg.name,))

    def damage(self, lo: int, hi: int) -> None:
        """The same damage in both tables inside [lo, hi): 3 rows of partition 1 gone, 2 of
        partition 0 changed, and (if the bad record is in the window) a row where it is a
        dead letter."""
        for cfg in (self.a, self.b):
            t = self.table(cfg)
            t.delete(ex.And(ex.EqualTo("partition", 1), ex.In("offset", {lo, lo + 1, lo + 2})))
            changed = ex.And(ex.EqualTo("partition", 0), ex.In("offset", {lo, lo + 1}))
            old = t.scan(row_filter=changed).to_arrow()
            t.delete(changed)
            t.append(old.set_column(old.schema.get_field_index("amount"), "amount",
                                    pa.array([-1.0] * old.num_rows, pa.float64())))
            if lo <= BAD_OFFSET < hi:  # a copy of the next row, at the dead letter's offset
                nxt = t.scan(row_filter=ex.And(ex.EqualTo("partition", 0),
                                               ex.EqualTo("offset", BAD_OFFSET + 1))).to_arrow()
                t.append(nxt.set_column(nxt.schema.get_field_index("offset"), "offset",
                                        pc.subtract(nxt["offset"], 1)))

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
        [(status, history, shadow, shadow_dl)] = query(
            self.dsn, "SELECT status, history, shadow_table, shadow_dead_letter_table FROM "
                      "offsetflow.audits WHERE audit_id = %s", (audit_id,))
        return {"status": status, "history": history, "shadow": shadow,
                "shadow_dl": shadow_dl}

    def branches(self, cfg: PipelineConfig) -> set[str]:
        return {r for r in self.table(cfg).metadata.refs if r != "main"}

    def publishes(self, cfg: PipelineConfig, audit_id: int) -> int:
        """Snapshots of main that say they publish this audit (a replay-like publish)."""
        from pyiceberg.table.snapshots import ancestors_of

        t = self.table(cfg)
        return sum(1 for s in ancestors_of(t.current_snapshot(), t.metadata)
                   if s.summary and s.summary.additional_properties.get(
                       iceberg_audit.SUMMARY_AUDIT) == str(audit_id))

    def live(self, spark: Any, n: int, seq: int) -> None:
        """The live pipelines go on: main moves."""
        produce_plain(self.bootstrap, self.topic, n, "live", 2, start_seq=seq)
        for cfg in (self.a, self.b):
            run_until_caught_up(cfg, self.dsn, spark)


@pytest.fixture(scope="module")
def pair(spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path_factory: Any
         ) -> Iterator[Pair]:
    topic = f"iaudit-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(timeout=30)
    produce_plain(kafka_bootstrap, topic, 2 * BAD_OFFSET, "r", 2)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, b"not json {", partition=0)  # offset BAD_OFFSET of partition 0
    assert p.flush(30) == 0
    produce_plain(kafka_bootstrap, topic, 2 * PER_PARTITION - 2 * BAD_OFFSET - 1, "s", 2,
                  start_seq=2 * BAD_OFFSET + 1)
    pr = Pair(tmp_path_factory.mktemp("iaudit"), pg_dsn, kafka_bootstrap, topic,
              uuid.uuid4().hex[:8])
    for cfg in (pr.a, pr.b):
        run_until_caught_up(cfg, pg_dsn, spark)
    assert len(pr.dead_letters(pr.a)) == 1
    yield pr
    admin.delete_topics([topic])


def test_audited_replay_commits_on_a_branch_and_publishes_what_a_direct_replay_makes(
        pair: Pair, spark: Any) -> None:
    """Main moves (the live pipeline) between staging and publish: publish applies the
    window as a direct replay (delete by coordinates + the staged files) in one commit."""
    lo, hi = 10, 50
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    live_before, dead_before = pair.rows(pair.a), pair.dead_letters(pair.a)
    main_before = pair.table(pair.a).current_snapshot().snapshot_id
    with Ledger(pair.dsn) as ledger:
        positions = ledger.positions(pair.a.name)
    [audit_id, *_] = pair.replay(pair.a, lo, hi, spark, audit=True)
    # staged: main, the dead letters and the positions untouched; the rows on the branch
    branch = f"audit-{audit_id}"
    assert pair.table(pair.a).current_snapshot().snapshot_id == main_before
    assert pair.rows(pair.a) == live_before and pair.dead_letters(pair.a) == dead_before
    assert pair.branches(pair.a) == {branch}
    assert pair.rows(pair.a, branch) == pair.rows(pair.b)  # what the direct replay made
    row = pair.audit_row(audit_id)
    assert row["shadow"] == f"{pair.a.sink.iceberg.identifier}@{branch}"  # type: ignore[union-attr]
    with Ledger(pair.dsn) as ledger:
        assert ledger.positions(pair.a.name) == positions
    with pytest.raises(AuditStateError, match=rf"audit {audit_id} is staging.*audit show"):
        publish_audit(pair.a, pair.dsn, audit_id)

    pair.live(spark, 4, 10_000)  # main moves: no fast-forward
    live_before = pair.rows(pair.a)

    out = show_audit(pair.a, pair.dsn, audit_id, by="alice")
    diff = out["diff"]
    # by hand: 2 x 40 offsets, one a dead letter -> 79 staged rows; main lost 3 rows of
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
    assert out["status"] == "audited" and out["audited_by"] == "alice"
    assert pair.rows(pair.a) == live_before  # the diff changes nothing

    res = publish_audit(pair.a, pair.dsn, audit_id, by="bob", reason="fix amounts")
    assert res["status"] == "published" and res["changed"] is True and res["rows"] == 79
    assert pair.rows(pair.a) == pair.rows(pair.b)  # row by row
    assert pair.dead_letters(pair.a) == pair.dead_letters(pair.b)
    assert pair.branches(pair.a) == set()
    published = pair.publishes(pair.a, audit_id)  # its delete and its append: one commit
    assert published >= 2
    assert not query(pair.dsn, "SELECT to_regclass(%s)", (row["shadow_dl"],))[0][0]
    assert publish_audit(pair.a, pair.dsn, audit_id)["changed"] is False  # idempotent
    assert pair.publishes(pair.a, audit_id) == published
    with Ledger(pair.dsn) as ledger:
        assert ledger.positions(pair.a.name) == ledger.positions(pair.b.name)
    pair.live(spark, 2, 10_100)  # the live pipeline goes on after it
    assert pair.rows(pair.a) == pair.rows(pair.b)


def test_publish_fast_forwards_main_when_it_has_not_moved_and_refuses_a_changed_window(
        pair: Pair, spark: Any) -> None:
    lo, hi = 50, 60
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    show_audit(pair.a, pair.dsn, audit_id)
    # a hand edit of main at the window's coordinates after the diff: refused
    t = pair.table(pair.a)
    t.delete(ex.And(ex.EqualTo("partition", 0), ex.EqualTo("offset", hi - 1)))
    before = pair.rows(pair.a)
    with pytest.raises(AuditConflictError, match=rf"changed since the diff.*audit show "
                                                 rf"{audit_id} --refresh"):
        publish_audit(pair.a, pair.dsn, audit_id)
    assert pair.rows(pair.a) == before and pair.branches(pair.a) == {f"audit-{audit_id}"}
    diff = show_audit(pair.a, pair.dsn, audit_id, refresh=True)["diff"]
    assert diff["totals"]["added"] == 4  # the 3 of the damage and the one deleted now
    publish_audit(pair.a, pair.dsn, audit_id)  # main moved (the edit): replay-like
    assert pair.rows(pair.a) == pair.rows(pair.b)

    # main untouched since the branch was cut: main becomes the branch's head
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    staged = show_audit(pair.a, pair.dsn, audit_id)["diff"]["shadow_digest"]
    publish_audit(pair.a, pair.dsn, audit_id)
    assert pair.table(pair.a).current_snapshot().snapshot_id == int(staged)
    assert pair.publishes(pair.a, audit_id) == 0 and pair.branches(pair.a) == set()
    assert pair.rows(pair.a) == pair.rows(pair.b)
    assert publish_audit(pair.a, pair.dsn, audit_id)["changed"] is False


def test_discard_removes_the_branch_and_leaves_main_as_it_was(pair: Pair, spark: Any
                                                              ) -> None:
    lo, hi = 15, 25  # the dead letter's offset: its shadow too
    pair.damage(lo, hi)
    before, dead_before = pair.rows(pair.a), pair.dead_letters(pair.a)
    main_before = pair.table(pair.a).current_snapshot().snapshot_id
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    shadow_dl = pair.audit_row(audit_id)["shadow_dl"]
    assert query(pair.dsn, f"SELECT count(*) FROM {shadow_dl}") == [(1,)]
    show_audit(pair.a, pair.dsn, audit_id)
    res = discard_audit(pair.a, pair.dsn, audit_id, by="carol", reason="wrong window")
    assert res["changed"] is True
    assert pair.branches(pair.a) == set()
    assert pair.table(pair.a).current_snapshot().snapshot_id == main_before
    assert pair.rows(pair.a) == before and pair.dead_letters(pair.a) == dead_before
    assert not query(pair.dsn, "SELECT to_regclass(%s)", (shadow_dl,))[0][0]
    assert discard_audit(pair.a, pair.dsn, audit_id)["changed"] is False  # idempotent
    with pytest.raises(AuditStateError, match=rf"audit {audit_id} was discarded"):
        publish_audit(pair.a, pair.dsn, audit_id)
    pair.replay(pair.a, lo, hi, spark, audit=False)  # the window is free again
    pair.replay(pair.b, lo, hi, spark, audit=False)
    assert pair.rows(pair.a) == pair.rows(pair.b)


class Died(Exception):
    """A publish stopped at a step (its ledger transaction rolls back, as on a kill)."""


def test_publish_stopped_at_every_step_then_rerun_publishes_once(
        pair: Pair, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lo, hi = 0, 10
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    pair.live(spark, 2, 10_200)  # main moves: the replay-like publish, its two steps
    assert show_audit(pair.a, pair.dsn, audit_id)["diff"]["totals"]["added"] == 3
    before = pair.rows(pair.a)
    publish_branch, remove_branch = iceberg_audit.publish_branch, iceberg_audit.remove_branch
    dead_letters = auditing.publish_dead_letters

    def die(*_: Any, **__: Any) -> Any:
        raise Died

    def then_die(f: Any) -> Any:
        def wrapped(*a: Any, **kw: Any) -> Any:
            f(*a, **kw)
            raise Died
        return wrapped

    steps = {  # where a publish stops: before the catalog commit, after it before the
        # branch goes, before the dead letters, after them (the ledger not committed)
        "before the catalog commit": (auditing, "publish_branch", die),
        "before the branch is removed": (iceberg_audit, "remove_branch", die),
        "before the dead letters": (auditing, "publish_dead_letters", die),
        "after the dead letters": (auditing, "publish_dead_letters", then_die(dead_letters)),
    }
    published = None
    for step, (module, name, fault) in steps.items():
        with monkeypatch.context() as m:
            m.setattr(module, name, fault)
            with pytest.raises(Died):
                publish_audit(pair.a, pair.dsn, audit_id)
        assert pair.audit_row(audit_id)["status"] == "audited", step
        if step == "before the catalog commit":
            assert pair.rows(pair.a) == before and pair.publishes(pair.a, audit_id) == 0
        else:  # main holds it; the ledger does not yet: the rerun finishes
            published = published or pair.publishes(pair.a, audit_id)
            assert published >= 2 and pair.publishes(pair.a, audit_id) == published, step
    assert publish_branch is iceberg_audit.publish_branch
    assert remove_branch is iceberg_audit.remove_branch
    assert publish_audit(pair.a, pair.dsn, audit_id)["changed"] is True
    assert publish_audit(pair.a, pair.dsn, audit_id)["changed"] is False
    assert pair.publishes(pair.a, audit_id) == published  # one commit, never again
    assert pair.rows(pair.a) == pair.rows(pair.b)
    assert pair.dead_letters(pair.a) == pair.dead_letters(pair.b)
    assert pair.branches(pair.a) == set()
    assert [h["status"] for h in pair.audit_row(audit_id)["history"]].count("published") == 1


def test_discard_after_a_publish_that_reached_main_is_refused(
        pair: Pair, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish stopped after its catalog commit (a kill: the ledger's transaction rolls
    back) leaves main published and the audit `audited`: a discard then must not say the
    live table was left as it was (it holds the window); the rerun publish finishes it."""
    lo, hi = 40, 45
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    show_audit(pair.a, pair.dsn, audit_id)  # main not moved: the fast-forward

    def die(*_: Any, **__: Any) -> Any:
        raise Died

    with monkeypatch.context() as m:
        m.setattr(auditing, "publish_dead_letters", die)
        with pytest.raises(Died):
            publish_audit(pair.a, pair.dsn, audit_id)
    assert pair.audit_row(audit_id)["status"] == "audited"
    assert pair.rows(pair.a) == pair.rows(pair.b)  # main holds the window already
    with pytest.raises(AuditStateError, match=rf"audit {audit_id}.*reached main.*"
                                              rf"audit publish {audit_id}"):
        discard_audit(pair.a, pair.dsn, audit_id)
    with pytest.raises(AuditStateError, match=r"reached main"):
        show_audit(pair.a, pair.dsn, audit_id, refresh=True)
    assert pair.audit_row(audit_id)["status"] == "audited"
    assert publish_audit(pair.a, pair.dsn, audit_id)["changed"] is True
    assert pair.rows(pair.a) == pair.rows(pair.b)


def test_branch_removed_by_hand_between_the_window_batches_is_not_published(
        pair: Pair, spark: Any) -> None:
    """The branch removed by hand after the window's first batch committed on it: the next
    batch cuts a new branch from main, without the first batch's rows. Publishing that
    (a fast-forward: main did not move) would mark the first batch published while main
    lacks its rows: refused, whatever way the publish would go."""
    lo, hi = 30, 40
    pair.damage(lo, hi)
    req = parse_request("replay", {"pipeline": pair.a.name, "topic": pair.topic,
                                   "from_offset": lo, "until_offset": hi, "audit": True,
                                   "records_per_batch": 10})
    with Ledger(pair.dsn) as ledger:
        ids = submit_window(pair.a, ledger, plan_window(pair.a, ledger, kafka_for(pair.a),
                                                        req), "test")
    assert len(ids) >= 2
    run_batches(pair.a, pair.dsn, ids[:1], spark)
    t = pair.table(pair.a)
    [branch] = pair.branches(pair.a)
    t.manage_snapshots().remove_branch(branch).commit()  # by hand
    run_batches(pair.a, pair.dsn, ids[1:], spark)
    show_audit(pair.a, pair.dsn, ids[0])
    before = pair.rows(pair.a)
    with pytest.raises(AuditStateError,
                       match=rf"batches {ids[0]}.* have no snapshot on the branch"):
        publish_audit(pair.a, pair.dsn, ids[0])
    assert pair.rows(pair.a) == before
    discard_audit(pair.a, pair.dsn, ids[0])


def test_a_window_of_several_batches_publishes_what_a_direct_replay_makes(
        pair: Pair, spark: Any) -> None:
    """Each batch of the window deletes and appends on the branch as its earlier batches
    left it (not as main is): the fast-forward then equals the direct replay."""
    lo, hi = 45, 50
    pair.damage(lo, hi)
    ids = {}
    for cfg, audit in ((pair.b, False), (pair.a, True)):
        req = parse_request("replay", {"pipeline": cfg.name, "topic": pair.topic,
                                       "from_offset": lo, "until_offset": hi,
                                       "audit": audit, "records_per_batch": 4})
        with Ledger(pair.dsn) as ledger:
            ids[audit] = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg),
                                                                req), "test")
        run_batches(cfg, pair.dsn, ids[audit], spark)
    assert len(ids[True]) >= 3
    staged = show_audit(pair.a, pair.dsn, ids[True][0])["diff"]["shadow_digest"]
    publish_audit(pair.a, pair.dsn, ids[True][0])
    assert pair.table(pair.a).current_snapshot().snapshot_id == int(staged)
    assert pair.rows(pair.a) == pair.rows(pair.b)


def test_a_window_change_between_the_check_and_the_commit_is_refused(
        pair: Pair, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another writer commits on main at the window's coordinates after publish checked
    main's digest and before its catalog commit: the commit asserts the main it checked,
    so it conflicts, and the look again refuses; nothing is published."""
    lo, hi = 5, 10
    pair.damage(lo, hi)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    show_audit(pair.a, pair.dsn, audit_id)
    real = auditing.no_rebase
    raced: list[int] = []

    def race(table: Any) -> None:  # right before publish builds its commit
        if not raced:
            other = pair.table(pair.a)
            other.delete(ex.And(ex.EqualTo("partition", 0), ex.EqualTo("offset", hi - 1)))
            raced.append(other.current_snapshot().snapshot_id)
        real(table)

    monkeypatch.setattr(auditing, "no_rebase", race)
    with pytest.raises(AuditConflictError, match=r"changed since the diff"):
        publish_audit(pair.a, pair.dsn, audit_id)
    assert raced and pair.table(pair.a).current_snapshot().snapshot_id == raced[0]
    assert pair.branches(pair.a) == {f"audit-{audit_id}"}
    monkeypatch.undo()
    discard_audit(pair.a, pair.dsn, audit_id)
    pair.table(pair.b).delete(ex.And(ex.EqualTo("partition", 0), ex.EqualTo("offset", hi - 1)))


KILL_PUBLISH = """
import os, signal, sys
from offsetflow.config import load_pipeline
from offsetflow.ops import publish_audit
from offsetflow.sinks.iceberg import audit, auditing

def kill(*_a, **_kw):
    os.kill(os.getpid(), signal.SIGKILL)

setattr(audit if sys.argv[3] == "remove_branch" else auditing, sys.argv[3], kill)
publish_audit(load_pipeline(sys.argv[1]), sys.argv[2], int(sys.argv[4]))
"""


@pytest.mark.parametrize("moved", [True, False], ids=["replay-like", "fast-forward"])
def test_publish_sigkilled_after_its_catalog_commit_then_rerun_publishes_once(
        pair: Pair, spark: Any, moved: bool) -> None:
    """A real SIGKILL of the publishing process (its ledger connection dies with the audit
    row locked) after the catalog commit: the rerun finds the publish on main and finishes
    the ledger's part, once."""
    import signal
    import subprocess
    import sys

    lo, hi = (10, 15) if moved else (25, 30)
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    if moved:
        pair.live(spark, 2, 10_300)
    staged = show_audit(pair.a, pair.dsn, audit_id)["diff"]["shadow_digest"]
    step = "remove_branch" if moved else "publish_dead_letters"
    proc = subprocess.run([sys.executable, "-c", KILL_PUBLISH, str(pair.files["a"]),
                           pair.dsn, step, str(audit_id)], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert pair.audit_row(audit_id)["status"] == "audited"
    published = pair.publishes(pair.a, audit_id)  # main holds it, the ledger does not
    if moved:
        assert published >= 1
    else:
        assert pair.table(pair.a).current_snapshot().snapshot_id == int(staged)
    res = publish_audit(pair.a, pair.dsn, audit_id)
    assert res["changed"] is True
    assert pair.publishes(pair.a, audit_id) == published
    assert pair.rows(pair.a) == pair.rows(pair.b)
    assert pair.dead_letters(pair.a) == pair.dead_letters(pair.b)
    assert pair.branches(pair.a) == set()


def test_maintenance_between_staging_and_publish_keeps_what_publish_needs(
        pair: Pair, spark: Any) -> None:
    """`offsetflow maintenance` at its most eager (every snapshot older than now expired,
    every unreferenced file swept) while a window is staged and main moved on: publish
    (replay-like, reading the staged files back along the branch) still makes what a
    direct replay makes. Last in the module: it cuts main's history short."""
    from offsetflow.sinks.iceberg import maint

    lo, hi = 55, 60
    pair.damage(lo, hi)
    pair.replay(pair.b, lo, hi, spark, audit=False)
    [audit_id] = pair.replay(pair.a, lo, hi, spark, audit=True)
    pair.live(spark, 2, 10_500)
    show_audit(pair.a, pair.dsn, audit_id)
    assert maint.main(["--pipeline-file", str(pair.files["a"]), "--dsn", pair.dsn,
                       "--orphans-older-than-hours", "0",
                       "--expire-snapshots-older-than-days", "0"]) == 0
    assert publish_audit(pair.a, pair.dsn, audit_id)["changed"] is True
    assert pair.rows(pair.a) == pair.rows(pair.b)
    assert pair.branches(pair.a) == set()
