"""Tables the sink writes: the target (created if missing, else checked), the dead-letter
table, and a batch's stage tables. DDL only; see `staging` and `commit` for the data."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence

import psycopg2.errors
import psycopg2.extensions
from psycopg2 import sql

from offsetflow.errors import SchemaMismatchError
from offsetflow.ledger import (
    connect,
    dead_letter_stage_table,
    qualified,
    stage_part_table,
    stage_table,
)

LINEAGE_COLUMN = "_offsetflow_batch_id"
# upsert targets: the Kafka topic id of the incarnation a row's record came from, so a topic
# deleted and recreated (offsets from 0 again) orders after the old one (offsetflow.commit.upsert)
TOPIC_ID_COLUMN = "_offsetflow_topic_id"
COORDINATES = ("topic", "partition", "offset")
# the coordinates' index compares integers first: inserting a 1M-row batch into the unique
# index costs ~15-30% less than with the topic text first (measured; same uniqueness)
COORDINATE_INDEX_ORDER = ("partition", "offset", "topic")

DEAD_LETTER_COLUMNS: list[tuple[str, str]] = [
    ("pipeline", "text"), ("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
    ("timestamp", "timestamptz"), ("key", "bytea"), ("value", "bytea"), ("error", "text"),
    ("stage", "text"),
]

_SIMPLE_TYPES = {
    "string": "text", "bigint": "bigint", "int": "integer", "smallint": "smallint",
    "tinyint": "smallint", "double": "double precision", "float": "real",
    "boolean": "boolean", "timestamp": "timestamptz", "timestamp_ntz": "timestamp",
    "date": "date", "binary": "bytea", "void": "text",
}
_DECIMAL = re.compile(r"^decimal\((\d+),(\d+)\)$")


def canonical_table(table: str) -> str:
    """`schema.table` for a validated sink table name: `orders` and `public.orders` are the
    same table (as `qualified` quotes them) and must be one key in the ledger."""
    return table if "." in table else f"public.{table}"


def pg_type(spark_type: str) -> str:
    """PostgreSQL column type for a Spark `simpleString()` type; nested types are jsonb."""
    t = spark_type.strip().lower()
    if t in _SIMPLE_TYPES:
        return _SIMPLE_TYPES[t]
    m = _DECIMAL.match(t)
    if m:
        return f"numeric({m.group(1)},{m.group(2)})"
    if t.startswith(("array<", "struct<", "map<")):
        return "jsonb"
    raise SchemaMismatchError(f"no PostgreSQL type for Spark type {spark_type!r}")




def index_name(table: str, suffix: str) -> str:
    """`{table}_{suffix}`, unique per table and within PostgreSQL's 63 bytes: a long name is
    cut and a hash of the whole qualified name added, so two long names that share their
    first 63 bytes never share an index name (IF NOT EXISTS would skip the second guard)."""
    base = table.split(".")[-1]
    name = f"{base}_{suffix}"
    if len(name.encode()) <= 63:
        return name
    digest = hashlib.sha1(table.encode()).hexdigest()[:10]
    keep = 63 - len(suffix) - len(digest) - 2
    cut = base.encode()[:keep].decode(errors="ignore")
    return f"{cut}_{digest}_{suffix}"


def unique_indexes(cur: psycopg2.extensions.cursor, table: str) -> list[tuple[str, ...]]:
    """The column lists of the table's unique (non-partial, plain-column) indexes."""
    cur.execute("""SELECT array_agg(a.attname ORDER BY k.ord)
                     FROM pg_index i
                     JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord) ON true
                     JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                    WHERE i.indrelid = %s::regclass AND i.indisunique AND i.indisvalid
                      AND i.indpred IS NULL
                    GROUP BY i.indexrelid""", (qualified(table).as_string(cur),))
    return [tuple(r[0]) for r in cur.fetchall()]


def _ensure_guard(cur: psycopg2.extensions.cursor, table: str, mode: str,
                  key: Sequence[str]) -> None:
    """The index that makes the sink idempotent, checked by definition on an existing
    target (not by name): append needs one unique on the coordinates, upsert one unique on
    the key (its ON CONFLICT target). Created if missing; a table whose rows break it is a
    clear error."""
    want = tuple(key) if mode == "upsert" else COORDINATE_INDEX_ORDER
    if any(set(cols) == set(want) and len(cols) == len(want)
           for cols in unique_indexes(cur, table)):
        return
    name = index_name(table, "key_uq" if mode == "upsert" else "coords_uq")
    try:
        cur.execute("SAVEPOINT offsetflow_guard")
        cur.execute(sql.SQL("CREATE UNIQUE INDEX {} ON {} ({})").format(
            sql.Identifier(name), qualified(table),
            sql.SQL(", ").join(sql.Identifier(c) for c in want)))
        cur.execute("RELEASE SAVEPOINT offsetflow_guard")
    except (psycopg2.errors.UniqueViolation, psycopg2.errors.DuplicateTable) as e:
        cur.execute("ROLLBACK TO SAVEPOINT offsetflow_guard")
        raise SchemaMismatchError(
            f"target table {table} has no unique index on ({', '.join(want)}) and one cannot "
            f"be created ({str(e).strip().splitlines()[0]}); without it a record could be "
            f"written twice. Deduplicate the table or point sink.table at a new one") from e


