"""Dropping staged data so the next attempt stages it again from Kafka (after a commit
refused a stage that lost rows or parts of another layout, and at the start of every
transform run, whose part numbers may mean other rows than an earlier attempt's), and the
stage generation that tells a run's parts from a zombie's."""

from __future__ import annotations

import logging

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.errors import (
    BatchStateError,
    StagedRowsLostError,
    StaleConfigError,
    StaleStageError,
)
from offsetflow.ledger import (
    OPEN_STATUSES,
    Batch,
    Ledger,
    connect,
    dead_letter_stage_table,
    drop_committed_task_files,
    drop_named_task_files,
    lock_timeout_s,
    stage_part_table,
    stage_table,
)
from offsetflow.ranges import split_ranges
from offsetflow.stage.layout import Layout, Marker, foreign_markers
from offsetflow.stage.packing import Packing, pack

log = logging.getLogger(__name__)


def forget_parts(dsn: str, batch_id: int, parts: list[int] | None,
                 generation: int | None = None) -> None:
    """After a refused commit rolled back: drop the named parts' markers and rows (None:
    the whole stage, bad records included), so the next attempt's tasks stage them again
    from Kafka. A batch with bad records is always dropped whole: the fused path's dead
    letters are not kept per part, and a re-staged part would write its own again.

    This runs after the rollback, so a newer run may have rebuilt the stage meanwhile:
    under the batch lock, nothing is dropped if the stage is no longer of `generation` (the
    refused commit's; its parts are gone, and the numbers now name the newer run's), nor
    while another run's commit holds the lock (it checks every marker itself). The stage is
    emptied before its markers are deleted, so a marker a task commits while the TRUNCATE
    waits for it goes too, never outliving its rows. Only tables that exist are emptied (a
    zombie's part numbered beyond this layout has a marker but no table), and the markers
    go regardless: a marker that outlived its drop would be refused on every run. Every
    lock waits at most the commit's `lock_timeout`."""
    conn = connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT set_config('lock_timeout', %s, true)",
                        (f"{int(lock_timeout_s() * 1000)}ms",))
            cur.execute("SELECT stage_generation FROM offsetflow.batches WHERE batch_id = %s "
                        "FOR UPDATE SKIP LOCKED", (batch_id,))
            row = cur.fetchone()
            if row is None or (generation is not None and int(row[0]) != generation):
                log.warning("batch %d: the refused part(s) %s were not dropped: %s", batch_id,
                            "all" if parts is None else parts,
                            "another run holds the batch, and its commit refuses them in "
                            "turn" if row is None else "another run rebuilt the stage since")
                return
            if parts is not None:
                cur.execute("SELECT EXISTS (SELECT 1 FROM offsetflow.staged_parts "
                            "WHERE batch_id = %s AND kind = 'bad')", (batch_id,))
                found = cur.fetchone()
                if found and found[0]:
                    parts = None
            tables = [stage_table(batch_id), dead_letter_stage_table(batch_id)] \
                if parts is None else [stage_part_table(batch_id, p) for p in parts]
            existing = [t for t in tables if table_exists(cur, t)]
            if existing:
                cur.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(existing)))
            drop_named_task_files(cur, batch_id, parts)  # a Kafka sink's, with the markers
            if parts is None:
                cur.execute("DELETE FROM offsetflow.staged_parts WHERE batch_id = %s",
                            (batch_id,))
            else:
                cur.execute("DELETE FROM offsetflow.staged_parts WHERE batch_id = %s "
                            "AND kind = 'rows' AND part = ANY(%s)", (batch_id, parts))
        drop_committed_task_files(conn)  # the markers' deletion committed: now their files
    finally:
        conn.close()
    log.warning("batch %d: staged part(s) %s had lost rows or were of another layout and "
                "were dropped; the next run re-stages them", batch_id,
                "all" if parts is None else parts)


def table_exists(cur: psycopg2.extensions.cursor, table: sql.Composed) -> bool:
    """Whether `table` (a quoted name) exists, in `cur`'s view."""
    cur.execute("SELECT to_regclass(%s) IS NOT NULL", (table.as_string(cur),))
    row = cur.fetchone()
    return bool(row and row[0])


