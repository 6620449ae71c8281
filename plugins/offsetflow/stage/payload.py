"""COPY payloads: a chunk of rows as CSV or in PostgreSQL's binary COPY format, and the
COPY itself. The tasks stage rows with them (`offsetflow.stage.part`); the driver copies dead
letters and an Iceberg upsert's keys with them too."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import psycopg2.extensions
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg2 import sql

from offsetflow.stage import pgcopy
from offsetflow.stage.form import stage_form


def csv_bytes(batch: pa.RecordBatch | pa.Table) -> bytes:
    buf = io.BytesIO()
    pacsv.write_csv(batch, buf, pacsv.WriteOptions(include_header=False))
    return buf.getvalue()


def copy_into(cur: psycopg2.extensions.cursor, table: sql.Composable, columns: Sequence[str],
          data: bytes, fmt: str = "csv") -> None:
    cur.copy_expert(sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT {})").format(
        table, sql.SQL(", ").join(sql.Identifier(c) for c in columns),
        sql.SQL({"csv": "csv", "binary": "binary"}[fmt])), io.BytesIO(data))


Encoder = Callable[[pa.RecordBatch], tuple[str, bytes]]


def csv_encoder(batch: pa.RecordBatch) -> tuple[str, bytes]:
    """For batches already in stage form (binary as hex text, nested as JSON)."""
    return "csv", csv_bytes(batch)


def binary_encoder(pg_types: Sequence[str]) -> Encoder:
    """For raw Arrow batches in stage-column order: binary COPY where every column type has
    a binary layout (the usual case), else hex/JSON text as CSV."""
    types = list(pg_types)
    use_binary = pgcopy.supported(types)

    def encode(batch: pa.RecordBatch) -> tuple[str, bytes]:
        if use_binary:
            data = pgcopy.encode(stage_form(batch, hex_binary=False), types)
            if data is not None:
                return "binary", data
        return "csv", csv_bytes(stage_form(batch))
    return encode