def existing_columns(cur: psycopg2.extensions.cursor, table: str) -> dict[str, str]:
    schema, name = (table.split(".") + [""])[:2] if "." in table else ("public", table)
    cur.execute("""SELECT column_name, data_type FROM information_schema.columns
                    WHERE table_schema = %s AND table_name = %s""", (schema, name))
    return {c: t for c, t in cur.fetchall()}


def _ddl_lock(cur: psycopg2.extensions.cursor) -> None:
    """Serialises this project's CREATE ... IF NOT EXISTS until the transaction ends: two runs
    of one batch at once (an Airflow retry beside a zombie) race on it otherwise, and
    PostgreSQL reports the loser as a pg_type unique violation."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtext('offsetflow:ddl'))")


# a column PostgreSQL can widen in place for `format.schema_evolution` (int -> long, ...):
# every value of the old type fits the new one
_WIDENS = {("integer", "bigint"), ("integer", "double precision"),
           ("bigint", "double precision"), ("real", "double precision")}
_CANONICAL = {"timestamptz": "timestamp with time zone", "timestamp": "timestamp without "
              "time zone", "int": "integer", "float8": "double precision", "float4": "real"}


def canonical_pg_type(t: str) -> str:
    """A column type as PostgreSQL's format_type() names it (numeric(10,2), text, ...)."""
    t = t.strip().lower()
    return _CANONICAL.get(t, t)


def target_column_types(cur: psycopg2.extensions.cursor, table: str) -> dict[str, str]:
    """column -> its type as format_type() names it; {} when the table does not exist."""
    cur.execute("SELECT to_regclass(%s)", (qualified(table).as_string(cur),))
    row = cur.fetchone()
    if not row or row[0] is None:
        return {}
    cur.execute("""SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute
                    WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped""",
                (qualified(table).as_string(cur),))
    return {str(n): str(t) for n, t in cur.fetchall()}


def pending_columns(table: str, have: dict[str, str], columns: Sequence[tuple[str, str]]
                    ) -> list[tuple[str, str, str]]:
    """What the target lacks of the evolved `columns` (name, PostgreSQL type): (name, type,
    `add` | `widen`). A column that exists with a type it cannot widen in place (added by
    hand, or by an earlier schema with another type) is SchemaMismatchError."""
    out = []
    for name, t in columns:
        want = canonical_pg_type(t)
        got = have.get(name)
        if got is None:
            out.append((name, t, "add"))
        elif got != want:
            if (got, want) in _WIDENS:
                out.append((name, t, "widen"))
            elif (want, got) not in _WIDENS:  # already wider: the values fit
                raise SchemaMismatchError(
                    f"target table {table} has column {name!r} of type {got}, but the "
                    f"reader schema's field {name!r} needs {want} (format.schema_evolution "
                    f"cannot change it in place); rename or drop the column, or declare "
                    f"{name} in format.schema with a type that fits {got}")
    return out


def evolve_target(cur: psycopg2.extensions.cursor, table: str,
                  columns: Sequence[tuple[str, str]],
                  defaults: Mapping[str, object] | None = None) -> list[str]:
    """In the commit's transaction: add the evolved `columns` the target lacks (ALTER TABLE
    ... ADD COLUMN, nullable: a catalog-only change) and widen those of a narrower type
    (ALTER COLUMN ... TYPE), so they become visible with the batch's rows and positions or
    not at all. Identifiers are quoted; the types come from the Avro type mapping only.
    Checked again after the DDL: a run that added the column first (its lock waited for)
    or a hand-made column of another type is caught here, before a row moves. `defaults`:
    the value the rows already there take in an added column (the reader schema's default,
    as a record of an older writer gets it; ADD ... DEFAULT then DROP DEFAULT keeps it for
    them only, catalog-only), so they hold what a replay of their window writes. Returns
    what changed, in words."""
    have = target_column_types(cur, table)
    if not have:
        raise SchemaMismatchError(f"target table {table} does not exist at the commit (it "
                                  f"was dropped while the batch ran); run the batch again")
    if not pending_columns(table, have, columns):
        return []  # the usual case: no lock beyond the rows' own
    # the lock ALTER takes anyway, first: a commit that added them meanwhile (its lock
    # waited for here) is seen by the next statement, so nothing is altered twice
    cur.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(qualified(table)))
    have = target_column_types(cur, table)
    done = []
    for name, t, how in pending_columns(table, have, columns):
        if how == "add" and defaults and defaults.get(name) is not None:
            cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {} DEFAULT {}")
                        .format(qualified(table), sql.Identifier(name), sql.SQL(t),
                                sql.Literal(defaults[name])))
            cur.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP DEFAULT").format(
                qualified(table), sql.Identifier(name)))
        elif how == "add":
            cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                qualified(table), sql.Identifier(name), sql.SQL(t)))
        else:
            cur.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
                qualified(table), sql.Identifier(name), sql.SQL(t)))
        done.append(f"{how} {name} {t}")
    if done:
        left = pending_columns(table, target_column_types(cur, table), columns)
        if left:
            raise SchemaMismatchError(f"target table {table}: columns {left} still differ "
                                      f"after the schema evolution's DDL; run the batch again")
    return done


