"""The Iceberg sink's side of audit before publish, in the ledger's transaction that
`offsetflow.ops.audit` holds (the audit row locked): the table checked to be the ledger's,
the branch diffed, published or removed (`offsetflow.sinks.iceberg.audit`), and the window's
dead letters, which stay in PostgreSQL, moved from their shadow as a direct replay's commit
would have written them.

Order of publish: the one catalog commit on main first, then (same ledger transaction) the
dead letters, the identity record, the audit published. A kill before the catalog commit
leaves nothing; a kill after it leaves main published and the ledger not: the rerun finds
the publish on main (`published_on_main`) and finishes the ledger's part only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit import (
    LINEAGE_COLUMN,
    Audit,
    delete_window_dead_letters,
    shadow_name,
    table_exists,
    window_incarnations,
)
from offsetflow.config import PipelineConfig, resolve_identifier
from offsetflow.errors import AuditStateError, RequestError
from offsetflow.ledger import Batch, ledger_identity, qualified
from offsetflow.sinks.iceberg.audit import (
    audit_branch,
    branch_head,
    diff_branch,
    publish_branch,
    refuse_published,
    remove_branch,
)
from offsetflow.sinks.iceberg.commit import no_rebase, unknown_window_rows, window_filter
from offsetflow.sinks.iceberg.sink import IcebergSink, sink_of

if TYPE_CHECKING:
    from pyiceberg.table import Table


def _sink(cfg: PipelineConfig, cur: psycopg2.extensions.cursor) -> IcebergSink:
    return sink_of(cfg, cfg.sink.connection or cur.connection.dsn)


def _ident(cfg: PipelineConfig, target: str) -> str:
    assert cfg.sink.iceberg is not None
    return resolve_identifier(cfg.sink.iceberg, cfg.sink.table, target)


def _table(cfg: PipelineConfig, sink: IcebergSink, cur: psycopg2.extensions.cursor,
           audit_id: int, target: str) -> Table | None:
    """The live table, checked to be the ledger's in `cur`'s transaction; None if gone."""
    from pyiceberg.exceptions import NoSuchTableError

    ident = _ident(cfg, target)
    sink.check_in(cur, ident)  # refused (IcebergTableIdentityError) if not the ledger's
    try:
        return sink.catalog.load_table(ident)
    except NoSuchTableError:
        return None


def audit_shadows(cfg: PipelineConfig, cur: psycopg2.extensions.cursor, target: str,
                  audit_id: int) -> tuple[str, str | None]:
    """The branch (named `<table>@audit-<id>` where the ledger names the shadow) and the
    dead letters' shadow table in PostgreSQL. Append mode only, on a table with rows."""
    if cfg.sink.mode != "append":
        raise RequestError(
            f"pipeline {cfg.name}: --audit is for sink.mode append so far (an upsert replay "
            f"keeps or replaces live rows outside the window by key); run the replay "
            f"without --audit")
    sink = _sink(cfg, cur)
    try:
        table = _table(cfg, sink, cur, audit_id, target)
    finally:
        sink.close()
    if table is None or table.current_snapshot() is None:
        raise RequestError(
            f"--audit compares the window with the live Iceberg table {_ident(cfg, target)}, "
            f"which does not exist or holds no snapshot; run the window without --audit")
    return (f"{_ident(cfg, target)}@{audit_branch(audit_id)}",
            shadow_name(cfg.dead_letter_table, audit_id))


def audit_diff(cfg: PipelineConfig, cur: psycopg2.extensions.cursor, audit: Audit
               ) -> tuple[dict[str, Any], str]:
    sink = _sink(cfg, cur)
    try:
        table = _table(cfg, sink, cur, audit.audit_id, audit.target_table)
        if table is None:
            raise AuditStateError(
                f"audit {audit.audit_id}: its live Iceberg table "
                f"{_ident(cfg, audit.target_table)} is gone (dropped or renamed); recreate "
                f"or rename it back, or discard the audit")
        if branch_head(table, audit_branch(audit.audit_id)) is None:  # gone: published?
            refuse_published(table, audit.audit_id, cfg.name,
                             ledger_identity(cur).installation_id, audit.audit or {},
                             "diffed again")
        return diff_branch(table, audit_branch(audit.audit_id), audit.ranges)
    finally:
        sink.close()


