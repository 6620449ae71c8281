"""Audit before publish (issue 33): a replay or backfill with `--audit` is written beside the
live data, diffed against it, then published in one transaction or discarded.

Lifecycle of an audited window (`offsetflow.audits`, migration 0014; its id is the window's
first batch id): `staging` (its batches planned into the shadow; `submit_window`) ->
`staged` (all of them committed there: ordinary commits, positions untouched) -> `audited`
(`show_audit`: the diff against the live rows at the window's coordinates, the quality
results of its batches and the digest of those live rows) -> `published` (`publish_audit`)
or `discarded` (`discard_audit`, from any open state). Every transition is one transaction
that locks the audit row first, records who and when in `history`, and is idempotent: a
published audit published again, or a discarded one discarded again, changes nothing.

What differs between sinks (the shadow, the diff, the publish) is a method of the sink.
Publish is refused when the live rows of the window changed since the diff
(`AuditConflictError`): the operator approved a diff that no longer describes what
publish would replace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg2.extensions

from offsetflow.commit import OPEN_AUDIT_STATUSES, Audit
from offsetflow.config import PipelineConfig, split_table_name
from offsetflow.errors import AuditStateError, BatchNotFoundError, RequestError
from offsetflow.ledger import Batch, Ledger, lock_timeout_s, refuse_newer_ledger
from offsetflow.sinks import sink_for

log = logging.getLogger(__name__)

COLUMNS = ("audit_id, pipeline, kind, batch_ids, target_table, shadow_table, "
           "dead_letter_table, shadow_dead_letter_table, ranges, status, live_digest, audit, "
           "staged_by, created_at, staged_at, audited_by, audited_at, closed_by, closed_at, "
           "reason, history")


def _audit(row: Sequence[Any]) -> Audit:
    (audit_id, pipeline, kind, batch_ids, target, shadow, dl, shadow_dl, ranges, status,
     digest, audit, *rest) = row
    info = dict(zip(COLUMNS.split(", ")[12:], rest, strict=True))
    info = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in info.items()}
    return Audit(int(audit_id), pipeline, kind, tuple(int(b) for b in batch_ids), target,
                 shadow, dl, shadow_dl, tuple(ranges), status, digest, audit, info)


def get_audit(cur: psycopg2.extensions.cursor, audit_or_batch_id: int,
              for_update: bool = False) -> Audit:
    """The audit with this id, or the one whose window holds this batch."""
    cur.execute(f"SELECT {COLUMNS} FROM offsetflow.audits WHERE audit_id = %s "  # noqa: S608
                f"OR %s = ANY(batch_ids) ORDER BY audit_id LIMIT 1"
                + (" FOR UPDATE" if for_update else ""), (audit_or_batch_id, audit_or_batch_id))
    row = cur.fetchone()
    if row is None:
        raise BatchNotFoundError(f"no audit {audit_or_batch_id} (nor a batch of an audited "
                                 f"window with that id) in the ledger")
    return _audit(row)


def audit_pipeline(dsn: str, audit_or_batch_id: int) -> str:
    """The pipeline an audit belongs to (the CLI loads its config to reach its sink)."""
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        return get_audit(cur, audit_or_batch_id).pipeline


def window_ranges_json(batches_ranges: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"topic": r.topic, "partition": r.partition, "from_offset": r.from_offset,
             "until_offset": r.until_offset} for r in batches_ranges]


def has_audits(cur: psycopg2.extensions.cursor) -> bool:
    cur.execute("SELECT to_regclass('offsetflow.audits') IS NOT NULL")
    row = cur.fetchone()
    return bool(row and row[0])


def open_audits_overlapping(cur: psycopg2.extensions.cursor, pipeline: str, target: str,
                            ranges: Sequence[Mapping[str, Any]]) -> list[int]:
    """Open audits of `pipeline` into `target`, however spelled (`orders` is
    `public.orders`), whose window overlaps `ranges` (none in a ledger not upgraded to
    migration 0014 yet: windows without --audit still work there)."""
    if not has_audits(cur):
        return []
    cur.execute(f"SELECT {COLUMNS} FROM offsetflow.audits WHERE pipeline = %s "  # noqa: S608
                f"AND status = ANY(%s)", (pipeline, list(OPEN_AUDIT_STATUSES)))
    return [a.audit_id for a in map(_audit, cur.fetchall())
            if split_table_name(a.target_table) == split_table_name(target)
            and a.overlaps(ranges)]


def refuse_open_audit_overlap(cur: psycopg2.extensions.cursor, pipeline: str, target: str,
                              ranges: Sequence[Mapping[str, Any]]) -> None:
    """A window (audited or not) whose coordinates an open audit covers is refused: its
    commit would make the audit's diff stale, or two audits would publish one window."""
    found = open_audits_overlapping(cur, pipeline, target, ranges)
    if found:
        raise RequestError(
            f"the window overlaps open audit(s) {found} of pipeline {pipeline} into "
            f"{target}; publish or discard them first (`offsetflow audit publish|discard "
            f"{found[0]}`)")


