"""`format.schema_evolution: add_columns` for an Iceberg table: the evolved columns (the
reader schema's fields beyond format.schema) join the table in the SAME catalog commit as
the batch's snapshot (one pyiceberg transaction: the schema update, then the append).

Field ids are settled before the tasks write: the driver stages the schema update on a
transaction of the table as loaded (`evolved_metadata`), never commits it, and ships that
metadata to the tasks, which write their Parquet files with the new schema's field ids. The
commit makes the same update on the table as it loads it then (`evolve_schema`): pyiceberg
assigns new ids from the table's last column id, in the columns' order, so the same table
gives the same ids; the files' ids are checked against the committed schema's
(`check_files_schema`) and a file written for other ids (a column added by someone else
between the tasks and the commit) has its part written again. A kill anywhere leaves either
no change at all or the schema and the snapshot together (one metadata file), and the
retry's `find` sees the batch's snapshot.

Iceberg v2 has no default for rows already in the table: they read null in an added column
(the PostgreSQL sink fills the reader schema's default instead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from offsetflow.errors import SchemaEvolutionError, SchemaMismatchError, StagedRowsLostError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyiceberg.schema import Schema
    from pyiceberg.table import Table, Transaction
    from pyiceberg.table.metadata import TableMetadata
    from pyiceberg.types import IcebergType


def iceberg_type(pg_type: str) -> IcebergType:
    """The Iceberg type of a stage column (as `stage.arrow_type` writes it: JSON and uuid
    as their text)."""
    from pyiceberg import types as t

    if pg_type.startswith("numeric("):
        p, s = pg_type[len("numeric("):-1].split(",")
        return t.DecimalType(int(p), int(s))
    simple: dict[str, Any] = {
        "text": t.StringType(), "bigint": t.LongType(), "integer": t.IntegerType(),
        "smallint": t.IntegerType(), "double precision": t.DoubleType(),
        "real": t.FloatType(), "boolean": t.BooleanType(), "timestamptz": t.TimestamptzType(),
        "timestamp": t.TimestampType(), "date": t.DateType(), "bytea": t.BinaryType(),
        "jsonb": t.StringType(), "uuid": t.StringType()}
    return simple[pg_type]  # type: ignore[no-any-return]


def _promotes(have: IcebergType, want: IcebergType) -> bool:
    """Iceberg's in-place promotions: int -> long, float -> double, a decimal's
    precision raised at the same scale."""
    from pyiceberg import types as t

    if isinstance(have, t.IntegerType) and isinstance(want, t.LongType):
        return True
    if isinstance(have, t.FloatType) and isinstance(want, t.DoubleType):
        return True
    return (isinstance(have, t.DecimalType) and isinstance(want, t.DecimalType)
            and have.scale == want.scale and want.precision > have.precision)


def pending_changes(table_name: str, schema: Schema, columns: Sequence[tuple[str, str]]
                    ) -> list[tuple[str, IcebergType, str]]:
    """What the table lacks of the evolved `columns` (name, stage type): (name, Iceberg
    type, `add` | `widen`). A column there of a type it cannot be promoted to (and that is
    not wider already) is SchemaMismatchError, raised before anything is written."""
    out: list[tuple[str, IcebergType, str]] = []
    # Spark and Trino resolve Iceberg columns without case: two names that differ only in
    # case make the table ambiguous to them, so one is never added beside the other
    folded = {f.name.lower(): f.name for f in schema.fields}
    for name, pg in columns:
        want = iceberg_type(pg)
        try:
            have = schema.find_field(name).field_type
        except ValueError:
            clash = folded.get(name.lower())
            if clash is not None:
                raise SchemaMismatchError(
                    f"Iceberg table {table_name} has column {clash!r}, and the reader "
                    f"schema's field {name!r} differs from it only in case: adding it "
                    f"would make the table ambiguous to engines that resolve names "
                    f"without case (Spark, Trino). Nothing was written; rename the column "
                    f"{clash!r} by hand, or rename the field in a new schema version") from None
            folded[name.lower()] = name
            out.append((name, want, "add"))
            continue
        if have == want or _promotes(want, have):  # already it, or wider: the values fit
            continue
        if not _promotes(have, want):
            raise SchemaMismatchError(
                f"Iceberg table {table_name} has column {name!r} of type {have}, but the "
                f"reader schema's field {name!r} needs {want}, and Iceberg promotes a "
                f"column only int -> long, float -> double or a decimal to a higher "
                f"precision, so format.schema_evolution cannot change it in place. Nothing "
                f"was written; rename or drop the column by hand (the next batch adds it "
                f"with the new type); declaring {name} in format.schema as {have} works only "
                f"if every value of the new schema fits {have}")
        out.append((name, want, "widen"))
    return out


def refuse_on_branch(table_name: str, changes: Sequence[tuple[str, IcebergType, str]],
                     audit_id: int | None) -> None:
    """An audited window (`audit_id`) never changes the table's schema: an Iceberg schema
    is table-wide, so an update committed with the branch's snapshot would be main's
    current schema at once (the live pipeline would write with it, readers would see it
    before publish, and a discard would leave it). SchemaEvolutionError, before anything is
    written."""
    if audit_id is None or not changes:
        return
    what = ", ".join(f"{how} {name!r} {want}" for name, want, how in changes)
    raise SchemaEvolutionError(
        f"audit {audit_id}: the window's reader schema would change the schema of Iceberg "
        f"table {table_name} ({what}); an Iceberg schema is table-wide, so main and the "
        f"live pipeline would see the change before publish and keep it after a discard. "
        f"Nothing was written. Let the live pipeline add the columns first (its next batch "
        f"of the new schema), then run the audited window again; or discard the audit and "
        f"run the window without --audit")


def refuse_key_changes(table_name: str, changes: Sequence[tuple[str, IcebergType, str]],
                       key: Sequence[str]) -> None:
    """An upsert's key column (`key`) is never added or changed by evolution: the merge
    matches the table's rows by it, and rows already there would read null (added) or
    match by another type (promoted). The config keeps the key in format.schema, whose
    columns evolution does not touch; this says so by name if one ever reaches here.
    SchemaEvolutionError, before anything is written."""
    hit = [(name, want, how) for name, want, how in changes if name in key]
    if not hit:
        return
    what = ", ".join(f"{how} {name!r} {want}" for name, want, how in hit)
    raise SchemaEvolutionError(
        f"Iceberg table {table_name}: the reader schema would change the upsert key "
        f"column(s) ({what}); format.schema_evolution never adds or changes a column of "
        f"sink.key (the merge matches rows by it). Nothing was written; declare the key "
        f"column in format.schema with the type the table has, or upsert into a new "
        f"sink.table")


def nested_columns(schema: Schema, columns: Sequence[tuple[str, str]],
                   nested: Mapping[str, pa.DataType]
                   ) -> tuple[list[tuple[str, str]], dict[str, IcebergType]]:
    """The evolved `columns` split for `pending_changes`: a `json` (jsonb) one whose reader
    schema gives it a struct, list or map form (`nested`: column -> Arrow type) is added
    as that Iceberg type where the table lacks it (returned second: name -> type, the
    column kept in the first list so that its name is checked like any other); one the
    table holds as a struct, list or map is left out (the fields inside evolve by
    `nested.nested_additions`); one it holds as a string keeps getting the JSON text."""
    from pyiceberg.types import ListType, MapType, StructType

    from offsetflow.sinks.iceberg.nested import iceberg_type_of

    plain: list[tuple[str, str]] = []
    typed: dict[str, IcebergType] = {}
    for name, pg in columns:
        arrow = nested.get(name) if pg == "jsonb" else None
        if arrow is not None:
            try:
                have = schema.find_field(name).field_type
            except ValueError:
                typed[name] = iceberg_type_of(arrow)
            else:
                if isinstance(have, (StructType, ListType, MapType)):
                    continue
        plain.append((name, pg))
    return plain, typed


def evolve_schema(txn: Transaction, table_name: str, columns: Sequence[tuple[str, str]],
                  audit_id: int | None = None, key: Sequence[str] = (),
                  nested: Mapping[str, pa.DataType] | None = None) -> list[str]:
    """Stage in `txn` the schema update that adds the evolved `columns` the table lacks
    (optional: rows already there read null; a `json` one with a nested reader type as
    that struct, list or map: `nested_columns`) and promotes those of a narrower type, then
    adds the fields of the reader's `nested` types (column -> Arrow struct/list/map) that
    the table's nested columns lack (`nested.nested_additions`, optional too); nothing
    when there is nothing to change. Returns what changed, in words. A batch of an audited
    window (`audit_id`) with something to change is refused (`refuse_on_branch`), and so
    is a change to an upsert's `key` column (`refuse_key_changes`)."""
    from offsetflow.sinks.iceberg.nested import (
        iceberg_type_of,
        nested_additions,
        nested_relaxations,
    )

    meta = txn.table_metadata
    plain, typed = nested_columns(meta.schema(), columns, nested or {})
    changes = [(name, typed.get(name, want) if how == "add" else want, how)
               for name, want, how in pending_changes(table_name, meta.schema(), plain)]
    inner = [(path, iceberg_type_of(a))
             for path, a in nested_additions(meta.schema(), nested or {})]
    # a required nested field the reader makes optional (or drops), a promoted one
    loose = nested_relaxations(meta.schema(), nested or {})
    if not changes and not inner and not loose:
        return []
    refuse_on_branch(table_name, [
        *changes, *((".".join(p), w, "add") for p, w in inner),
        *((".".join(p), w or meta.schema().find_field(".".join(p)).field_type,
           "optional" if w is None else "widen") for p, w in loose)], audit_id)
    refuse_key_changes(table_name, changes, key)
    with txn.update_schema() as update:
        for name, want, how in changes:
            if how == "add":
                update.add_column(name, want, required=False)
            else:
                update.update_column(name, want)
        for path, want in inner:  # pyiceberg numbers them after the columns, in order
            update.add_column(path, want, required=False)
        for path, wider in loose:  # no new ids: the files' ids are the same either way
            if wider is None:
                update.make_column_optional(path)
            else:
                update.update_column(path, wider)
    return ([f"{how} {name} {want}" for name, want, how in changes]
            + [f"add {'.'.join(p)} {want}" for p, want in inner]
            + [f"{'optional' if w is None else f'widen to {w}'} {'.'.join(p)}"
               for p, w in loose])


