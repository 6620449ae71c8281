"""Audit before publish on Iceberg branches (`offsetflow.sinks.iceberg.audit`), on real
pyiceberg tables in a SQLite catalog: an audited batch commits on `audit-<id>` and never on
main; the diff; publish as a fast-forward or as a direct replay's commit, found again after
a stop so it lands once; a changed window refused. The ledger's side is in
tests/integration/sinks/iceberg/test_sink_iceberg_audit.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyiceberg import expressions

from offsetflow.errors import AuditConflictError
from offsetflow.ledger import Batch
from offsetflow.ranges import OffsetRange
from offsetflow.sinks.iceberg import audit
from offsetflow.sinks.iceberg.commit import commit_snapshot, no_rebase, window_filter

ex: Any = expressions  # pydantic models: mypy cannot read their positional signatures

SCHEMA = pa.schema([("topic", pa.string()), ("partition", pa.int32()),
                    ("offset", pa.int64()), ("value", pa.string()),
                    ("_offsetflow_batch_id", pa.int64())])


@pytest.fixture
def table(tmp_path: Path) -> Any:
    from pyiceberg.catalog.sql import SqlCatalog

    cat = SqlCatalog("t", uri=f"sqlite:///{tmp_path / 'catalog.db'}",
                     warehouse=f"file://{tmp_path / 'warehouse'}")
    cat.create_namespace("lake")
    t = cat.create_table("lake.t", schema=SCHEMA)
    t.append(rows(range(0, 10), "v", 1))  # the live rows of offsets 0..9
    return t


def rows(offsets: Any, value: str, batch: int) -> pa.Table:
    offs = list(offsets)
    return pa.table({"topic": ["t"] * len(offs), "partition": [0] * len(offs),
                     "offset": offs, "value": [f"{value}{o}" for o in offs],
                     "_offsetflow_batch_id": [batch] * len(offs)}, schema=SCHEMA)


def batch(batch_id: int, lo: int, hi: int, audit_id: int | None) -> Batch:
    params = {} if audit_id is None else {"audit": {"audit_id": audit_id}}
    return Batch(batch_id, "p", "replay", "running", (OffsetRange("t", 0, lo, hi),), "lake.t",
                 params=params, rows_written=hi - lo)


def stage(table: Any, b: Batch, data: pa.Table) -> None:
    summary = {"offsetflow.pipeline": "p", "offsetflow.batch-id": str(b.batch_id),
               "offsetflow.ranges": f'[["t",0,{b.ranges[0].from_offset},'
                                    f'{b.ranges[0].until_offset}]]',
               "offsetflow.rows": str(data.num_rows)}
    assert commit_snapshot(table, b, data, summary, window=lambda t: window_filter(b)) is None


WINDOW = [{"topic": "t", "partition": 0, "from_offset": 2, "until_offset": 6}]


def values(table: Any, ref: str = "main") -> list[str]:
    snap = audit.branch_head(table, ref)
    return sorted(table.scan(snapshot_id=snap.snapshot_id).to_arrow()["value"].to_pylist())


def staged(table: Any) -> tuple[list[Batch], dict[str, Any], str]:
    """An audited window of two batches ([2, 4) rewritten, [4, 6) with offset 5 gone)."""
    b1, b2 = batch(7, 2, 4, 7), batch(8, 4, 6, 7)
    stage(table, b1, rows(range(2, 4), "new", 7))
    stage(table, b2, rows([4], "v", 8))
    b2 = dataclasses.replace(b2, rows_written=1)
    diff, digest = audit.diff_branch(table, "audit-7", WINDOW)
    return [b1, b2], diff, digest


def publish(table: Any, batches: list[Batch], diff: dict[str, Any], digest: str) -> str:
    return audit.publish_branch(table, 7, "p", "audit-7", batches, diff, digest,
                                lambda t: ex.Or(window_filter(batches[0]),
                                                window_filter(batches[1])),
                                None, no_rebase)


def test_an_audited_window_commits_on_its_branch_and_is_diffed_against_main(table: Any
                                                                            ) -> None:
    main = table.current_snapshot().snapshot_id
    batches, diff, digest = staged(table)
    assert table.current_snapshot().snapshot_id == main  # main untouched
    assert values(table) == [f"v{o}" for o in range(10)]
    assert values(table, "audit-7") == sorted(["v0", "v1", "new2", "new3", "v4", "v6", "v7",
                                               "v8", "v9"])
    assert diff["totals"] == {"added": 0, "removed": 1, "changed": 2, "same": 1,
                              "staged_rows": 3, "live_rows": 4}
    assert diff["per_range"] == {"t/0": {"added": 0, "removed": 1, "changed": 2, "same": 1}}
    assert [s["offset"] for s in diff["samples"]["changed"]] == [2, 3]
    assert diff["samples"]["changed"][0]["changed_columns"] == ["value"]
    assert diff["samples"]["removed"][0]["staged"] is None
    assert digest == audit.rows_digest(audit.window_rows(table, WINDOW,
                                                         table.current_snapshot()))


def test_publish_fast_forwards_an_unmoved_main_and_removes_the_branch(table: Any) -> None:
    batches, diff, digest = staged(table)
    assert publish(table, batches, diff, digest) == "fast-forward"
    assert table.current_snapshot().snapshot_id == int(diff["shadow_digest"])
    assert "audit-7" not in table.metadata.refs
    assert publish(table, batches, diff, digest) == "found"  # a rerun: nothing again


def test_publish_after_main_moved_commits_what_a_direct_replay_makes_once(table: Any
                                                                          ) -> None:
    batches, diff, digest = staged(table)
    table.append(rows(range(10, 12), "v", 9))  # the live pipeline goes on
    remove = audit.remove_branch
    audit.remove_branch = lambda *a: (_ for _ in ()).throw(RuntimeError("stopped"))  # type: ignore[assignment]
    try:  # stopped after the catalog commit, before the branch went
        with pytest.raises(RuntimeError, match="stopped"):
            publish(table, batches, diff, digest)
    finally:
        audit.remove_branch = remove  # type: ignore[assignment]
    assert "audit-7" in table.metadata.refs
    assert publish(table, batches, diff, digest) == "found"  # the rerun: found, not again
    assert "audit-7" not in table.metadata.refs
    assert values(table) == sorted(["v0", "v1", "new2", "new3", "v4", "v6", "v7", "v8", "v9",
                                    "v10", "v11"])


def test_publish_refuses_a_window_main_changed_since_the_diff(table: Any) -> None:
    batches, diff, digest = staged(table)
    table.delete(ex.EqualTo("offset", 5))
    with pytest.raises(AuditConflictError, match="changed since the diff.*--refresh"):
        publish(table, batches, diff, digest)
    assert "audit-7" in table.metadata.refs
    assert values(table) == [f"v{o}" for o in range(10) if o != 5]


def test_snapshot_expiry_keeps_an_open_audit_branchs_own_snapshots(table: Any) -> None:
    main = {s.snapshot_id for s in table.snapshots()}
    staged(table)
    own = {s.snapshot_id for s in table.snapshots()} - main
    assert len(own) == 4  # each batch's delete and append
    assert audit.open_audit_snapshots(table) == own
    audit.remove_branch(table, "audit-7")
    assert audit.open_audit_snapshots(table) == set()


def test_an_audited_window_never_changes_mains_schema(table: Any) -> None:
    """Iceberg's schema is table-wide: a schema update committed with a branch snapshot is
    main's current schema at once (the live pipeline writes with it, readers see it, and a
    discard leaves it). format.schema_evolution on an audited window is refused before
    anything is written; nothing pending (the live pipeline added the column first) goes."""
    from offsetflow.errors import SchemaEvolutionError
    from offsetflow.sinks.iceberg.evolve import evolve_schema, evolved_metadata

    add = (("coupon", "text"),)
    b = batch(7, 2, 4, 7)
    before = {f.name for f in table.schema().fields}
    with pytest.raises(SchemaEvolutionError) as e:
        evolved_metadata(table, add, b.audit_id)
    assert "audit 7" in str(e.value) and "'coupon'" in str(e.value), e.value
    summary = {"offsetflow.pipeline": "p", "offsetflow.batch-id": "7",
               "offsetflow.ranges": '[["t",0,2,4]]', "offsetflow.rows": "2"}
    with pytest.raises(SchemaEvolutionError):
        commit_snapshot(table, b, rows(range(2, 4), "new", 7), summary,
                        window=lambda t: window_filter(b),
                        evolve=lambda txn: evolve_schema(txn, "lake.t", add, b.audit_id))
    table.refresh()
    assert {f.name for f in table.schema().fields} == before  # main's schema untouched
    assert "audit-7" not in table.metadata.refs or values(table) == values(table, "main")
    assert len(table.metadata.schemas) == 1
    # the live pipeline adds the column first: the audited window has nothing to add
    with table.update_schema() as u:
        u.add_column("coupon", pa_string())
    assert evolved_metadata(table, add, b.audit_id) is table.metadata
    stage(table, b, rows(range(2, 4), "new", 7))
    assert values(table, "audit-7") == sorted(
        [f"v{o}" for o in range(10) if o not in (2, 3)] + ["new2", "new3"])


def pa_string() -> Any:
    from pyiceberg.types import StringType

    return StringType()


def test_audit_of_an_upsert_iceberg_pipeline_is_refused_before_anything_is_written(
        ) -> None:
    """`--audit` on an upsert Iceberg pipeline: refused when planned (a RequestError naming
    the pipeline and the mode), before any catalog or ledger access."""
    from offsetflow.config import parse_pipeline
    from offsetflow.errors import RequestError
    from offsetflow.sinks.iceberg import auditing

    cfg = parse_pipeline({"name": "ups", "kafka": {"bootstrap_servers": "k:9092"},
                          "source": {"topics": ["t"]},
                          "format": {"type": "json", "schema": {"event_id": "string"}},
                          "sink": {"type": "iceberg", "table": "lake.t", "mode": "upsert",
                                   "connection": "postgresql://u:pw@h:5432/db",
                                   "key": ["event_id"],
                                   "catalog": {"warehouse": "file:///nowhere"}}},
                         "f.yaml", {})
    with pytest.raises(RequestError, match=r"pipeline ups: --audit is for sink.mode append"):
        auditing.audit_shadows(cfg, None, "lake.t", 0)  # type: ignore[arg-type]
