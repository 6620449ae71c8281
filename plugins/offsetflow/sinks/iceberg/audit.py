"""Audit before publish into an Iceberg table (`offsetflow.ops.audit` drives it through the
sink's audit methods): the audited window commits on a branch `audit-<id>` of the live
table, cut from main's head by the window's first batch commit; main and the live pipeline
never see it until publish.

- The diff scans the branch's head and main's head over the window's coordinates (one row
  per coordinate in an append table), every column but the lineage column; the live digest
  is a digest of main's rows there (lineage included), the "shadow digest" the branch's
  head snapshot id (only the window's own commits move it).
- Publish is ONE catalog commit on main, asserting main's head: a fast-forward of main to
  the branch's head (the branch removed in the same commit) when main has not moved since
  the branch was cut; else what a direct replay commits (the window's delete by
  coordinates, of its own incarnation, then the data files the window's batches staged on
  the branch), refused when main's rows at the window's coordinates changed since the diff.
  Either way the commit is found again: main's ancestry holds the branch's head, or a
  snapshot whose summary names the audit (`SUMMARY_AUDIT`), so a rerun after a kill
  anywhere publishes once (the ledger then finishes what its rolled-back transaction did).
- Discard removes the branch; its snapshots expire, and their files go, with the table's
  maintenance.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.config import SUMMARY_LEDGER, SUMMARY_PIPELINE, summary_batch
from offsetflow.errors import AuditConflictError, AuditStateError
from offsetflow.ledger import Batch

if TYPE_CHECKING:
    from pyiceberg.manifest import DataFile
    from pyiceberg.table import Table
    from pyiceberg.table.snapshots import Snapshot

log = logging.getLogger(__name__)

MAIN = "main"
BRANCH_PREFIX = "audit-"
SUMMARY_AUDIT = "offsetflow.audit-id"
SUMMARY_KIND = "offsetflow.kind"  # as a batch snapshot says its kind (config.iceberg_sink)
SUMMARY_AUDIT_BATCHES = "offsetflow.audit-batches"
PUBLISH_KIND = "audit-publish"
PUBLISH_RETRIES = 5


def audit_branch(audit_id: int) -> str:
    """The branch an audited window commits on."""
    return f"{BRANCH_PREFIX}{audit_id}"


def batch_branch(batch: Batch) -> str:
    """Where `batch` commits: its audit's branch, else main."""
    return MAIN if batch.audit_id is None else audit_branch(batch.audit_id)


def branch_head(table: Table, branch: str) -> Snapshot | None:
    return table.current_snapshot() if branch == MAIN else table.snapshot_by_name(branch)


def ensure_branch(table: Table, branch: str) -> None:
    """The audit's branch exists: cut at main's head by the window's first commit (a kill
    after the cut: the rerun finds it). Refused on a table without rows: nothing to audit
    against."""
    from pyiceberg.exceptions import CommitFailedException

    if branch == MAIN or branch in table.metadata.refs:
        return
    head = table.current_snapshot()
    if head is None:
        raise AuditStateError(
            f"Iceberg table {'.'.join(table.name())} has no snapshot to cut the audit branch "
            f"{branch} from; run the window without --audit")
    try:
        table.manage_snapshots().create_branch(head.snapshot_id, branch).commit()
    except CommitFailedException:  # a concurrent attempt cut it first
        table.refresh()
        if branch not in table.metadata.refs:
            raise
    log.info("Iceberg table %s: audit branch %s cut at main's snapshot %d",
             ".".join(table.name()), branch, head.snapshot_id)


def coordinates_filter(ranges: Sequence[Mapping[str, Any]]) -> Any:
    """Rows at the window's coordinates."""
    from pyiceberg import expressions

    ex: Any = expressions
    out: Any = ex.AlwaysFalse()
    for r in ranges:
        out = ex.Or(out, ex.And(ex.EqualTo("topic", r["topic"]),
                                ex.EqualTo("partition", int(r["partition"])),
                                ex.GreaterThanOrEqual("offset", int(r["from_offset"])),
                                ex.LessThan("offset", int(r["until_offset"]))))
    return out


Key = tuple[str, int, int]