def open_audit(cur: psycopg2.extensions.cursor, cfg: PipelineConfig, kind: str, target: str,
               batch_ids: Sequence[int], ranges: Sequence[Mapping[str, Any]],
               started_by: str) -> Audit:
    """In `submit_window`'s transaction (the pipeline lock held): the window's batches are
    pointed at the shadow instead of the live `target`, and the audit row recorded."""
    if not has_audits(cur):
        raise RequestError("the ledger has no audits table yet (migration 0014): run "
                           "`offsetflow db upgrade`, then the window with --audit again")
    audit_id = batch_ids[0]
    shadow, shadow_dl = sink_for(cfg).audit_shadows(cur, target, audit_id)
    params = {"audit_id": audit_id, "live_table": target, "shadow_table": shadow,
              "shadow_dead_letter_table": shadow_dl}
    cur.execute("""UPDATE offsetflow.batches SET target_table = %s,
                          params = params || jsonb_build_object('audit', %s::jsonb)
                    WHERE batch_id = ANY(%s)""", (shadow, json.dumps(params), list(batch_ids)))
    history = [{"status": "staging", "by": started_by}]
    cur.execute("""INSERT INTO offsetflow.audits
                     (audit_id, pipeline, kind, batch_ids, target_table, shadow_table,
                      dead_letter_table, shadow_dead_letter_table, ranges, status, staged_by,
                      history)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, 'staging', %s, %s)""",
                (audit_id, cfg.name, kind, list(batch_ids), target, shadow,
                 cfg.dead_letter_table, shadow_dl, json.dumps(list(ranges)), started_by,
                 json.dumps(history)))
    log.info("pipeline %s: audited %s %d into shadow %s (live table %s untouched until "
             "publish)", cfg.name, kind, audit_id, shadow, target)
    return get_audit(cur, audit_id)


def _transition(cur: psycopg2.extensions.cursor, current: Audit, status: str, by: str,
                note: str | None = None, /, **columns: Any) -> None:
    """`current` moves to `status`; `history` says who and when (`note`: why)."""
    sets = ", ".join(f"{c} = %s" for c in columns)
    cur.execute(f"""UPDATE offsetflow.audits SET status = %s, {sets + ', ' if sets else ''}
                           history = history || jsonb_build_array(jsonb_build_object(
                               'status', %s::text, 'by', %s::text, 'at', now(),
                               'reason', %s::text))
                     WHERE audit_id = %s""",  # noqa: S608
                (status, *columns.values(), status, by, note, current.audit_id))


def _lock(cur: psycopg2.extensions.cursor, audit_or_batch_id: int) -> Audit:
    """The audit row locked (at most `lock_timeout_s`): one transition at a time."""
    cur.execute("SELECT set_config('lock_timeout', %s, true)",
                (f"{int(lock_timeout_s() * 1000)}ms",))
    refuse_newer_ledger(cur)
    return get_audit(cur, audit_or_batch_id, for_update=True)


def _batches(ledger: Ledger, cur: psycopg2.extensions.cursor, audit: Audit) -> list[Batch]:
    return [ledger.get_batch(b, cur) for b in audit.batch_ids]


def quality_of(batches: Sequence[Batch]) -> dict[str, Any]:
    """The pipeline's quality suite as it ran on each batch's staged rows before its commit
    into the shadow (None: the pipeline has no suite)."""
    runs = {str(b.batch_id): b.quality for b in batches if b.quality}
    if not runs:
        return {"suite": None, "passed": None, "batches": {}}
    passed = all(bool(q.get("success")) for q in runs.values())
    suites = sorted({str(q.get("suite")) for q in runs.values()})
    return {"suite": ", ".join(suites), "passed": passed, "batches": runs}


