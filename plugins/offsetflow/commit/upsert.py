"""Step 4 of the commit in upsert mode: the stage's records applied to the target by key.

The rule (docs/sinks/postgresql.md, "Upsert"): Kafka orders records within a partition by offset, so
  - within one partition the record with the highest offset wins, whatever its timestamp;
  - a target row is replaced (or deleted by a tombstone) only by a record at the same or a
    later offset of the same topic-partition: a replay or backfill of an old window never
    moves a key backwards, and re-applying the same record is a no-op; a later incarnation
    of the topic (deleted and recreated: offsets from 0 again) always wins over an older one;
  - a key in several partitions (a producer that does not partition by key, or partitions
    added since) is ordered across partitions by ONE strict total order, used within a
    batch, across batches and against deleted keys alike, so a replay never flips it:
    (timestamp with NULL lowest, topic, partition); without a `timestamp` column (a
    transform dropped it) (topic, partition).
Rows whose key columns are NULL, and tombstones under `tombstones: dead_letter`, go to the
dead-letter table in this same transaction. A tombstone (`value IS NULL`) under `delete`
removes its key's row by the same rule and is remembered in `offsetflow.deleted_keys` with its
coordinates: a deleted key leaves no row to compare with, so without that memory a replay of
an older window would bring the key back.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg2.extensions
from psycopg2 import sql

from offsetflow.commit.dead_letters import dead_letters_from
from offsetflow.commit.tables import LINEAGE_COLUMN, TOPIC_ID_COLUMN, canonical_table
from offsetflow.ledger import Batch, qualified

WINNERS = sql.Identifier("offsetflow_winners")


def newer_or_same(new: str, old: str, has_timestamp: bool) -> sql.Composable:
    """SQL: record `new` may replace row `old` (aliases), by the module's rule.

    Same topic-partition: a later topic incarnation always wins (`offsetflow.topic_epoch`
    orders topic ids); within one incarnation, or when either id is unknown, the offset
    (`>=`: re-applying the same record is a no-op). Across partitions one strict total order,
    the same as within a batch (`order_across`): (timestamp, NULL first; topic; partition)."""
    n, o = sql.Identifier(new), sql.Identifier(old)
    tid = sql.Identifier(TOPIC_ID_COLUMN)
    return sql.SQL(
        "(CASE WHEN {n}.topic = {o}.topic AND {n}.partition = {o}.partition THEN "
        "COALESCE(CASE WHEN {n}.{tid} <> {o}.{tid} THEN offsetflow.topic_epoch({n}.topic, "
        "{n}.{tid}) > offsetflow.topic_epoch({o}.topic, {o}.{tid}) END, "
        "{n}.\"offset\" >= {o}.\"offset\") "
        "ELSE {nk} > {ok} END)").format(
            n=n, o=o, tid=tid, nk=_across_key(new, has_timestamp),
            ok=_across_key(old, has_timestamp))


def _across_key(alias: str, has_timestamp: bool) -> sql.Composable:
    """The row compared across partitions; without a timestamp column, topic and partition
    alone (a fixed order rather than "the later commit", which a replay would flip)."""
    a = sql.Identifier(alias)
    ts = (sql.SQL("COALESCE({a}.\"timestamp\", '-infinity'::timestamptz), ").format(a=a)
          if has_timestamp else sql.SQL(""))
    return sql.SQL("ROW({ts}{a}.topic, {a}.partition)").format(ts=ts, a=a)


def order_across(has_timestamp: bool) -> sql.Composable:
    """ORDER BY terms, highest first, of the same order as `_across_key`."""
    ts = (sql.SQL("COALESCE(\"timestamp\", '-infinity'::timestamptz) DESC, ")
          if has_timestamp else sql.SQL(""))
    return sql.SQL("{ts}topic DESC, partition DESC").format(ts=ts)


def apply_upsert(cur: psycopg2.extensions.cursor, batch: Batch, stage: sql.Composable,
                 columns: Sequence[str], key: Sequence[str], tombstones: str,
                 dead_letter_table: str) -> tuple[int, int, int]:
    """Returns (rows inserted or updated, rows deleted by tombstones, dead letters)."""
    keys = [sql.Identifier(k) for k in key]
    key_list = sql.SQL(", ").join(keys)
    has_value = "value" in columns
    has_ts = "timestamp" in columns
    dead = stage_winners(cur, batch, stage, columns, key, tombstones, dead_letter_table)
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    target = qualified(batch.target_table)
    deleted = 0
    live: sql.Composable = sql.SQL("true")
    if has_value and tombstones == "delete":
        match = sql.SQL(" AND ").join(sql.SQL("t.{k} = w.{k}").format(k=k) for k in keys)
        cur.execute(sql.SQL("DELETE FROM {t} t USING {w} w WHERE w.value IS NULL AND {m} "
                            "AND {rule}").format(t=target, w=WINNERS, m=match,
                                                 rule=newer_or_same("w", "t", has_ts)))
        deleted = int(cur.rowcount)
        memory = canonical_table(batch.target_table)
        remember_deletions(cur, batch, memory, key, has_ts)
        live = not_deleted("w", memory, key, has_ts)
    updates = sql.SQL(", ").join(
        sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c))
        for c in [*columns, LINEAGE_COLUMN, TOPIC_ID_COLUMN] if c not in key)
    cur.execute(sql.SQL(
        "INSERT INTO {t} AS t ({cols}, {lin}, {tid}) SELECT {wcols}, %s, w.{tid} FROM {w} w "
        "WHERE {live} ON CONFLICT ({k}) DO UPDATE SET {updates} WHERE {rule}").format(
            t=target, cols=cols, lin=sql.Identifier(LINEAGE_COLUMN),
            tid=sql.Identifier(TOPIC_ID_COLUMN), w=WINNERS, live=live,
            wcols=sql.SQL(", ").join(sql.SQL("w.{}").format(sql.Identifier(c))
                                     for c in columns),
            k=key_list, updates=updates, rule=newer_or_same("excluded", "t", has_ts)),
        (batch.batch_id,))
    return int(cur.rowcount), deleted, dead


def stage_winners(cur: psycopg2.extensions.cursor, batch: Batch, stage: sql.Composable,
                  columns: Sequence[str], key: Sequence[str], tombstones: str,
                  dead_letter_table: str) -> int:
    """The batch's winners by the rule, one per key, into the temp table WINNERS (the
    stage's columns and the topic id of the range each came from); rows without a key,
    and tombstones under `dead_letter`, go to the dead-letter table instead. Returns the
    dead letters written. Any sink applies WINNERS to its target by `newer_or_same`."""
    keys = [sql.Identifier(k) for k in key]
    key_list = sql.SQL(", ").join(keys)
    null_key = sql.SQL(" OR ").join(sql.SQL("s.{} IS NULL").format(k) for k in keys)
    src = sql.SQL("{} s").format(stage)
    dead = dead_letters_from(
        cur, batch, dead_letter_table, src, columns, null_key,
        sql.Literal(f"upsert key column(s) {', '.join(key)} NULL: no key to upsert on"),
        "upsert_key")
    keep = sql.SQL("NOT ({})").format(null_key)
    if "value" in columns and tombstones == "dead_letter":
        tomb = sql.SQL("({}) AND s.value IS NULL").format(keep)
        dead += dead_letters_from(
            cur, batch, dead_letter_table, src, columns, tomb,
            sql.Literal("tombstone (null value); the pipeline has tombstones: dead_letter"),
            "tombstone")
        keep = sql.SQL("({}) AND s.value IS NOT NULL").format(keep)
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in columns)
    # the last record of each key in each partition, then one of those per key, with the
    # topic id of the batch's range it came from
    cur.execute(sql.SQL("DROP TABLE IF EXISTS {w}").format(w=WINNERS))
    cur.execute(sql.SQL(
        "CREATE TEMP TABLE {w} ON COMMIT DROP AS SELECT last.*, br.topic_id AS {tid} FROM ("
        "SELECT DISTINCT ON ({k}) * FROM ("
        "SELECT DISTINCT ON ({k}, topic, partition) {cols} FROM {src} WHERE {keep} "
        "ORDER BY {k}, topic, partition, \"offset\" DESC) per_partition "
        "ORDER BY {k}, {across}) last LEFT JOIN offsetflow.batch_ranges br "
        "ON br.batch_id = %s AND br.topic = last.topic AND br.partition = last.partition"
        ).format(w=WINNERS, k=key_list, cols=cols, src=src, keep=keep,
                 across=order_across("timestamp" in columns),
                 tid=sql.Identifier(TOPIC_ID_COLUMN)),
        (batch.batch_id,))
    return dead


def not_deleted(alias: str, memory: str, key: Sequence[str], has_ts: bool) -> sql.Composable:
    """SQL: winner `alias` is no tombstone and not older than a deletion of its key that
    `offsetflow.deleted_keys` remembers for the target `memory` (its name there)."""
    keys = [sql.Identifier(k) for k in key]
    return sql.SQL("{a}.value IS NOT NULL AND NOT EXISTS (SELECT 1 FROM "
                   "offsetflow.deleted_keys d WHERE d.target_table = {tt} AND d.key = "
                   "{jk} AND NOT {rule})").format(
                       a=sql.Identifier(alias), tt=sql.Literal(memory),
                       jk=_json_key(alias, keys), rule=newer_or_same(alias, "d", has_ts))


def _json_key(alias: str, keys: Sequence[sql.Identifier]) -> sql.Composable:
    return sql.SQL("jsonb_build_array({})").format(sql.SQL(", ").join(
        sql.SQL("{}.{}").format(sql.Identifier(alias), k) for k in keys))


def remember_deletions(cur: psycopg2.extensions.cursor, batch: Batch, memory: str,
                       key: Sequence[str], has_ts: bool) -> None:
    """Each tombstone winner's coordinates, kept per key unless a later one is there, for
    the target `memory` names in `offsetflow.deleted_keys`."""
    keys = [sql.Identifier(k) for k in key]
    ts = sql.SQL("w.\"timestamp\"") if has_ts else sql.SQL("NULL::timestamptz")
    cur.execute(sql.SQL(
        "INSERT INTO offsetflow.deleted_keys AS d (target_table, key, topic, partition, "
        "\"offset\", \"timestamp\", {tid}, batch_id) SELECT %s, {jk}, w.topic, w.partition, "
        "w.\"offset\", {ts}, w.{tid}, %s FROM {w} w WHERE w.value IS NULL "
        "ON CONFLICT (target_table, key) DO UPDATE SET topic = EXCLUDED.topic, "
        "partition = EXCLUDED.partition, \"offset\" = EXCLUDED.\"offset\", "
        "\"timestamp\" = EXCLUDED.\"timestamp\", {tid} = EXCLUDED.{tid}, "
        "batch_id = EXCLUDED.batch_id WHERE {rule}").format(
            jk=_json_key("w", keys), ts=ts, w=WINNERS, tid=sql.Identifier(TOPIC_ID_COLUMN),
            rule=newer_or_same("excluded", "d", has_ts)),
        (memory, batch.batch_id))
