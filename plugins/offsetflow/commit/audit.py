"""Audit before publish into a PostgreSQL target, as SQL (`offsetflow.ops.audit` drives it,
through the sink's audit methods): the shadow table an audited window is written to, the
diff of the shadow against the live rows at the window's coordinates, the digest of those
live rows (what publish checks has not changed), and publish itself: for each batch of the
window, in order, exactly the step 4 a direct replay of it makes (`delete_range_rows`: the
window's earlier rows and dead letters go), then the batch's rows and dead letters from the
shadows instead of the stage.

An append target holds one row per coordinate (its guard index), so a row's key in the diff
is its coordinate (topic, partition, offset); rows compare by every column but the lineage
column (the batch that wrote it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit.rows import delete_range_rows
from offsetflow.commit.spec import CommitSpec
from offsetflow.commit.tables import DEAD_LETTER_COLUMNS, LINEAGE_COLUMN, existing_columns
from offsetflow.config import split_table_name
from offsetflow.errors import AuditStateError
from offsetflow.ledger import Batch, qualified

MAX_IDENTIFIER = 63  # PostgreSQL truncates longer names silently
OPEN_AUDIT_STATUSES = ("staging", "staged", "audited")


@dataclass(frozen=True)
class Audit:
    """One row of `offsetflow.audits` (migration 0014): an audited window."""

    audit_id: int
    pipeline: str
    kind: str
    batch_ids: tuple[int, ...]
    target_table: str
    shadow_table: str
    dead_letter_table: str | None
    shadow_dead_letter_table: str | None
    ranges: tuple[dict[str, Any], ...]
    status: str
    live_digest: str | None = None
    audit: dict[str, Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # who and when, history

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_AUDIT_STATUSES

    def overlaps(self, ranges: Sequence[Mapping[str, Any]]) -> bool:
        return any(a["topic"] == b["topic"] and a["partition"] == b["partition"]
                   and a["from_offset"] < b["until_offset"]
                   and b["from_offset"] < a["until_offset"]
                   for a in self.ranges for b in ranges)


def shadow_name(table: str, audit_id: int) -> str:
    """The shadow of `table` for audit `audit_id`: beside it, in its schema."""
    schema, name = split_table_name(table)
    shadow = f"{name}__audit_{audit_id}"
    if len(shadow) > MAX_IDENTIFIER:
        shadow = f"offsetflow_audit_{audit_id}_{name}"[:MAX_IDENTIFIER]
    return f"{schema}.{shadow}"


def table_exists(cur: psycopg2.extensions.cursor, table: str) -> bool:
    cur.execute("SELECT to_regclass(%s) IS NOT NULL", (qualified(table).as_string(cur),))
    row = cur.fetchone()
    return bool(row and row[0])


def _window_filter(ranges: Sequence[Mapping[str, Any]], alias: str) -> tuple[sql.Composable,
                                                                             list[Any]]:
    """`alias` rows at the window's coordinates."""
    parts, args = [], []
    for r in ranges:
        parts.append(sql.SQL("({a}.topic = %s AND {a}.partition = %s AND {a}.\"offset\" >= %s "
                             "AND {a}.\"offset\" < %s)").format(a=sql.Identifier(alias)))
        args += [r["topic"], r["partition"], r["from_offset"], r["until_offset"]]
    return sql.SQL("({})").format(sql.SQL(" OR ").join(parts) if parts else sql.SQL("false")), args


def data_columns(cur: psycopg2.extensions.cursor, shadow: str) -> list[str]:
    """The shadow's columns a row is compared by: all but the lineage column."""
    return [c for c in existing_columns(cur, shadow) if c != LINEAGE_COLUMN]


def live_only_columns(cur: psycopg2.extensions.cursor, live: str, shadow: str
                      ) -> tuple[list[str], list[str]]:
    """The live table's columns the shadow lacks (publish leaves them NULL in the window,
    as a direct replay would), and the shadow's columns the live table lacks (renamed or
    dropped since staging: publish cannot insert them)."""
    have = [c for c in existing_columns(cur, live) if c != LINEAGE_COLUMN]
    staged = data_columns(cur, shadow)
    return [c for c in have if c not in staged], [c for c in staged if c not in have]


def _row_hash(columns: Sequence[str], alias: str, absent: Sequence[str] = ()
              ) -> sql.Composable:
    """The hash of a row by `columns`; those in `absent` count as NULL (what publish makes
    of a live column the shadow lacks)."""
    return sql.SQL("md5(ROW({})::text)").format(sql.SQL(", ").join(
        sql.SQL("NULL") if c in absent else
        sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(c)) for c in columns))


