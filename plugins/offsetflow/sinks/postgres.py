"""PostgreSQL as the sink (the default): the batch's rows go into `sink.table` in the ledger's
own commit transaction (`offsetflow.commit.protocol`'s step 4, `move_rows`), so there is
no separate sink to commit, find or sweep."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit import (
    Audit,
    CommitSpec,
    ExternalSink,
    diff_window,
    ensure_target,
    live_only_columns,
    publish_shadow,
    shadow_name,
    table_exists,
    window_digest,
)
from offsetflow.errors import AuditConflictError, AuditStateError, BatchStateError, RequestError
from offsetflow.ledger import Batch, qualified
from offsetflow.sinks.base import Sink


class PostgresSink(Sink):
    """`sink.type: postgres`: append, or upsert on `sink.key`."""

    def prepare_target(self, cur: psycopg2.extensions.cursor, batch: Batch,
                       columns: Sequence[tuple[str, str]], evolved: Sequence[str] = ()
                       ) -> bool:
        """The batch's target table (the pipeline's, or the one a backfill named), created
        with its lineage column and indexes, or checked to fit; the `evolved` columns an
        existing table lacks are the commit's to add (in its transaction)."""
        return ensure_target(cur, batch.target_table, columns, self.cfg.sink.mode,
                             self.cfg.sink.key, evolved)

    @property
    def commits_partwise(self) -> bool:
        """An append moves each part as its task staged it; an upsert keeps the latest
        record per key across the whole batch, so it waits for all parts."""
        return self.cfg.sink.mode == "append"

    def external(self, dsn: str, columns: Sequence[tuple[str, str]] | None = None,
                 spec: CommitSpec | None = None) -> None:
        """None: step 4 runs in the ledger's transaction."""
        return None

    def complete_from(self, dsn: str, batch: Batch) -> ExternalSink:
        raise BatchStateError(
            f"batch {batch.batch_id}: pipeline {batch.pipeline} writes to PostgreSQL, "
            f"where rows and ledger commit together; there is no sink record to complete "
            f"it from (run it, or abandon it)")

    @property
    def reset_rows_table(self) -> str | None:
        """The pipeline's table in append mode; upsert rows cannot collide: a recreated
        topic's records replace its old incarnation's (`offsetflow.commit.upsert`)."""
        return self.cfg.sink.table if self.cfg.sink.mode == "append" else None

    # -- audit before publish: a shadow table beside the live one --------------------------
    def audit_shadows(self, cur: psycopg2.extensions.cursor, target: str, audit_id: int
                      ) -> tuple[str, str | None]:
        """`<table>__audit_<id>` beside the live table, and the same beside the dead-letter
        table. Append mode only: an upsert replay's result depends on the live rows of its
        keys outside the window, which a shadow does not hold."""
        if self.cfg.sink.mode != "append":
            raise RequestError(
                f"pipeline {self.cfg.name}: --audit is for sink.mode append so far (an upsert "
                f"replay keeps or replaces live rows outside the window by key); run the "
                f"replay without --audit")
        if not table_exists(cur, target):
            raise RequestError(
                f"--audit compares the window with the live table {target}, which does not "
                f"exist; run the window without --audit")
        return (shadow_name(target, audit_id),
                shadow_name(self.cfg.dead_letter_table, audit_id))

    def audit_diff(self, cur: psycopg2.extensions.cursor, audit: Audit
                   ) -> tuple[dict[str, Any], str]:
        self.check_audit_tables(cur, audit)
        return diff_window(cur, audit.target_table, audit.shadow_table, audit.ranges)

    def check_audit_tables(self, cur: psycopg2.extensions.cursor, audit: Audit) -> None:
        """Both the live table and the shadow are where the audit left them, and the live
        table still has every column of the shadow."""
        for table, what, way_out in (
                (audit.target_table, "live table", "recreate or rename it back, or discard "
                                                    "the audit"),
                (audit.shadow_table, "shadow table", "discard the audit and run the window "
                                                     "with --audit again")):
            if not table_exists(cur, table):
                raise AuditStateError(f"audit {audit.audit_id}: its {what} {table} is gone "
                                      f"(dropped or renamed); {way_out}")
        _, lost = live_only_columns(cur, audit.target_table, audit.shadow_table)
        if lost:
            raise AuditStateError(
                f"audit {audit.audit_id}: its live table {audit.target_table} lacks column(s) "
                f"{lost} that the shadow {audit.shadow_table} has (renamed or dropped since "
                f"the window was staged): the window cannot be diffed nor published. Add or "
                f"rename them back, or discard the audit")

    def publish_audit(self, cur: psycopg2.extensions.cursor, audit: Audit,
                      batches: Sequence[Batch]) -> int:
        """Under a lock that stops every other writer of the live table (a live commit waits
        for the publish) and of the shadow, the window's live rows and the shadow's are
        checked to be those the diff compared, then the live ones replaced from the shadow;
        the shadows are dropped in the same transaction."""
        self.check_audit_tables(cur, audit)
        # the shadow first: its digest is read before the live table is locked, so the
        # live pipeline waits only for the live digest, the delete and the insert
        cur.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(
            qualified(audit.shadow_table)))
        shadow = window_digest(cur, audit.shadow_table, audit.ranges)
        if shadow != (audit.audit or {}).get("shadow_digest"):
            raise AuditConflictError(
                f"audit {audit.audit_id}: the shadow {audit.shadow_table} changed since the "
                f"diff (its rows are not the ones the diff compared); nothing is published. "
                f"Run `offsetflow audit show {audit.audit_id} --refresh` to diff it as it is "
                f"now, then publish, or discard the audit and run the window with --audit "
                f"again")
        cur.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(
            qualified(audit.target_table)))
        now = window_digest(cur, audit.target_table, audit.ranges)
        if now != audit.live_digest:
            raise AuditConflictError(
                f"audit {audit.audit_id}: the live rows of {audit.target_table} in its window "
                f"changed since the diff (another replay or backfill committed there); "
                f"nothing is published. Run `offsetflow audit show {audit.audit_id} "
                f"--refresh` to diff against the live table as it is now, then publish")
        spec = CommitSpec(columns=(), mode="append", dead_letter_table=audit.dead_letter_table)
        rows = publish_shadow(cur, batches, audit.target_table, audit.shadow_table, spec,
                              audit.shadow_dead_letter_table)
        self.discard_audit(cur, audit)
        return rows

    def discard_audit(self, cur: psycopg2.extensions.cursor, audit: Audit) -> None:
        for table in (audit.shadow_table, audit.shadow_dead_letter_table):
            if table:
                cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(qualified(table)))
