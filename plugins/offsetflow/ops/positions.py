"""Operator override of committed positions (`offsetflow reset-position`).

The way out of a recreated topic or a deliberate skip: positions move here only when no
batch of the pipeline is open, in one transaction with their history and the current Kafka
topic id (so planning accepts them), and never under rows that would collide with what the
pipeline reads next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.errors import BatchStateError, PositionResetError
from offsetflow.ledger import OPEN_STATUSES, Ledger, qualified


def reset_positions(ledger: Ledger, pipeline: str, topic: str, partitions: Sequence[int],
                    next_offset: int, reason: str, *, topic_id: str | None,
                    target_table: str | None = None, archive_to: str | None = None,
                    dead_letter_table: str | None = None,
                    live_topic: str | None = None,
                    check_sink: Callable[[], None] | None = None) -> int:
    """Operator override of positions (e.g. after a topic was recreated), in one
    transaction. `topic_id`: the topic's current Kafka id, recorded with the positions
    so planning accepts them. Rows of `target_table` (and the pipeline's dead letters in
    `dead_letter_table`) at or beyond the new position of a partition would collide with
    (or be written again by) the records read from there: they are refused, or moved to
    `archive_to` (dead letters to `archive_to`_dead_letter) in the same transaction.
    `live_topic`: the Kafka topic a Kafka sink writes, which holds the records below a
    position: moving it back (same topic incarnation) is refused. `check_sink`: an external
    sink's own refusal (it raises), run under the pipeline lock. Returns the rows moved."""
    with ledger.transaction() as cur:
        ledger.lock_pipeline(cur, pipeline)
        open_batch = ledger.open_batch(cur, pipeline)
        if open_batch is not None:
            raise BatchStateError(
                f"pipeline {pipeline} has open batch {open_batch.batch_id} "
                f"({open_batch.status}); run it to its commit or abandon it (offsetflow "
                f"abandon --batch-id {open_batch.batch_id} --reason '...') before moving a "
                f"position")
        _refuse_open_batches_beyond(cur, pipeline, topic, partitions, next_offset)
        if live_topic is not None:
            _refuse_rewind_into_live_topic(cur, pipeline, topic, partitions, next_offset,
                                           topic_id, live_topic)
        if check_sink is not None:
            check_sink()
        moved = _clear_rows_beyond(cur, topic, partitions, next_offset, target_table,
                                   archive_to)
        moved += _clear_rows_beyond(cur, topic, partitions, next_offset, dead_letter_table,
                                    f"{archive_to}_dead_letter" if archive_to else None,
                                    pipeline=pipeline)
        for partition in sorted(set(partitions)):
            cur.execute("""SELECT next_offset FROM offsetflow.positions
                            WHERE pipeline=%s AND topic=%s AND partition=%s FOR UPDATE""",
                        (pipeline, topic, partition))
            row = cur.fetchone()
            cur.execute("""INSERT INTO offsetflow.positions (pipeline, topic, partition,
                                                            next_offset, topic_id,
                                                            updated_at)
                           VALUES (%s, %s, %s, %s, %s, now())
                           ON CONFLICT (pipeline, topic, partition)
                           DO UPDATE SET next_offset = EXCLUDED.next_offset,
                                         topic_id = EXCLUDED.topic_id, updated_at = now()""",
                        (pipeline, topic, partition, next_offset, topic_id))
            cur.execute("""INSERT INTO offsetflow.position_history
                             (pipeline, topic, partition, old_offset, new_offset, reason)
                           VALUES (%s, %s, %s, %s, %s, %s)""",
                        (pipeline, topic, partition, row[0] if row else None, next_offset,
                         f"manual: {reason}" + (f" (topic id {topic_id})" if topic_id
                                                else "")))
    return moved

def _refuse_rewind_into_live_topic(cur: psycopg2.extensions.cursor, pipeline: str,
                                   topic: str, partitions: Sequence[int], next_offset: int,
                                   topic_id: str | None, live_topic: str) -> None:
    """A Kafka sink's output cannot be moved aside like a table's rows: records read again
    from a position moved back would be in the live topic twice. A recreated source topic
    (another id than the one recorded) has new records at those offsets: allowed."""
    cur.execute("""SELECT partition, next_offset, topic_id FROM offsetflow.positions
                    WHERE pipeline = %s AND topic = %s AND partition = ANY(%s)
                      AND next_offset > %s ORDER BY partition""",
                (pipeline, topic, list(partitions), next_offset))
    same = [(p, o) for p, o, tid in cur.fetchall()
            if tid is None or topic_id is None or tid == topic_id]
    if same:
        part, at = same[0]
        more = f" (and {len(same) - 1} more partition(s))" if len(same) > 1 else ""
        raise BatchStateError(
            f"pipeline {pipeline} has written {topic}[{part}] up to offset {at}{more} to its "
            f"live Kafka topic {live_topic}; moving the position back to {next_offset} would "
            f"write offsets [{next_offset}, {at}) there a second time (Kafka cannot delete "
            f"records). Nothing was changed. Re-read them with a replay into "
            f"sink.replay_topic (offsetflow replay), or pass --allow-duplicates if consumers "
            f"of {live_topic} should get them again")