def _digest(hashes: str, rows: str) -> sql.Composable:
    """The digest of the row hashes in column `hashes` of `rows` (NULLs are no rows): one
    format for the diff and for publish."""
    return sql.SQL("SELECT count({h}) || ':' || COALESCE(md5(string_agg({h}, ',' ORDER BY {h})),"
                   " '') FROM {r}").format(h=sql.Identifier(hashes), r=sql.Identifier(rows))


def window_digest(cur: psycopg2.extensions.cursor, table: str,
                  ranges: Sequence[Mapping[str, Any]]) -> str:
    """A digest of `table`'s rows at the window's coordinates (every column, lineage
    included): publish refuses when the live one, or the shadow's, differs from the one the
    diff was made against."""
    where, args = _window_filter(ranges, "l")
    cur.execute(sql.SQL("WITH d AS (SELECT md5(l::text) AS h FROM {t} l WHERE {w}) {g}").format(
        t=qualified(table), w=where, g=_digest("h", "d")), args)
    row = cur.fetchone()
    assert row is not None
    return str(row[0])


def diff_window(cur: psycopg2.extensions.cursor, live: str, shadow: str,
                ranges: Sequence[Mapping[str, Any]], sample: int = 10
                ) -> tuple[dict[str, Any], str]:
    """Rows added (only in the shadow), removed (only live) and changed (both, another
    content, by every column of either side but the lineage column: a live column the
    shadow lacks counts as NULL there, as publish leaves it) at the window's coordinates:
    totals, per range, and up to `sample` of each;
    and the digest of the live window (`window_digest`). One pass over each side compares
    row hashes; only the sampled rows are read whole. The counts and both digests (the
    shadow's is `shadow_digest` in the diff) come from one statement, so one snapshot: a
    commit into the live window or the shadow between them would give a digest of rows the
    diff never compared, and publish would replace rows nobody saw."""
    extra, _ = live_only_columns(cur, live, shadow)  # the sink refused any the live lacks
    columns = [*data_columns(cur, shadow), *extra]
    lw, largs = _window_filter(ranges, "l")
    sw, sargs = _window_filter(ranges, "s")
    coords = sql.SQL("topic, partition, \"offset\"")
    q = sql.SQL("""
        WITH l AS (SELECT topic, partition, "offset", {lh} AS h, md5(l::text) AS fh
                     FROM {live} l WHERE {lw}),
             s AS (SELECT topic, partition, "offset", {sh} AS h, md5(s::text) AS fh
                     FROM {shadow} s WHERE {sw}),
             d AS MATERIALIZED (
                 SELECT topic, partition, "offset",
                        CASE WHEN l.h IS NULL THEN 'added' WHEN s.h IS NULL THEN 'removed'
                             WHEN s.h <> l.h THEN 'changed' ELSE 'same' END AS change,
                        l.fh AS lfh, s.fh AS sfh  -- for the digests: one pass per side
                   FROM s FULL JOIN l USING ({coords}))
        SELECT topic, partition, change, count(*), NULL::bigint FROM d GROUP BY 1, 2, 3
        UNION ALL
        SELECT topic, partition, change, NULL, "offset" FROM (
            SELECT d.*, row_number() OVER (PARTITION BY change
                                           ORDER BY topic, partition, "offset") AS rn
              FROM d WHERE change <> 'same') x WHERE rn <= %s
        UNION ALL
        SELECT ({ld}), NULL, 'live_digest', NULL, NULL
        UNION ALL
        SELECT ({sd}), NULL, 'shadow_digest', NULL, NULL""").format(
        lh=_row_hash(columns, "l"), sh=_row_hash(columns, "s", extra), live=qualified(live),
        shadow=qualified(shadow), lw=lw, sw=sw, coords=coords, ld=_digest("lfh", "d"),
        sd=_digest("sfh", "d"))
    cur.execute(q, [*largs, *sargs, sample])
    totals = {"added": 0, "removed": 0, "changed": 0, "same": 0}
    per_range: dict[str, dict[str, int]] = {}
    picked: list[tuple[str, str, int, int]] = []
    digests: dict[str, str] = {}
    for topic, partition, change, n, offset in cur.fetchall():
        if change in ("live_digest", "shadow_digest"):
            digests[change] = str(topic)
        elif offset is None:
            totals[change] += int(n)
            per_range.setdefault(f"{topic}/{partition}", {k: 0 for k in totals})[change] = int(n)
        else:
            picked.append((change, topic, int(partition), int(offset)))
    picked.sort()
    live_rows = _rows_at(cur, live, [p[1:] for p in picked])
    staged_rows = _rows_at(cur, shadow, [p[1:] for p in picked])
    samples: dict[str, list[Any]] = {"added": [], "removed": [], "changed": []}
    for change, topic, partition, offset in picked:
        samples[change].append(_with_changed_columns({
            "topic": topic, "partition": partition, "offset": offset,
            "live": live_rows.get((topic, partition, offset)),
            "staged": staged_rows.get((topic, partition, offset))}))
    return ({"totals": totals | {"staged_rows": totals["added"] + totals["changed"]
                                + totals["same"],
                                "live_rows": totals["removed"] + totals["changed"]
                                + totals["same"]},
            "per_range": per_range, "samples": samples, "columns": columns,
            "shadow_digest": digests["shadow_digest"]}, digests["live_digest"])


