"""Step 4 of the commit protocol (`offsetflow.commit.protocol`) into a PostgreSQL target, as SQL:
staged rows appended with their count checked against the marker (`append_part`: the whole
stage, or one part at a time for `offsetflow.commit.partwise.PartwiseCommit`), the bad records the
tasks staged into the dead-letter table, and, for a replay or backfill, what its ranges
produced before deleted first."""

from __future__ import annotations

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit.dead_letters import dead_letters_from
from offsetflow.commit.incarnations import (
    delete_window_dead_letters,
    refuse_other_incarnations,
    window_incarnations,
)
from offsetflow.commit.spec import CommitSpec, Moved
from offsetflow.commit.tables import DEAD_LETTER_COLUMNS, LINEAGE_COLUMN, TOPIC_ID_COLUMN
from offsetflow.errors import StagedRowsLostError
from offsetflow.ledger import Batch, dead_letter_stage_table, qualified
from offsetflow.stage import task_bad_records

TOMBSTONE_ERROR = "tombstone (null value); the pipeline has tombstones: dead_letter"


def append_part(cur: psycopg2.extensions.cursor, batch: Batch, spec: CommitSpec,
                source: sql.Composable, expected: int, what: str, part: int | None,
                moved: Moved) -> None:
    """Step 4 in append mode for one source (a part table, or the stage): its rows into the
    target, tombstones routed by policy, and the total checked against `expected` (the
    marker's count) from the INSERTs' rowcounts, so the fast path scans each part once."""
    where = sql.SQL(" WHERE s.value IS NOT NULL") if spec.routes_tombstones else sql.SQL("")
    collist = sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns)
    cur.execute(sql.SQL("INSERT INTO {t} ({cols}, {lin}) SELECT {cols}, %s FROM {src} s{w}")
                .format(t=qualified(batch.target_table), cols=collist,
                        lin=sql.Identifier(LINEAGE_COLUMN), src=source, w=where),
                (batch.batch_id,))
    rows, dead = int(cur.rowcount), 0
    if rows < expected and spec.routes_tombstones:
        assert spec.dead_letter_table is not None
        dead = dead_letters_from(cur, batch, spec.dead_letter_table,
                                 sql.SQL("{} s").format(source), spec.columns,
                                 sql.SQL("s.value IS NULL"), sql.Literal(TOMBSTONE_ERROR),
                                 "tombstone")
    if rows + dead != expected:
        raise StagedRowsLostError(
            batch.batch_id, None if part is None else [part],
            f"{what} holds {rows + dead} rows but its marker counts {expected}")
    moved.rows += rows
    moved.dead += dead



def move_stage_dead_letters(cur: psycopg2.extensions.cursor, batch: Batch, spec: CommitSpec,
                            moved: Moved) -> None:
    """Step 4's end: bad records the tasks staged (bad_records: dead_letter)."""
    if not (spec.bad_records_staged and spec.dead_letter_table):
        return
    dl_cols = sql.SQL(", ").join(sql.Identifier(c) for c, _ in DEAD_LETTER_COLUMNS)
    cur.execute(sql.SQL("INSERT INTO {dl} ({cols}, {lin}) SELECT {cols}, %s FROM {st}")
                .format(dl=qualified(spec.dead_letter_table), cols=dl_cols,
                        lin=sql.Identifier(LINEAGE_COLUMN),
                        st=dead_letter_stage_table(batch.batch_id)), (batch.batch_id,))
    found, expected = int(cur.rowcount), task_bad_records(cur, batch.batch_id)
    if found != expected:
        raise StagedRowsLostError(batch.batch_id, None, f"the dead-letter stage holds {found} "
                                                        f"bad records but its markers count "
                                                        f"{expected}")
    moved.dead += found


def delete_range_rows(cur: psycopg2.extensions.cursor, batch: Batch, spec: CommitSpec) -> None:
    """Replay/backfill: what the ranges produced before is replaced, not duplicated. In an
    upsert target, rows of another incarnation of the topic (deleted and recreated, same
    offsets again) are not the window's and stay; an append target cannot hold both at one
    coordinate, so such rows there refuse the window (`refuse_other_incarnations`)."""
    other_incarnation: sql.Composable = sql.SQL("")
    if spec.mode == "upsert":
        other_incarnation = sql.SQL(
            " AND NOT COALESCE({tid} <> (SELECT topic_id FROM offsetflow.batch_ranges WHERE "
            "batch_id = %s AND topic = %s AND partition = %s), false)").format(
                tid=sql.Identifier(TOPIC_ID_COLUMN))
    incarnations = window_incarnations(cur, batch)
    if spec.dead_letter_table:  # those of the window's topic incarnation
        delete_window_dead_letters(cur, batch, spec.dead_letter_table, incarnations)
    for r, inc in zip(batch.ranges, incarnations, strict=True):
        if spec.mode != "upsert":  # rows of another incarnation: neither kept nor deleted
            refuse_other_incarnations(cur, batch, batch.target_table, inc)
        args: tuple[object, ...] = (r.topic, r.partition, r.from_offset, r.until_offset)
        if spec.mode == "upsert":
            args += (batch.batch_id, r.topic, r.partition)
        cur.execute(sql.SQL("DELETE FROM {} WHERE topic = %s AND partition = %s "
                            "AND \"offset\" >= %s AND \"offset\" < %s{}").format(
                                qualified(batch.target_table), other_incarnation), args)