def window_rows(table: Table, ranges: Sequence[Mapping[str, Any]], snapshot: Snapshot | None
                ) -> dict[Key, dict[str, Any]]:
    """The rows of `snapshot` (None: none) at the window's coordinates, by coordinate."""
    if snapshot is None:
        return {}
    data = table.scan(row_filter=coordinates_filter(ranges),
                      snapshot_id=snapshot.snapshot_id).to_arrow()
    return {(str(r["topic"]), int(r["partition"]), int(r["offset"])): r
            for r in data.to_pylist()}


def rows_digest(rows: Mapping[Key, Mapping[str, Any]]) -> str:
    """The digest of rows (every column, lineage included), in the format of the
    PostgreSQL sink's (`count:md5`)."""
    hashes = sorted(hashlib.md5(json.dumps(dict(r), sort_keys=True, default=str).encode(),
                                usedforsecurity=False).hexdigest() for r in rows.values())
    joined = ",".join(hashes)
    return f"{len(hashes)}:" + (hashlib.md5(joined.encode(), usedforsecurity=False).hexdigest()
                                if hashes else "")


def diff_branch(table: Table, branch: str, ranges: Sequence[Mapping[str, Any]],
                sample: int = 10) -> tuple[dict[str, Any], str]:
    """The branch's window against main's rows at its coordinates, in the PostgreSQL
    sink's shape (totals, per topic/partition, samples with the columns that differ), and
    the digest of main's rows there that publish checks again."""
    head = branch_head(table, branch)
    if head is None:
        raise AuditStateError(
            f"Iceberg table {'.'.join(table.name())}: the audit branch {branch} is gone "
            f"(removed by hand); discard the audit and run the window with --audit again")
    live = window_rows(table, ranges, table.current_snapshot())
    staged = window_rows(table, ranges, head)
    columns = [f.name for f in table.schema().fields if f.name != LINEAGE_COLUMN]
    totals = {"added": 0, "removed": 0, "changed": 0, "same": 0}
    per_range: dict[str, dict[str, int]] = {}
    samples: dict[str, list[Any]] = {"added": [], "removed": [], "changed": []}
    for key in sorted(live.keys() | staged.keys()):
        lrow, srow = live.get(key), staged.get(key)
        lcmp = None if lrow is None else {c: lrow.get(c) for c in columns}
        scmp = None if srow is None else {c: srow.get(c) for c in columns}
        change = ("added" if lcmp is None else "removed" if scmp is None else
                  "same" if lcmp == scmp else "changed")
        totals[change] += 1
        per_range.setdefault(f"{key[0]}/{key[1]}", {k: 0 for k in totals})[change] += 1
        if change != "same" and len(samples[change]) < sample:
            s: dict[str, Any] = {"topic": key[0], "partition": key[1], "offset": key[2],
                                 "live": lcmp, "staged": scmp}
            if lcmp is not None and scmp is not None:
                s["changed_columns"] = sorted(c for c in columns if lcmp[c] != scmp[c])
            samples[change].append(s)
    return ({"totals": totals | {"staged_rows": len(staged), "live_rows": len(live)},
             "per_range": per_range, "samples": samples, "columns": columns,
             "branch": branch, "shadow_digest": str(head.snapshot_id)}, rows_digest(live))


def published_on_main(table: Table, audit_id: int, pipeline: str, ledger: str | None,
                      staged_head: int | None) -> bool:
    """Whether main already holds the audit's publish: the branch's audited head among
    main's ancestors (a fast-forward), or a snapshot whose summary names the audit."""
    from pyiceberg.table.snapshots import ancestors_of

    for snap in ancestors_of(table.current_snapshot(), table.metadata):
        if staged_head is not None and snap.snapshot_id == staged_head:
            return True
        props = snap.summary.additional_properties if snap.summary else {}
        if props.get(SUMMARY_AUDIT) == str(audit_id) and \
                props.get(SUMMARY_PIPELINE) == pipeline and \
                (ledger is None or props.get(SUMMARY_LEDGER, ledger) == ledger):
            return True
    return False


