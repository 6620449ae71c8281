"""Which rows a replay or backfill window replaces, when its topic had more than one
incarnation (deleted and created again under the same name: offsets from 0 again, another
Kafka topic id): only those of the incarnation the window reads.

A target without a topic-id column (an append table: `reset-position --force` kept the old
incarnation's rows beside the new one's, at the same coordinates) still knows each row's
batch (`_offsetflow_batch_id`), and the ledger knows the topic id every batch read
(`batch_ranges.topic_id`). So a window's rows are those at its coordinates written by a
batch of its own incarnation; a batch of another incarnation's rows stay. A row whose
batch read an unknown incarnation (planned before ledger migration 0002 recorded topic
ids, or not a batch of this ledger) cannot be told apart: `unknown_rows_error` refuses the
window, naming those batches and the way out, rather than delete or duplicate it.

While the ledger knows a single incarnation of a window's topic-partition, nothing is told
apart (`RangeIncarnation.mine` is None) and the window is its coordinates, as always.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit.tables import LINEAGE_COLUMN
from offsetflow.errors import WindowIncarnationError
from offsetflow.ledger import Batch, qualified


@dataclass(frozen=True)
class RangeIncarnation:
    """One range of a replay/backfill and the batches that wrote its coordinates."""

    topic: str
    partition: int
    from_offset: int
    until_offset: int
    topic_id: str | None  # the incarnation this range reads (None: the broker gave none)
    # batches of this incarnation overlapping the range (the window's own rows); None when
    # the ledger knows one incarnation only: the coordinates are the window
    mine: tuple[int, ...] | None
    others: tuple[int, ...] = ()  # batches of another incarnation: their rows stay

    @property
    def known(self) -> tuple[int, ...]:
        """Batches whose incarnation is known: a row of any other batch is not."""
        return (*(self.mine or ()), *self.others)

    def show(self) -> str:
        return f"{self.topic}[{self.partition}] [{self.from_offset}, {self.until_offset})"


def window_incarnations(cur: psycopg2.extensions.cursor, batch: Batch
                        ) -> list[RangeIncarnation]:
    """For each range of `batch`, the ledger's batches that read its coordinates, split by
    topic incarnation (any pipeline, any status: a row's batch is what wrote it)."""
    out = []
    for r in batch.ranges:
        cur.execute("""SELECT topic_id FROM offsetflow.batch_ranges
                        WHERE batch_id = %s AND topic = %s AND partition = %s""",
                    (batch.batch_id, r.topic, r.partition))
        row = cur.fetchone()
        own = row[0] if row else None
        cur.execute("""SELECT DISTINCT batch_id, topic_id FROM offsetflow.batch_ranges
                        WHERE topic = %s AND partition = %s AND batch_id <> %s
                          AND from_offset < %s AND until_offset > %s
                        ORDER BY batch_id""",
                    (r.topic, r.partition, batch.batch_id, r.until_offset, r.from_offset))
        seen = cur.fetchall()
        ids = {tid for _, tid in seen if tid is not None} | ({own} if own else set())
        if len(ids) <= 1:
            out.append(RangeIncarnation(r.topic, r.partition, r.from_offset, r.until_offset,
                                        own, None))
            continue
        if own is None:
            raise WindowIncarnationError(
                f"batch {batch.batch_id} ({batch.kind}): {r.topic} had {len(ids)} "
                f"incarnations (deleted and recreated; topic ids {sorted(ids)}) whose batches "
                f"read [{r.from_offset}, {r.until_offset}) of partition {r.partition}, but "
                f"the ledger recorded no topic id for this batch, so which rows it replaces "
                f"cannot be told; nothing was written. Abandon it (offsetflow abandon "
                f"--batch-id {batch.batch_id}) and plan the window again")
        out.append(RangeIncarnation(
            r.topic, r.partition, r.from_offset, r.until_offset, own,
            (batch.batch_id, *(b for b, tid in seen if tid == own)),
            tuple(b for b, tid in seen if tid is not None and tid != own)))
    return out


def unknown_rows_error(batch: Batch, r: RangeIncarnation, where: str, rows: int,
                       batches: Sequence[int | None]) -> WindowIncarnationError:
    """The window's coordinates hold `rows` rows of `batches` (their `_offsetflow_batch_id`)
    whose incarnation the ledger does not know."""
    shown = sorted({b for b in batches if b is not None})[:10]
    what = (f"batch(es) {shown}" if shown else "no batch") + (
        " and rows without a batch id" if None in batches else "")
    return WindowIncarnationError(
        f"batch {batch.batch_id} ({batch.kind} of {r.show()}): {where} holds {rows} rows "
        f"there written by {what}, whose topic incarnation the ledger does not record "
        f"(planned before ledger migration 0002, or not by this ledger), while the topic "
        f"had several incarnations (deleted and recreated); whether the {batch.kind} "
        f"replaces them cannot be told, so nothing was written. Delete the rows that belong "
        f"to the incarnation being re-read yourself (by _offsetflow_batch_id), or "
        f"{batch.kind} a window without them (offsetflow abandon --batch-id "
        f"{batch.batch_id} first)")


def refuse_other_incarnations(cur: psycopg2.extensions.cursor, batch: Batch, table: str,
                              r: RangeIncarnation) -> None:
    """A PostgreSQL append target holds one row per coordinates (its guard index): where a
    window's coordinates hold rows of another (or an unknown) incarnation of the topic, the
    window can neither keep them beside its own rows nor delete them (they are another
    incarnation's records). Refused, naming them; nothing written."""
    if r.mine is None:
        return
    lin = sql.Identifier(LINEAGE_COLUMN)
    cur.execute(sql.SQL("SELECT count(*), array_agg(DISTINCT {lin}) FROM {t} WHERE topic = %s "
                        "AND partition = %s AND \"offset\" >= %s AND \"offset\" < %s AND "
                        "NOT {lin} = ANY(%s)").format(lin=lin, t=qualified(table)),
                (r.topic, r.partition, r.from_offset, r.until_offset, list(r.mine)))
    row = cur.fetchone()
    if not row or not row[0]:
        return
    shown = sorted(row[1] or [])[:10]
    raise WindowIncarnationError(
        f"batch {batch.batch_id} ({batch.kind} of {r.show()}): {table} holds {row[0]} rows "
        f"there written by batch(es) {shown} of another incarnation of {r.topic} (deleted "
        f"and recreated) or of one the ledger does not record; an append table holds one row "
        f"per topic, partition and offset, so the {batch.kind} can neither keep them beside "
        f"its own nor replace them, and nothing was written. Move those rows aside first "
        f"(e.g. INSERT INTO an archive table SELECT * FROM {table} WHERE topic = "
        f"'{r.topic}' AND partition = {r.partition} AND _offsetflow_batch_id IN "
        f"({', '.join(map(str, shown))}), then DELETE them), and run the batch again")


def delete_window_dead_letters(cur: psycopg2.extensions.cursor, batch: Batch, table: str,
                               incarnations: Sequence[RangeIncarnation] | None = None
                               ) -> None:
    """A replay/backfill replaces the dead letters its window produced before: the
    pipeline's, at the window's coordinates, of the window's incarnation only."""
    lin = sql.Identifier(LINEAGE_COLUMN)
    where = sql.SQL("pipeline = %s AND topic = %s AND partition = %s AND \"offset\" >= %s "
                    "AND \"offset\" < %s")
    for r in incarnations if incarnations is not None else window_incarnations(cur, batch):
        args: tuple[object, ...] = (batch.pipeline, r.topic, r.partition, r.from_offset,
                                    r.until_offset)
        if r.mine is None:
            cur.execute(sql.SQL("DELETE FROM {} WHERE {}").format(qualified(table), where),
                        args)
            continue
        cur.execute(sql.SQL("SELECT count(*), array_agg(DISTINCT {lin}) FROM {t} WHERE {w} "
                            "AND ({lin} IS NULL OR NOT {lin} = ANY(%s))").format(
                                lin=lin, t=qualified(table), w=where), (*args, list(r.known)))
        row = cur.fetchone()
        if row and row[0]:
            raise unknown_rows_error(batch, r, f"the dead-letter table {table}", int(row[0]),
                                     list(row[1] or []))
        cur.execute(sql.SQL("DELETE FROM {t} WHERE {w} AND {lin} = ANY(%s)").format(
            t=qualified(table), w=where, lin=lin), (*args, list(r.mine)))