def _refuse_open_batches_beyond(cur: psycopg2.extensions.cursor, pipeline: str, topic: str,
                                partitions: Sequence[int], next_offset: int) -> None:
    """An open backfill or replay of these partitions reaching past the new position was
    accepted against the old one: committed after the reset, its rows collide with the
    live batches that read those offsets again."""
    cur.execute("""SELECT b.batch_id, b.kind, b.status, br.partition, br.from_offset,
                          br.until_offset
                     FROM offsetflow.batches b JOIN offsetflow.batch_ranges br USING (batch_id)
                    WHERE b.pipeline = %s AND b.status = ANY(%s) AND br.topic = %s
                      AND br.partition = ANY(%s) AND br.until_offset > %s
                    ORDER BY b.batch_id, br.partition""",
                (pipeline, list(OPEN_STATUSES), topic, list(partitions), next_offset))
    found = cur.fetchall()
    if found:
        b, kind, status, part, lo, hi = found[0]
        more = f" (and {len(found) - 1} more range(s))" if len(found) > 1 else ""
        raise BatchStateError(
            f"pipeline {pipeline} has open batch {b} ({kind}, {status}) reading "
            f"{topic}[{part}] [{lo}, {hi}){more}, past the new position {next_offset}; "
            f"committed after the reset, its rows would collide with the records read "
            f"again from there. Nothing was changed. Let it commit first, or abandon it "
            f"(offsetflow abandon --batch-id {b} --reason '...')")


def _clear_rows_beyond(cur: psycopg2.extensions.cursor, topic: str,
                       partitions: Sequence[int], next_offset: int,
                       target_table: str | None, archive_to: str | None,
                       pipeline: str | None = None) -> int:
    """`pipeline`: the table is a dead-letter table, shared by pipelines: only that
    pipeline's rows count."""
    if target_table is None:
        return 0
    # the quoted name: to_regclass folds an unquoted one to lower case (Orders -> orders)
    cur.execute(sql.SQL("SELECT to_regclass(%s)"), (qualified(target_table).as_string(cur),))
    row = cur.fetchone()
    if row is None or row[0] is None:
        return 0
    where: sql.Composable = sql.SQL("topic = %s AND partition = ANY(%s) AND \"offset\" >= %s")
    args: tuple[object, ...] = (topic, list(partitions), next_offset)
    if pipeline is not None:
        where = sql.SQL("pipeline = %s AND ") + where
        args = (pipeline, *args)
    what = "dead letters" if pipeline is not None else "rows"
    cur.execute(sql.SQL("SELECT partition, count(*) FROM {} WHERE {} GROUP BY 1 ORDER BY 1")
                .format(qualified(target_table), where), args)
    found = {int(p): int(n) for p, n in cur.fetchall()}
    if not found:
        return 0
    if archive_to is None:
        raise PositionResetError(
            f"{target_table} holds {sum(found.values())} {what} of {topic} at offsets >= "
            f"{next_offset} (partition(s) {sorted(found)}), written before the reset (from "
            f"the topic's earlier incarnation if it was recreated); the records read from "
            f"offset {next_offset} on would collide with them"
            f"{' (or be dead-lettered again)' if pipeline else ''}. Nothing was changed. "
            f"Give --archive-to TABLE to move these {what} "
            f"{'to TABLE_dead_letter' if pipeline else 'there'} in the same transaction, "
            f"or choose another offset")
    schema = archive_to.split(".")[0] if "." in archive_to else "public"
    cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS)")
                .format(qualified(archive_to), qualified(target_table)))
    cur.execute(sql.SQL("WITH moved AS (DELETE FROM {t} WHERE {w} RETURNING *) "
                        "INSERT INTO {a} SELECT * FROM moved").format(
                            t=qualified(target_table), w=where, a=qualified(archive_to)),
                args)
    return int(cur.rowcount)