def show_audit(cfg: PipelineConfig, dsn: str, audit_or_batch_id: int, by: str = "cli",
               refresh: bool = False) -> dict[str, Any]:
    """The audit as the operator sees it; once its batches are all committed into the
    shadow, the diff is made (and recorded, with the live digest publish checks) the first
    time, or again with `refresh`."""
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        audit = _lock(cur, audit_or_batch_id)
        batches = _batches(ledger, cur, audit)
        if audit.status == "staging" and all(b.status == "committed" for b in batches):
            _transition(cur, audit, "staged", by, staged_at=_now(cur))
            audit = get_audit(cur, audit.audit_id)
        if audit.status == "staged" or (refresh and audit.status == "audited"):
            diff, digest = sink_for(cfg).audit_diff(cur, audit)
            diff["quality"] = quality_of(batches)
            _transition(cur, audit, "audited", by, audit=json.dumps(diff, default=str),
                        live_digest=digest, audited_by=by, audited_at=_now(cur))
            audit = get_audit(cur, audit.audit_id)
        out = describe(audit, batches)
    return out


def _now(cur: psycopg2.extensions.cursor) -> Any:
    cur.execute("SELECT now()")
    row = cur.fetchone()
    assert row is not None
    return row[0]


def describe(audit: Audit, batches: Sequence[Batch]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "audit_id": audit.audit_id, "pipeline": audit.pipeline, "kind": audit.kind,
        "status": audit.status, "target_table": audit.target_table,
        "shadow_table": audit.shadow_table, "window": list(audit.ranges),
        "batches": [{"batch_id": b.batch_id, "status": b.status,
                     "rows_written": b.rows_written, "bad_records": b.bad_records}
                    for b in batches],
        **audit.info}
    if audit.audit is not None:
        out["diff"] = audit.audit
    if audit.status == "staging":
        waiting = [b.batch_id for b in batches if b.status != "committed"]
        out["next"] = (f"batch(es) {waiting} are not committed into the shadow yet: run them "
                       f"(offsetflow run-batch -p {audit.pipeline} --batch-id "
                       f"{','.join(map(str, waiting))}), or discard the audit")
    elif audit.status == "audited":
        out["next"] = (f"offsetflow audit publish {audit.audit_id} | offsetflow audit discard "
                       f"{audit.audit_id}")
    return out


def check_within(audit: Audit, max_changes: int) -> None:
    """Publishing without a human: only when the recorded diff changes at most
    `max_changes` rows (added + removed + changed) and the quality suite, if any, passed."""
    diff = audit.audit or {}
    t = diff.get("totals") or {}
    changes = sum(int(t.get(k, 0)) for k in ("added", "removed", "changed"))
    quality = diff.get("quality") or {}
    if quality.get("suite") is not None and not quality.get("passed"):
        raise AuditStateError(f"audit {audit.audit_id}: its quality suite failed; not "
                              f"published automatically (see `offsetflow audit show "
                              f"{audit.audit_id}`, then publish or discard it by hand)")
    if changes > max_changes:
        raise AuditStateError(
            f"audit {audit.audit_id}: its diff changes {changes} rows ({t.get('added')} added, "
            f"{t.get('removed')} removed, {t.get('changed')} changed), more than the "
            f"{max_changes} allowed; not published automatically (see `offsetflow audit "
            f"show {audit.audit_id}`, then publish or discard it by hand)")


def publish_audit(cfg: PipelineConfig, dsn: str, audit_or_batch_id: int, by: str = "cli",
                  reason: str | None = None, max_changes: int | None = None
                  ) -> dict[str, Any]:
    """One transaction: the audit row locked, the live window replaced from the shadow (the
    sink's `publish_audit`: refused if the live window changed since the diff), the
    batches recorded as written into the live table, the shadows dropped, the audit
    published. Publishing a published audit changes nothing. With `max_changes`, only
    within those limits (`check_within`)."""
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        audit = _lock(cur, audit_or_batch_id)
        if audit.status == "published":
            log.info("audit %d is published already; nothing to do", audit.audit_id)
            return {"audit_id": audit.audit_id, "status": "published", "changed": False}
        if audit.status == "discarded":
            raise AuditStateError(
                f"audit {audit.audit_id} was discarded ({audit.info.get('closed_by')}, "
                f"{audit.info.get('closed_at')}); its shadow is gone, so it cannot be "
                f"published: run the {audit.kind} again (with --audit)")
        if audit.status != "audited":
            raise AuditStateError(
                f"audit {audit.audit_id} is {audit.status}: nobody has seen its diff yet; "
                f"run `offsetflow audit show {audit.audit_id}` first, then publish")
        if max_changes is not None:
            check_within(audit, max_changes)
        batches = _batches(ledger, cur, audit)
        rows = sink_for(cfg).publish_audit(cur, audit, batches)
        cur.execute("UPDATE offsetflow.batches SET target_table = %s WHERE batch_id = ANY(%s)",
                    (audit.target_table, list(audit.batch_ids)))
        _transition(cur, audit, "published", by, reason, closed_by=by, closed_at=_now(cur),
                    reason=reason)
    log.info("audit %d published: %d rows into %s", audit.audit_id, rows, audit.target_table)
    # what the Asset and OpenLineage events of the publish carry (only on this first,
    # changing publish: a rerun returns changed False above and emits nothing)
    return {"audit_id": audit.audit_id, "status": "published", "changed": True, "rows": rows,
            "target_table": audit.target_table, "pipeline": audit.pipeline,
            "kind": audit.kind, "window": [dict(r) for r in audit.ranges],
            "batches": [published_figures(b, audit.target_table) for b in batches]}