def evolved_metadata(table: Table, columns: Sequence[tuple[str, str]],
                     audit_id: int | None = None, key: Sequence[str] = (),
                     nested: Mapping[str, pa.DataType] | None = None) -> TableMetadata:
    """The table's metadata with the evolution staged (never committed here): the schema,
    with its field ids, that the tasks write their data files with. An audited window's
    batch (`audit_id`) with something to change, or a change to an upsert's `key`
    column, is refused here, before the tasks write."""
    name = ".".join(table.name())
    txn = table.transaction()
    if not evolve_schema(txn, name, columns, audit_id, key, nested):
        return table.metadata
    return txn.table_metadata


def schema_signature(schema: Schema) -> dict[str, str]:
    """field id -> `name type` of a schema's top-level fields: what a data file written
    with it means by each id (recorded with the file in its marker)."""
    return {str(f.field_id): f"{f.name} {f.field_type}" for f in schema.fields}


def check_files_schema(schema: Schema, by_part: Mapping[int, Sequence[Mapping[str, Any]]],
                       table_name: str, batch_id: int) -> None:
    """Every listed file's field ids mean in `schema` (the one the commit makes current)
    what they meant when it was written: else its part is dropped and written again (a
    column added by another writer between the tasks and the commit took the id the tasks
    gave an evolved column). Files of markers without a signature (an older OffsetFlow)
    are taken as the table's."""
    now = schema_signature(schema)
    stale: list[int] = []
    example = ""
    for part, files in by_part.items():
        for f in files:
            written = f.get("schema_fields")
            if not written:
                continue
            wrong = {k: v for k, v in written.items() if now.get(k) != v}
            if wrong:
                stale.append(part)
                k, v = next(iter(wrong.items()))
                example = f"field id {k} is {v!r} in its files, {now.get(k)!r} in the table"
                break
    if stale:
        raise StagedRowsLostError(batch_id, sorted(stale),
                                  f"data files were written with field ids the Iceberg table "
                                  f"{table_name} now gives other columns ({example})")
