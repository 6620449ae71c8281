"""The Iceberg sink's stage path (a transform or a quality suite, `sinks.task_data_files`):
the batch's staged rows read from PostgreSQL as Arrow in the table's schema, on the driver.
One COPY to CSV with every column in a form Arrow's C++ CSV reader parses itself, so no
Python runs per row; the batch is held in the driver's memory."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
import psycopg2.extensions
import pyarrow as pa
import pyarrow.csv as pa_csv
from psycopg2 import sql

from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.ledger import stage_table

_ARROW: dict[str, pa.DataType] = {
    "text": pa.string(), "bigint": pa.int64(), "integer": pa.int32(), "smallint": pa.int32(),
    "double precision": pa.float64(), "real": pa.float32(), "boolean": pa.bool_(),
    "timestamptz": pa.timestamp("us", tz="UTC"), "timestamp": pa.timestamp("us"),
    "date": pa.date32(), "bytea": pa.binary(), "jsonb": pa.string(), "uuid": pa.string(),
}



def arrow_type(pg_type: str) -> pa.DataType:
    """The Iceberg (Arrow) type of a stage column; nested Spark types (jsonb in the stage)
    are kept as their JSON text."""
    if pg_type.startswith("numeric("):
        p, s = pg_type[len("numeric("):-1].split(",")
        return pa.decimal128(int(p), int(s))
    return _ARROW[pg_type]


def arrow_schema(columns: Sequence[tuple[str, str]],
                 nested: Mapping[str, pa.DataType] | None = None) -> pa.Schema:
    """The stage columns' Arrow schema; with `nested`, those named there (jsonb in the
    stage, a transform's text) as their struct, list or map type (a new table's,
    `sink_iceberg_nested`)."""
    nested = nested or {}
    return pa.schema([pa.field(n, nested[n] if n in nested and t in ("jsonb", "text")
                               else arrow_type(t)) for n, t in columns]
                     + [pa.field(LINEAGE_COLUMN, pa.int64())])



def read_stage(cur: psycopg2.extensions.cursor, batch_id: int,
               columns: Sequence[tuple[str, str]], skip_tombstones: bool,
               source: sql.Composable | None = None) -> pa.Table:
    """The batch's staged rows (or those of `source`, a relation with `columns`) as Arrow
    (dead letters routed out already), with the lineage column, in the table's schema. One
    COPY to CSV with every column in a form Arrow's C++ CSV reader parses itself (bytea as
    hex, timestamps as epoch microseconds, dates as day numbers), so no Python runs per
    row."""
    schema = arrow_schema(columns)
    where = sql.SQL(" WHERE value IS NOT NULL") if skip_tombstones else sql.SQL("")
    exprs = [_csv_expr(n, t) for n, t in columns]
    buf = io.BytesIO()
    cur.copy_expert(sql.SQL("COPY (SELECT {} FROM {}{}) TO STDOUT WITH (FORMAT csv)").format(
        sql.SQL(", ").join(exprs), source or stage_table(batch_id), where).as_string(cur),
        buf)
    names = [f"c{i}" for i in range(len(columns))]
    raw = pa_csv.read_csv(
        io.BytesIO(buf.getvalue()),
        read_options=pa_csv.ReadOptions(column_names=names, block_size=16 << 20),
        parse_options=pa_csv.ParseOptions(newlines_in_values=True),
        convert_options=pa_csv.ConvertOptions(
            column_types={c: _CSV_TYPES.get(t, pa.string()) for c, (_, t) in
                          zip(names, columns, strict=True)},
            null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=False))
    arrays = [_from_csv(raw.column(i), t, schema.field(i).type)
              for i, (_, t) in enumerate(columns)]
    arrays.append(pa.chunked_array([pa.array(np.full(raw.num_rows, batch_id, np.int64))]))
    return pa.Table.from_arrays(arrays, schema=schema)


# how a stage column travels through CSV when Arrow cannot parse PostgreSQL's text form
_CSV_TYPES: dict[str, pa.DataType] = {
    "bigint": pa.int64(), "integer": pa.int32(), "smallint": pa.int32(),
    "double precision": pa.float64(), "real": pa.float32(), "boolean": pa.int8(),
    "timestamptz": pa.int64(), "timestamp": pa.int64(), "date": pa.int32(),
}


def _csv_expr(name: str, pg_type: str) -> sql.Composable:
    col = sql.Identifier(name)
    if pg_type == "bytea":
        return sql.SQL("encode({}, 'hex')").format(col)
    if pg_type in ("timestamptz", "timestamp"):
        return sql.SQL("(extract(epoch FROM {}) * 1000000)::bigint").format(col)
    if pg_type == "date":
        return sql.SQL("({} - date '1970-01-01')").format(col)
    if pg_type == "boolean":
        return sql.SQL("{}::int").format(col)
    if pg_type == "jsonb" or pg_type.startswith("numeric("):
        return sql.SQL("{}::text").format(col)
    return col


def _from_csv(col: pa.ChunkedArray, pg_type: str, want: pa.DataType) -> pa.ChunkedArray:
    if pg_type == "bytea":
        return pa.chunked_array([unhex(c) for c in col.chunks], pa.binary())
    return col.cast(want)


def unhex(hexes: pa.Array) -> pa.Array:
    """Hex text to binary for a whole chunk at once: the string array's value buffer is
    every value's hex back to back, so one `bytes.fromhex` decodes them all."""
    n = len(hexes)
    if n == 0:
        return pa.array([], pa.binary())
    offsets = np.frombuffer(hexes.buffers()[1], np.int32, n + 1, hexes.offset * 4)
    data = hexes.buffers()[2]
    lo, hi = int(offsets[0]), int(offsets[-1])
    decoded = bytes.fromhex(data.to_pybytes()[lo:hi].decode("ascii")) if data else b""
    new_offsets = ((offsets - lo) // 2).astype(np.int32)
    validity = None
    if hexes.null_count:
        validity = hexes.is_valid().buffers()[1]
    return pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(new_offsets),
                                                  pa.py_buffer(decoded)], hexes.null_count)