def refuse_published(table: Table, audit_id: int, pipeline: str, ledger: str | None,
                     audit: Mapping[str, Any], doing: str) -> None:
    """A publish whose catalog commit reached main but whose ledger transaction did not
    commit (killed between them) leaves the audit `audited`: refused for anything but the
    publish that finishes it (a discard would say the live table was left as it was)."""
    staged = audit.get("shadow_digest")
    if published_on_main(table, audit_id, pipeline, ledger, int(staged) if staged else None):
        raise AuditStateError(
            f"audit {audit_id}: an earlier publish reached main of Iceberg table "
            f"{'.'.join(table.name())} (it stopped before the ledger recorded it), so it "
            f"cannot be {doing}; run `offsetflow audit publish {audit_id}` to finish it (to "
            f"undo it then, replay the window again)")


def is_ancestor(table: Table, snapshot_id: int | None, of: Snapshot) -> bool:
    from pyiceberg.table.snapshots import ancestors_of

    if snapshot_id is None:
        return True
    return any(s.snapshot_id == snapshot_id for s in ancestors_of(of, table.metadata))


def missing_batches(table: Table, head: Snapshot, batches: Sequence[Batch],
                    ledger: str | None) -> list[int]:
    """The window's batches with no snapshot in the branch head's history."""
    from pyiceberg.table.snapshots import ancestors_of

    found: set[int] = set()
    for snap in ancestors_of(head, table.metadata):
        props = snap.summary.additional_properties if snap.summary else {}
        found |= {b.batch_id for b in batches
                  if summary_batch(props, b.pipeline, b.batch_id, ledger) is not None}
    return [b.batch_id for b in batches if b.batch_id not in found]


def staged_files(table: Table, head: Snapshot, batches: Sequence[Batch], ledger: str | None
                 ) -> list[DataFile]:
    """The data files the window's batches appended on the branch that its head still
    holds: the appends of their snapshots (never a delete's rewrite of main's files, which
    holds rows outside the window)."""
    from pyiceberg.table.snapshots import Operation, ancestors_of

    appended: set[int] = set()
    for snap in ancestors_of(head, table.metadata):
        props = snap.summary.additional_properties if snap.summary else {}
        if snap.summary is not None and snap.summary.operation == Operation.APPEND and any(
                summary_batch(props, b.pipeline, b.batch_id, ledger) is not None
                for b in batches):
            appended.add(snap.snapshot_id)
    out = []
    for manifest in head.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            if entry.snapshot_id in appended:
                out.append(entry.data_file)
    return out