def publish_audit(cfg: PipelineConfig, cur: psycopg2.extensions.cursor, audit: Audit,
                  batches: Sequence[Batch]) -> int:
    """Main made what a direct replay of `batches` would have made (one catalog commit),
    then the window's dead letters from their shadow, in `cur`'s transaction."""
    sink = _sink(cfg, cur)
    try:
        table = _table(cfg, sink, cur, audit.audit_id, audit.target_table)
        if table is None:
            raise AuditStateError(
                f"audit {audit.audit_id}: its live Iceberg table "
                f"{_ident(cfg, audit.target_table)} is gone (dropped or renamed); recreate "
                f"or rename it back, or discard the audit")
        ledger = ledger_identity(cur).installation_id
        live = [dataclasses.replace(b, target_table=audit.target_table) for b in batches]
        incarnations = {b.batch_id: window_incarnations(cur, b) for b in live}

        def window(t: Table) -> Any:  # a direct replay's delete, for main as loaded now
            from pyiceberg import expressions

            out: Any = expressions.AlwaysFalse()
            for b in live:
                unknown_window_rows(t, b, incarnations[b.batch_id])
                out = expressions.Or(out, window_filter(b, incarnations[b.batch_id]))
            return out

        # the identity record keeps naming the last live batch's snapshot, still on main
        # (publish only adds to main); the next batch's commit records the table after it
        publish_branch(table, audit.audit_id, cfg.name, audit_branch(audit.audit_id), live,
                       audit.audit or {}, audit.live_digest, window, ledger, no_rebase)
    finally:
        sink.close()
    publish_dead_letters(cur, live, audit)
    return sum(int(b.rows_written or 0) for b in batches)


def publish_dead_letters(cur: psycopg2.extensions.cursor, batches: Sequence[Batch],
                         audit: Audit) -> None:
    """For each batch in order, what a direct replay's commit makes of its dead letters:
    the window's earlier ones deleted, then the batch's from the shadow; the shadow
    dropped. Refused (AuditStateError) when the shadow does not hold what the batch
    committed there."""
    live, shadow = audit.dead_letter_table, audit.shadow_dead_letter_table
    if not live or not shadow:
        return
    have = table_exists(cur, shadow)
    for batch in batches:
        delete_window_dead_letters(cur, batch, live)
        if not have:
            dead = 0
        else:
            cur.execute("SELECT column_name FROM information_schema.columns WHERE "
                        "table_schema = %s AND table_name = %s ORDER BY ordinal_position",
                        tuple(qualified_parts(shadow)))
            cols = sql.SQL(", ").join(sql.Identifier(c) for c, in cur.fetchall())
            cur.execute(sql.SQL("INSERT INTO {t} ({c}) SELECT {c} FROM {s} WHERE {lin} = %s")
                        .format(t=qualified(live), c=cols, s=qualified(shadow),
                                lin=sql.Identifier(LINEAGE_COLUMN)), (batch.batch_id,))
            dead = int(cur.rowcount)
        if dead != int(batch.bad_records or 0):
            raise AuditStateError(
                f"audit {audit.audit_id}: the dead-letter shadow {shadow} holds {dead} dead "
                f"letters of batch {batch.batch_id}, but it committed "
                f"{batch.bad_records or 0} there (the shadow was changed); nothing is "
                f"published. Discard the audit and run the window with --audit again")
    cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(qualified(shadow)))


def qualified_parts(table: str) -> tuple[str, str]:
    from offsetflow.config import split_table_name

    return split_table_name(table)


def discard_audit(cfg: PipelineConfig, cur: psycopg2.extensions.cursor, audit: Audit) -> None:
    """The branch removed (if the table and it are there) and the dead letters' shadow
    dropped; idempotent. Main is not touched."""
    from pyiceberg.exceptions import NoSuchTableError

    sink = _sink(cfg, cur)
    try:
        try:
            table = sink.catalog.load_table(_ident(cfg, audit.target_table))
        except NoSuchTableError:
            table = None
        if table is not None:
            refuse_published(table, audit.audit_id, cfg.name,
                             ledger_identity(cur).installation_id, audit.audit or {},
                             "discarded")
            remove_branch(table, audit_branch(audit.audit_id))
    finally:
        sink.close()
    if audit.shadow_dead_letter_table:
        cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
            qualified(audit.shadow_dead_letter_table)))