def ensure_target(cur: psycopg2.extensions.cursor, table: str, columns: Sequence[tuple[str, str]],
                  mode: str, key: Sequence[str], evolved: Sequence[str] = ()) -> bool:
    """Create the target if missing (with lineage column and indexes) or check it fits.
    `evolved`: columns of `columns` that `format.schema_evolution` adds, which an existing
    target may lack (the commit adds them, `evolve_target`). Returns whether the commit
    has DDL to do (an evolved column missing or narrower)."""
    _ddl_lock(cur)
    schema = table.split(".")[0] if "." in table else "public"
    cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    have = existing_columns(cur, table)
    if not have:
        cols: list[sql.Composable] = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                                      for c, t in columns]
        cols.append(sql.SQL("{} bigint NOT NULL").format(sql.Identifier(LINEAGE_COLUMN)))
        if mode == "upsert":
            cols.append(sql.SQL("{} text").format(sql.Identifier(TOPIC_ID_COLUMN)))
        cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            qualified(table), sql.SQL(", ").join(cols)))
        coords = sql.SQL(", ").join(sql.Identifier(c) for c in COORDINATE_INDEX_ORDER)
        if mode == "upsert":
            cur.execute(sql.SQL("CREATE INDEX {} ON {} ({})").format(
                sql.Identifier(index_name(table, "coords_idx")), qualified(table), coords))
        # append: one source record -> at most one row, a second copy cannot be inserted
        _ensure_guard(cur, table, mode, key)
        return False
    pending = pending_columns(table, target_column_types(cur, table),
                              [c for c in columns if c[0] in set(evolved)])
    missing = [c for c, _ in columns if c not in have and c not in set(evolved)]
    if LINEAGE_COLUMN not in have:
        missing.append(LINEAGE_COLUMN)
    if missing:
        raise SchemaMismatchError(
            f"target table {table} exists but lacks column(s) {missing}; add them or "
            f"point sink.table at a new table")
    if mode == "upsert" and TOPIC_ID_COLUMN not in have:
        # an upsert target of an earlier version: nullable, so a catalog-only change; its
        # rows compare by offset alone until rewritten
        cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} text").format(
            qualified(table), sql.Identifier(TOPIC_ID_COLUMN)))
    _ensure_guard(cur, table, mode, key)
    return bool(pending)


def ensure_dead_letter(cur: psycopg2.extensions.cursor, table: str) -> None:
    _ddl_lock(cur)
    schema = table.split(".")[0] if "." in table else "public"
    cur.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
    cols: list[sql.Composable] = [sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                                  for c, t in DEAD_LETTER_COLUMNS]
    cols.append(sql.SQL("{} bigint NOT NULL").format(sql.Identifier(LINEAGE_COLUMN)))
    cols.append(sql.SQL("recorded_at timestamptz NOT NULL DEFAULT now()"))
    cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
        qualified(table), sql.SQL(", ").join(cols)))
    cur.execute(sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (pipeline, topic, partition, "
                        "\"offset\")").format(sql.Identifier(index_name(table, "coords_idx")),
                                              qualified(table)))


def create_stage_tables(dsn: str, batch_id: int, columns: Sequence[tuple[str, str]],
                        parts: int = 0) -> None:
    """Stage tables are UNLOGGED: they are rebuilt from Kafka if lost, and WAL is costly.
    With `parts`, one child table per Spark part too (see `PartwiseCommit`); created here,
    before any task runs, so tasks never take DDL locks next to a running commit."""
    conn = connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            _ddl_lock(cur)
            cur.execute("CREATE SCHEMA IF NOT EXISTS offsetflow_stage")
            cols = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                                      for c, t in columns)
            cur.execute(sql.SQL("CREATE UNLOGGED TABLE IF NOT EXISTS {} ({})").format(
                stage_table(batch_id), cols))
            for part in range(parts):
                cur.execute(sql.SQL("CREATE UNLOGGED TABLE IF NOT EXISTS {} () INHERITS ({})")
                            .format(stage_part_table(batch_id, part), stage_table(batch_id)))
            dl = sql.SQL(", ").join(sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                                    for c, t in DEAD_LETTER_COLUMNS)
            cur.execute(sql.SQL("CREATE UNLOGGED TABLE IF NOT EXISTS {} ({})").format(
                dead_letter_stage_table(batch_id), dl))
    finally:
        conn.close()