def stage_generation(ledger: Ledger, batch: Batch, split_offsets: int,
                     restart: bool = False) -> int:
    """The stage generation a run stages under, claimed in one transaction under the batch
    lock together with the config and split this run checked (`batch`, as `mark_running`
    returned or `adopt_config` made it; a batch planned before the split was recorded takes
    the run's). If another run adopted another config or split since, this run is stale and
    stages nothing: otherwise it would stage its old config's output under the adopted
    generation, and the newer run would skip those parts and commit them.

    With `restart` (every transform-path run), the same transaction, after those checks,
    drops what earlier attempts staged and starts a new generation, and the run stages
    under exactly that one: its parts are Spark's partitions of the transform's output, and
    which rows a partition gets depends on more than any key can record (AQE coalescing
    follows the core count and the data's size), so neither an earlier attempt's parts nor
    a concurrent run's generation may be taken for this run's."""
    with ledger.transaction() as cur:
        cur.execute("SELECT config_fingerprint, split_offsets, stage_generation, status "
                    "FROM offsetflow.batches WHERE batch_id = %s FOR UPDATE",
                    (batch.batch_id,))
        row = cur.fetchone()
        assert row is not None
        fingerprint, split, generation, status = row
        if status not in OPEN_STATUSES:  # committed or abandoned by another run meanwhile
            raise BatchStateError(f"batch {batch.batch_id} was {status} by another run while "
                                  f"this one started; this run stages nothing")
        if fingerprint != batch.config_fingerprint:
            raise StaleConfigError(
                f"batch {batch.batch_id}: another run took a changed pipeline config while "
                f"this run started with the one it was planned with; this run's config is "
                f"stale, so it stages nothing. Re-run the batch with the current pipeline "
                f"config")
        if split is not None and int(split) != split_offsets:
            raise StaleConfigError(
                f"batch {batch.batch_id}: another run changed its split to {split} offsets "
                f"per task while this run starts with {split_offsets}; this run's config is "
                f"stale, so it stages nothing. Re-run the batch with the current pipeline "
                f"config")
        if split is None:
            cur.execute("UPDATE offsetflow.batches SET split_offsets = %s WHERE batch_id = %s",
                        (split_offsets, batch.batch_id))
        if restart:
            cur.execute("SELECT EXISTS (SELECT 1 FROM offsetflow.staged_parts "
                        "WHERE batch_id = %s)", (batch.batch_id,))
            found = cur.fetchone()
            if found and found[0]:
                log.warning("batch %d: staged data of an earlier attempt of this transform "
                            "pipeline is dropped; the ranges are read again", batch.batch_id)
            generation = ledger.drop_staging(cur, batch.batch_id)
    return int(generation)


def claim_pack_tasks(ledger: Ledger, batch_id: int, tasks: int) -> int:
    """The task count the batch is packed into (`offsetflow.stage.packing`): `tasks` on its first
    run, the recorded one ever after, so every attempt (on another core count too, and a
    zombie) draws the same parts."""
    with ledger.transaction() as cur:
        cur.execute("UPDATE offsetflow.batches SET pack_tasks = COALESCE(pack_tasks, %s) "
                    "WHERE batch_id = %s RETURNING pack_tasks", (tasks, batch_id))
        row = cur.fetchone()
    assert row is not None, f"batch {batch_id} is not in the ledger"
    return int(row[0])


def packing_of(batch: Batch, pack_tasks: int | None) -> Packing:
    """The fused path's parts: the batch's split, packed as recorded."""
    return pack(split_ranges(batch.ranges, batch.split_offsets), pack_tasks,
                batch.split_offsets)


def layout_of(cur: psycopg2.extensions.cursor, batch: Batch, generation: int | None,
              subrange_parts: bool) -> tuple[int, Packing | None]:
    """In the commit, under the batch lock: the stage generation and (fused path) the
    packing of sub-ranges its parts stand for. A run whose own generation is not the
    batch's is a zombie: StaleStageError, and it drops nothing."""
    cur.execute("SELECT stage_generation, pack_tasks FROM offsetflow.batches "
                "WHERE batch_id = %s", (batch.batch_id,))
    row = cur.fetchone()
    assert row is not None
    current = int(row[0])
    if generation is not None and generation != current:
        raise StaleStageError(batch.batch_id, generation, current)
    packing = packing_of(batch, None if row[1] is None else int(row[1])) \
        if subrange_parts and batch.split_offsets else None
    return current, packing


def check_markers(batch_id: int, markers: list[Marker], generation: int,
                  split: Layout) -> None:
    """Refuse parts of another layout (`offsetflow.stage.layout`) as lost: the commit rolls
    back and they are dropped, so the next run stages them again under this layout."""
    foreign = foreign_markers(markers, generation, split)
    if not foreign:
        return
    whole = split is None or any(m.kind != "rows" for m, _ in foreign)
    raise StagedRowsLostError(batch_id, None if whole else sorted({m.part for m, _ in foreign}),
                              f"{len(foreign)} staged part(s) are not of the batch's current "
                              f"stage layout: {foreign[0][1]}")


def lock_stage(cur: psycopg2.extensions.cursor, batch_id: int) -> None:
    """Step 2, before the checks: hold the stage (its parts too) and its dead letters in
    SHARE mode until COMMIT (within the commit's `lock_timeout`), so a late writer (a
    zombie task) either committed before the checks, which see its rows, or waits until
    the commit has dropped the stage; rows landing after the checks are never applied."""
    existing = [t for t in (stage_table(batch_id), dead_letter_stage_table(batch_id))
                if table_exists(cur, t)]
    if existing:
        cur.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(
            sql.SQL(", ").join(existing)))


def check_layout(cur: psycopg2.extensions.cursor, batch: Batch, generation: int | None,
                 subrange_parts: bool) -> None:
    """Step 2's first check: every marker of the batch is of its current layout."""
    current, split = layout_of(cur, batch, generation, subrange_parts)
    cur.execute("""SELECT kind, part, generation, per_partition, subranges
                     FROM offsetflow.staged_parts WHERE batch_id = %s""", (batch.batch_id,))
    check_markers(batch.batch_id, [Marker(k, int(p), g, pp, sr)
                                   for k, p, g, pp, sr in cur.fetchall()], current, split)