def published_figures(b: Batch, target_table: str) -> dict[str, Any]:
    """A batch of a published audit as a publish task reports one (`assets.batch_extra`):
    now written into the live `target_table`."""
    return {"batch_id": b.batch_id, "kind": b.kind, "rows_written": b.rows_written,
            "records_read": b.records_read, "bad_records": b.bad_records,
            "target_table": target_table, "ranges": window_ranges_json(b.ranges)}


def discard_audit(cfg: PipelineConfig, dsn: str, audit_or_batch_id: int, by: str = "cli",
                  reason: str | None = None) -> dict[str, Any]:
    """One transaction: the shadows dropped, the window's batches still open abandoned (a
    run of one that commits later is refused), the audit discarded. The live table is not
    touched. Discarding a discarded audit changes nothing; a published one is refused."""
    with Ledger(dsn) as ledger, ledger.transaction() as cur:
        audit = _lock(cur, audit_or_batch_id)
        if audit.status == "discarded":
            return {"audit_id": audit.audit_id, "status": "discarded", "changed": False}
        if audit.status == "published":
            raise AuditStateError(
                f"audit {audit.audit_id} is published already: its rows are live. To undo "
                f"it, replay the window again (with --audit to see the difference first)")
        for b in _batches(ledger, cur, audit):
            if b.is_open:
                ledger.abandon(b.batch_id, f"audit {audit.audit_id} discarded", cur)
        sink_for(cfg).discard_audit(cur, audit)
        _transition(cur, audit, "discarded", by, reason, closed_by=by, closed_at=_now(cur),
                    reason=reason)
    return {"audit_id": audit.audit_id, "status": "discarded", "changed": True}


def format_audit(out: Mapping[str, Any]) -> str:
    """`offsetflow audit show` for a terminal."""
    lines = [f"audit {out['audit_id']} ({out['kind']} of pipeline {out['pipeline']}): "
             f"{out['status']}",
             f"  live table {out['target_table']}, shadow {out['shadow_table']}"]
    for r in out["window"]:
        lines.append(f"  window {r['topic']}[{r['partition']}] [{r['from_offset']}, "
                     f"{r['until_offset']})")
    diff = out.get("diff")
    if diff:
        t = diff["totals"]
        lines.append(f"  diff: {t['added']} added, {t['removed']} removed, {t['changed']} "
                     f"changed, {t['same']} unchanged ({t['staged_rows']} staged rows, "
                     f"{t['live_rows']} live rows)")
        for rng, c in sorted(diff["per_range"].items()):
            lines.append(f"    {rng}: +{c['added']} -{c['removed']} ~{c['changed']} "
                         f"={c['same']}")
        for change, rows in diff["samples"].items():
            for row in rows[:3]:
                cols = row.get("changed_columns")
                if cols:  # only what differs
                    lines.append(f"    sample {change} @{row['offset']}: " + ", ".join(
                        f"{c}: {row['live'].get(c)!r} -> {row['staged'].get(c)!r}"
                        for c in cols))
                else:
                    lines.append(f"    sample {change} @{row['offset']}: "
                                 f"{row['live'] or row['staged']}")
        q = diff.get("quality") or {}
        lines.append("  quality: " + ("no suite" if q.get("suite") is None else
                                      "passed" if q.get("passed") else "FAILED"))
    if out.get("next"):
        lines.append(f"  next: {out['next']}")
    return "\n".join(lines)