def publish_branch(table: Table, audit_id: int, pipeline: str, branch: str,
                   batches: Sequence[Batch], audit: Mapping[str, Any], live_digest: str | None,
                   window: Callable[[Table], Any], ledger: str | None,
                   no_rebase: Callable[[Table], None]) -> str:
    """ONE catalog commit on main (see the module docstring); returns how ("found": an
    earlier attempt published it, "fast-forward", "replay"). `window`: the direct replay's
    delete filter for main as loaded now (called each round); `no_rebase`: the sink's view
    of the table that retries no conflict itself (it comes back here, to look again)."""
    from pyiceberg.exceptions import CommitFailedException
    from pyiceberg.table.update.snapshot import ManageSnapshots

    staged = audit.get("shadow_digest")
    staged_head = int(staged) if staged else None
    name = ".".join(table.name())
    for attempt in range(PUBLISH_RETRIES):
        if published_on_main(table, audit_id, pipeline, ledger, staged_head):
            remove_branch(table, branch)  # a kill after the replay-like commit left it
            return "found"
        head = table.snapshot_by_name(branch)
        if head is None:
            raise AuditStateError(
                f"audit {audit_id}: its branch {branch} of Iceberg table {name} is gone "
                f"(removed by hand); nothing is published. Discard the audit and run the "
                f"window with --audit again")
        if head.snapshot_id != staged_head:
            raise AuditConflictError(
                f"audit {audit_id}: the branch {branch} of {name} moved since the diff (its "
                f"head is {head.snapshot_id}, the diff saw {staged_head}); nothing is "
                f"published. Run `offsetflow audit show {audit_id} --refresh`, then publish")
        main = table.current_snapshot()
        now = rows_digest(window_rows(table, audit_ranges(batches), main))
        if now != live_digest:
            raise AuditConflictError(
                f"audit {audit_id}: main's rows of Iceberg table {name} at the window's "
                f"coordinates changed since the diff (another replay or backfill committed "
                f"there); nothing is published. Run `offsetflow audit show {audit_id} "
                f"--refresh` to diff against main as it is now, then publish")
        # whichever way it goes: the branch holds every batch of the window (a branch
        # removed by hand and cut again by a later batch lacks the earlier ones)
        files = staged_files(table, head, batches, ledger)
        missing = missing_batches(table, head, batches, ledger)
        rows = sum(int(f.record_count) for f in files)
        want = sum(int(b.rows_written or 0) for b in batches)
        if missing or rows != want:
            raise AuditStateError(
                f"audit {audit_id}: the branch {branch} of {name} holds {rows} staged rows "
                f"of the window's batches, but they committed {want} there"
                + (f" (batches {', '.join(map(str, missing))} have no snapshot on the "
                   f"branch: it was removed and cut again)" if missing else "")
                + "; nothing is published. Discard the audit and run the window with "
                  "--audit again")
        no_rebase(table)
        txn = table.transaction()
        if main is not None and is_ancestor(table, main.snapshot_id, head):
            how = "fast-forward"
            ms = ManageSnapshots(txn)
            ms.set_current_snapshot(snapshot_id=head.snapshot_id)
            ms.remove_branch(branch)
            ms.commit()
        else:
            how = "replay"
            summary = {SUMMARY_PIPELINE: pipeline, SUMMARY_KIND: PUBLISH_KIND,
                       SUMMARY_AUDIT: str(audit_id),
                       SUMMARY_AUDIT_BATCHES: ",".join(str(b.batch_id) for b in batches)}
            if ledger is not None:
                summary[SUMMARY_LEDGER] = ledger
            with warnings.catch_warnings():  # a window with nothing before is no news
                warnings.filterwarnings("ignore", "Delete operation did not match")
                txn.delete(window(table), snapshot_properties=summary)
            with txn.update_snapshot(snapshot_properties=summary).fast_append() as append:
                for f in files:
                    append.append_data_file(f)
        try:
            txn.commit_transaction()
        except CommitFailedException as e:  # main moved (the live pipeline): look again
            log.warning("audit %d: publish to %s conflicted (%s); looking again", audit_id,
                        name, e)
            time.sleep(0.2 * (attempt + 1))
            table.refresh()
            continue
        if how == "replay":
            remove_branch(table, branch)  # after: a kill between leaves it to the rerun
        log.info("audit %d: published into Iceberg table %s (%s)", audit_id, name, how)
        return how
    raise AuditConflictError(f"audit {audit_id}: the publish to {name} conflicted "
                             f"{PUBLISH_RETRIES} times with other writers; nothing is "
                             f"published, publish again")


def audit_ranges(batches: Sequence[Batch]) -> list[dict[str, Any]]:
    return [{"topic": r.topic, "partition": r.partition, "from_offset": r.from_offset,
             "until_offset": r.until_offset} for b in batches for r in b.ranges]


def open_audit_snapshots(table: Table) -> set[int]:
    """The snapshots of every audit branch that main does not hold: snapshot expiry keeps
    them (publish reads the staged files' snapshots back along the branch)."""
    from pyiceberg.table.snapshots import ancestors_of

    main = {s.snapshot_id for s in ancestors_of(table.current_snapshot(), table.metadata)}
    out: set[int] = set()
    for name in table.metadata.refs:
        if not name.startswith(BRANCH_PREFIX):
            continue
        for snap in ancestors_of(table.snapshot_by_name(name), table.metadata):
            if snap.snapshot_id in main:
                break
            out.add(snap.snapshot_id)
    return out


def remove_branch(table: Table, branch: str) -> bool:
    """The branch removed if it is there (idempotent); whether it was."""
    if branch == MAIN or branch not in table.metadata.refs:
        return False
    table.manage_snapshots().remove_branch(branch).commit()
    log.info("Iceberg table %s: audit branch %s removed", ".".join(table.name()), branch)
    return True
