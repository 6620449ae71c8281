"""Staging's safety net, run in Spark tasks: a chunk whose COPY PostgreSQL refuses with a
data error (a value the deserializer's checks did not foresee, or one a transform produced)
is rolled back to a savepoint and bisected; each row PostgreSQL refuses becomes a bad record
with its error as the reason (and the column, where PostgreSQL or the row names it), the
rest is staged, in the part's transaction (`offsetflow.stage.part.stage_rows`)."""

from __future__ import annotations

import re
from typing import Any

import psycopg2
import psycopg2.extensions
import pyarrow as pa
from psycopg2 import sql

from offsetflow.stage.metrics import TaskClock
from offsetflow.stage.payload import Encoder, copy_into

# failed COPYs of one chunk after which bisecting stops: where most rows are refused it
# would cost ~2n COPYs, each of the first ones copying half the chunk
BISECT_FAILURES = 4


def copy_or_bisect(cur: psycopg2.extensions.cursor, into: sql.Composed, b: pa.RecordBatch,
                    encode: Encoder, clock: TaskClock, refused: list[dict[str, Any]],
                    failures: list[int] | None = None) -> list[pa.RecordBatch]:
    """COPY `b` under a savepoint. On a data error, roll back and bisect until the refused
    rows are single; returns the slices that were staged, appends the refused rows. Costs
    two statements per chunk when nothing is wrong, O(bad * log(rows)) COPYs when a few
    rows are refused; after BISECT_FAILURES failures the rest goes row by row
    (`_copy_row_by_row`), so a chunk of mostly refused rows costs about a COPY per row."""
    failures = [0] if failures is None else failures
    error = _try_copy(cur, into, b, encode, clock)
    if error is None:
        return [b]
    failures[0] += 1
    if b.num_rows == 1:
        refused.append(_refused_row(b, _pg_reason(error, b)))
        return []
    if failures[0] > BISECT_FAILURES:
        return _copy_row_by_row(cur, into, b, encode, clock, refused, error)
    mid = b.num_rows // 2
    return (copy_or_bisect(cur, into, b.slice(0, mid), encode, clock, refused, failures)
            + copy_or_bisect(cur, into, b.slice(mid), encode, clock, refused, failures))


def _try_copy(cur: psycopg2.extensions.cursor, into: sql.Composed, b: pa.RecordBatch,
              encode: Encoder, clock: TaskClock) -> psycopg2.DataError | None:
    """COPY `b` under a savepoint; PostgreSQL's data error (rolled back) or None. The
    error carries the payload's format in `offsetflow_fmt`."""
    with clock.stage("encode"):
        fmt, data = encode(b)
    with clock.stage("copy"):
        cur.execute("SAVEPOINT offsetflow_chunk")
        try:
            copy_into(cur, into, b.schema.names, data, fmt)
        except psycopg2.DataError as e:
            cur.execute("ROLLBACK TO SAVEPOINT offsetflow_chunk")
            cur.execute("RELEASE SAVEPOINT offsetflow_chunk")
            e.offsetflow_fmt = fmt  # type: ignore[attr-defined]
            return e
        cur.execute("RELEASE SAVEPOINT offsetflow_chunk")
    return None


_LINE_RE = re.compile(r"^COPY \S+, line (\d+)")


def _copy_row_by_row(cur: psycopg2.extensions.cursor, into: sql.Composed, b: pa.RecordBatch,
                     encode: Encoder, clock: TaskClock, refused: list[dict[str, Any]],
                     error: psycopg2.DataError) -> list[pa.RecordBatch]:
    """Stage `b`, whose COPY just failed with `error`, a refused row at a time. A binary
    COPY's error names the tuple it refused (its "line"): the rows before it go in one
    COPY, and the rest is tried again. Otherwise (CSV, whose "line" is not a row where a
    value holds a newline) each row is COPYed on its own."""
    staged: list[pa.RecordBatch] = []
    i, n = 0, b.num_rows
    err: psycopg2.DataError | None = error
    while i < n:
        rest = b.slice(i)
        if err is None:
            err = _try_copy(cur, into, rest, encode, clock)
            if err is None:
                staged.append(rest)
                return staged
        m = _LINE_RE.search(err.diag.context or "") \
            if getattr(err, "offsetflow_fmt", None) == "binary" else None
        line = int(m.group(1)) if m else 0
        if not 1 <= line <= rest.num_rows:  # not named: each row on its own
            for j in range(rest.num_rows):
                row = rest.slice(j, 1)
                row_err = _try_copy(cur, into, row, encode, clock)
                if row_err is None:
                    staged.append(row)
                else:
                    refused.append(_refused_row(row, _pg_reason(row_err, row)))
            return staged
        good = rest.slice(0, line - 1)
        if good.num_rows:
            # the named row's predecessors passed once; should they not (a wrong line),
            # they go row by row too
            good_err = _try_copy(cur, into, good, encode, clock)
            if good_err is None:
                staged.append(good)
            else:
                staged += _copy_row_by_row(cur, into, good, encode, clock, refused,
                                           _unnamed(good_err))
        row = rest.slice(line - 1, 1)
        refused.append(_refused_row(row, _pg_reason(err, row)))
        i, err = i + line, None
    return staged


def _unnamed(e: psycopg2.DataError) -> psycopg2.DataError:
    e.offsetflow_fmt = None  # type: ignore[attr-defined]
    return e


_COLUMN_RE = re.compile(r"column (\S+?)(?::|$)")


def _pg_reason(e: psycopg2.Error, row: pa.RecordBatch) -> str:
    """PostgreSQL's message and the column: from COPY's context, or for encoding errors
    (found before COPY splits the line into columns) the text column holding NUL or
    invalid UTF-8."""
    msg = (e.diag.message_primary or str(e).strip().splitlines()[0]).strip()
    m = _COLUMN_RE.search(e.diag.context or "")
    column = m.group(1) if m else _bad_text_column(row)
    where = f" (column {column})" if column else ""
    return f"PostgreSQL refused the row at staging: {msg}{where}"


def _bad_text_column(row: pa.RecordBatch) -> str | None:
    for f, col in zip(row.schema, row.columns, strict=True):
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            v = col.cast(pa.binary())[0].as_py()
            if v is None:
                continue
            try:
                v.decode("utf-8")
            except UnicodeDecodeError:
                return f.name
            if b"\x00" in v:
                return f.name
    return None


def _refused_row(b: pa.RecordBatch, reason: str) -> dict[str, Any]:
    """One refused row's coordinates and raw key/value, from raw or stage-form columns."""
    def get(name: str) -> Any:
        if name not in b.schema.names:
            return None
        col = b.column(name)
        if name in ("key", "value") and (pa.types.is_string(col.type)
                                         or pa.types.is_large_string(col.type)):
            # stage form: hex text; other text (a transform's) as its bytes
            raw = col.cast(pa.binary())[0].as_py()
            return None if raw is None else (
                bytes.fromhex(raw[2:].decode()) if raw.startswith(b"\\x") else raw)
        if pa.types.is_timestamp(col.type):  # as microseconds: any year, no datetime
            return col.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())[0].as_py()
        return col[0].as_py()
    return {"topic": get("topic"), "partition": get("partition"), "offset": get("offset"),
            "timestamp": get("timestamp"), "key": get("key"), "value": get("value"),
            "error": reason, "stage": "stage"}