def _rows_at(cur: psycopg2.extensions.cursor, table: str,
             at: Sequence[tuple[str, int, int]]) -> dict[tuple[str, int, int], Any]:
    """The rows of `table` at these coordinates, as JSON without the lineage column."""
    if not at:
        return {}
    cur.execute(sql.SQL("""SELECT t.topic, t.partition, t."offset", to_jsonb(t) - %s
                             FROM {} t JOIN unnest(%s::text[], %s::int[], %s::bigint[])
                                  AS c(topic, partition, "offset")
                               ON t.topic = c.topic AND t.partition = c.partition
                              AND t."offset" = c."offset" """).format(qualified(table)),
                (LINEAGE_COLUMN, [a[0] for a in at], [a[1] for a in at], [a[2] for a in at]))
    return {(t, int(p), int(o)): row for t, p, o, row in cur.fetchall()}


def _with_changed_columns(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample row with the columns whose values differ between live and staged."""
    live, staged = sample.get("live") or {}, sample.get("staged") or {}
    if live and staged:
        sample["changed_columns"] = sorted(k for k in set(live) | set(staged)
                                           if live.get(k) != staged.get(k))
    return sample


def publish_shadow(cur: psycopg2.extensions.cursor, batches: Sequence[Batch], live: str,
                   shadow: str, spec: CommitSpec, shadow_dead_letters: str | None) -> int:
    """For each batch in order, what a direct replay's step 4 makes of it: the window's
    earlier rows and dead letters deleted (`delete_range_rows` on the live target), then the
    batch's rows and dead letters from the shadows. Returns the rows inserted; refuses
    (AuditStateError) a shadow whose rows are not the ones its batch committed there."""
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in
                                 [*data_columns(cur, shadow), LINEAGE_COLUMN])
    dl_cols = sql.SQL(", ").join(sql.Identifier(c) for c, _ in
                                 [*DEAD_LETTER_COLUMNS, (LINEAGE_COLUMN, "")])
    total = 0
    for batch in batches:
        delete_range_rows(cur, dataclasses.replace(batch, target_table=live), spec)
        cur.execute(sql.SQL("INSERT INTO {t} ({c}) SELECT {c} FROM {s} WHERE {lin} = %s")
                    .format(t=qualified(live), c=columns, s=qualified(shadow),
                            lin=sql.Identifier(LINEAGE_COLUMN)), (batch.batch_id,))
        rows = int(cur.rowcount)
        dead = 0
        if shadow_dead_letters and spec.dead_letter_table:
            cur.execute(sql.SQL("INSERT INTO {t} ({c}) SELECT {c} FROM {s} WHERE {lin} = %s")
                        .format(t=qualified(spec.dead_letter_table), c=dl_cols,
                                s=qualified(shadow_dead_letters),
                                lin=sql.Identifier(LINEAGE_COLUMN)), (batch.batch_id,))
            dead = int(cur.rowcount)
        if (rows, dead) != (batch.rows_written or 0, batch.bad_records or 0):
            raise AuditStateError(
                f"audit of batch {batch.batch_id}: the shadow {shadow} holds {rows} rows and "
                f"{dead} dead letters of it, but the batch committed "
                f"{batch.rows_written or 0} and {batch.bad_records or 0} there (the shadow "
                f"was changed); nothing is published. Discard the audit and replay again")
        total += rows
    return total
