"""How a Kafka sink's staged row becomes a record (pure; `offsetflow.sinks.kafka.sink` does the
I/O; the names and commit marks of a batch are `offsetflow.sinks.kafka.mark`).

One SELECT (`select_sql`) lets PostgreSQL build key and value bytes per chunk, in offset
order, so the driver's per-row work is one `produce` call; the columns it reads are checked
first (`check_columns`), fetches are sized by the largest staged row (`row_bytes_sql`,
`rows_per_fetch`), and a record's size is bounded as librdkafka counts it (`record_size`,
`record_limit`), so one the topic can never take is known before it is produced.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg2 import sql

from offsetflow.config import RESERVED_COLUMNS, KafkaSinkConfig
from offsetflow.errors import ConfigError
from offsetflow.ranges import OffsetRange
from offsetflow.sinks.kafka.mark import BATCH_HEADER, SOURCE_HEADER

# sizes as the producer and broker count them (librdkafka's worst-case v2 record overhead;
# per header two varints; a record batch's header, which the topic's limit includes)
RECORD_OVERHEAD = 36
HEADER_OVERHEAD = 10
BATCH_OVERHEAD = 61
PRODUCER_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes
# The session settings the records' text depends on (`row_to_json`, a key's JSON scalar
# text), set in the commit's transaction before the stage is read, whatever the role, the
# database, PGOPTIONS or the DSN's `options` set: timestamps in UTC; a double or real as
# its exact shortest text (extra_float_digits 0 rounds it to 15 digits: 0.3 for
# 0.30000000000000004, 1 for 1.0000000000000002; any value above 0 is the shortest exact
# text since PostgreSQL 12, 3 the exact 17 digits before); bytea as hex; an interval as
# PostgreSQL prints it by default
OUTPUT_SETTINGS = ("SET LOCAL TimeZone = 'UTC'; SET LOCAL extra_float_digits = 3; "
                   "SET LOCAL bytea_output = 'hex'; SET LOCAL IntervalStyle = 'postgres'")


def record_limit(producer: Mapping[str, Any], topic_max: int | None) -> int:
    """The largest record the sink can produce to the topic: the producer's
    message.max.bytes, and the topic's max.message.bytes unless records are compressed
    (the broker counts compressed batches; the producer still refuses at its own limit)."""
    limit = int(producer.get("message.max.bytes", PRODUCER_MAX_BYTES))
    compressed = str(producer.get("compression.type",
                                  producer.get("compression.codec", "none"))) != "none"
    if topic_max is not None and not compressed:
        limit = min(limit, topic_max - BATCH_OVERHEAD)
    return limit


def record_size(key: bytes | None, value: bytes | str | None,
                headers: Sequence[tuple[str, bytes | str | None]]) -> int:
    """An upper bound of a record's size as librdkafka checks it against message.max.bytes
    (a str as its UTF-8 bytes)."""
    return (RECORD_OVERHEAD + _len(key) + _len(value)
            + sum(HEADER_OVERHEAD + len(k.encode()) + _len(v) for k, v in headers))


def value_digest(value: bytes | str | None) -> bytes | None:
    """A short digest of a record value as produced (a str as its UTF-8 bytes): what the
    failure path keeps of a failed message to find its source record again."""
    if value is None:
        return None
    return hashlib.blake2b(value.encode() if isinstance(value, str) else value,
                           digest_size=16).digest()


def _len(v: bytes | str | None) -> int:
    return 0 if v is None else len(v.encode()) if isinstance(v, str) else len(v)


def payload_columns(columns: Sequence[str]) -> list[str]:
    """The columns a JSON value holds by default: all but the source record's own."""
    return [c for c in columns if c not in RESERVED_COLUMNS]


def check_columns(sink: KafkaSinkConfig, columns: Mapping[str, str], source_file: str) -> None:
    """Columns the sink reads exist in the stage (a transform decides them at run time)."""
    wanted: list[tuple[str, str]] = [("sink.value_columns", c) for c in sink.value_columns]
    if sink.key_column is not None:
        wanted.append(("sink.key_column", sink.key_column))
    if sink.value_format == "raw":
        wanted.append(("sink.value_column", sink.value_column))
    elif not sink.value_columns and not payload_columns(list(columns)):
        raise ConfigError(source_file, "sink.value_columns",
                          f"the staged rows have no payload columns for a JSON value (only "
                          f"{sorted(columns)}); list value_columns or use value_format: raw")
    for fld, col in wanted:
        if col not in columns:
            raise ConfigError(source_file, fld, f"{col!r} is not a column of the staged rows "
                                                f"({sorted(columns)})")
    key_col, key_field = key_source(sink, columns)
    if key_col is not None and columns[key_col] in _NESTED_TYPES:
        raise ConfigError(source_file, key_field,
                          f"the record key column {key_col!r} is {columns[key_col]} (a nested "
                          f"value); a key must be bytes, text or a scalar: pick or build "
                          f"such a column")


# Spark's arrays, structs and maps are staged as jsonb: no one obvious key encoding
_NESTED_TYPES = frozenset({"json", "jsonb"})


def key_source(sink: KafkaSinkConfig, columns: Mapping[str, str]
               ) -> tuple[str | None, str]:
    """The column the record key comes from and the setting that chose it: `key_column`,
    else the stage's `key` (the source key, or what a transform put there), else none."""
    if sink.key_column is not None:
        return sink.key_column, "sink.key_column"
    return ("key" if "key" in columns else None), "transform"


def _as_bytes(col: str, pg_type: str) -> sql.Composable:
    """A column as record bytes: bytea as is, text as UTF-8, else its JSON scalar text
    (a number its decimal text, a boolean true/false, a timestamp ISO text)."""
    ident = sql.SQL("s.{}").format(sql.Identifier(col))
    if pg_type == "bytea":
        return ident
    if pg_type == "text":
        return sql.SQL("convert_to({}, 'UTF8')").format(ident)
    return sql.SQL("convert_to(to_json({}) #>> '{{}}', 'UTF8')").format(ident)


def _json_row(cols: Sequence[str]) -> sql.Composable:
    """The value's columns as one row whose JSON is the value: `row_to_json` of a LATERAL
    row (about twice as fast as json_build_object, which looks up every argument's type on
    every row, and with no 100-argument limit); compact JSON, names as the columns'."""
    return sql.SQL(", LATERAL (SELECT {}) offsetflow_v").format(sql.SQL(", ").join(
        sql.SQL("s.{c} AS {c}").format(c=sql.Identifier(c)) for c in cols))


def record_key(hex_key: str | None) -> bytes | None:
    """A record's key as `select_sql` gives it (hex text) as the bytes produced."""
    return None if hex_key is None else bytes.fromhex(hex_key)


def select_sql(sink: KafkaSinkConfig, columns: Mapping[str, str],
               stage: sql.Composable) -> sql.Composed:
    """topic, partition, offset, key (the hex text of its bytes: `record_key`), value
    (bytes; a JSON value: text), headers (jsonb or NULL), timestamp (epoch ms or NULL) of
    every staged row, in source order. A tombstone (the source `value` is NULL) stays one:
    a NULL value, whatever the value format."""
    return sql.SQL("{} ORDER BY s.topic, s.partition, s.\"offset\"").format(
        _records_sql(sink, columns, stage))


def parts_select_sql(sink: KafkaSinkConfig, columns: Mapping[str, str],
                     segments: Sequence[tuple[sql.Composable, OffsetRange | None]]
                     ) -> sql.Composed:
    """The records of `select_sql`, read segment after segment in the order given (an
    `Append` runs its branches in order), each a plain scan of its stage part as stored
    (no sort, no index), filtered to its sub-range when one is given. Source order only if
    each part holds its sub-ranges in source order and the segments come from
    `offsetflow.sinks.kafka.order.segments`; the driver checks it."""
    return sql.SQL(" UNION ALL ").join(
        sql.SQL("({})").format(_records_sql(sink, columns, part, only))
        for part, only in segments)


def _records_sql(sink: KafkaSinkConfig, columns: Mapping[str, str],
                 stage: sql.Composable, only: OffsetRange | None = None) -> sql.Composed:
    """`select_sql`'s records in no particular order (`only`: of that range alone)."""
    key_col, _ = key_source(sink, columns)
    # a transform's `key` may be any type: encoded like key_column (never bytes(int)).
    # Sent as hex text (`record_key` makes it bytes): psycopg2 turns a bytea into a
    # memoryview over a buffer of its own, about 0.3 us a row more in the driver
    key = (sql.SQL("encode({}, 'hex')").format(_as_bytes(key_col, columns[key_col]))
           if key_col is not None else sql.SQL("NULL::text"))
    row: sql.Composable = sql.SQL("")
    if sink.value_format == "raw":
        value = _as_bytes(sink.value_column, columns[sink.value_column])
    else:
        # text: psycopg2 reads it as str (no hex bytea on the wire), librdkafka writes UTF-8
        value = sql.SQL("row_to_json(offsetflow_v.*)::text")
        row = _json_row(list(sink.value_columns) or payload_columns(list(columns)))
        if "value" in columns:
            value = sql.SQL("CASE WHEN s.value IS NULL THEN NULL ELSE {} END").format(value)
    headers = (sql.SQL("s.headers") if sink.headers == "carry" and "headers" in columns
               else sql.SQL("NULL::jsonb"))
    ts = (sql.SQL("(extract(epoch FROM s.\"timestamp\") * 1000)::bigint")
          if columns.get("timestamp", "").startswith("timestamp") else sql.SQL("NULL::bigint"))
    return sql.SQL("SELECT s.topic, s.partition, s.\"offset\", {key}, {value}, {headers}, {ts} "
                   "FROM {stage} s{row}{where}").format(
                       key=key, value=value, headers=headers, ts=ts, stage=stage, row=row,
                       where=sql.SQL("") if only is None else sql.SQL(
                           " WHERE s.topic = {} AND s.partition = {} AND s.\"offset\" >= {} "
                           "AND s.\"offset\" < {}").format(
                               sql.Literal(only.topic), sql.Literal(only.partition),
                               sql.Literal(only.from_offset), sql.Literal(only.until_offset)))


_SCALAR_BYTES = 64  # a generous size of any fixed-width (or short numeric) column


def stage_extent_sql(columns: Mapping[str, str], stage: sql.Composable) -> sql.Composed:
    """One scan of the stage: the largest staged row in bytes (`row_bytes_sql`) and the
    earliest and latest record timestamp (epoch ms, as `select_sql` gives them; NULLs when
    the rows have none), so the sink checks timestamps per record only when some are
    outside what the output topic takes."""
    ts = columns.get("timestamp", "").startswith("timestamp")
    agg = (sql.SQL("(extract(epoch FROM min(s.\"timestamp\")) * 1000)::bigint, "
                   "(extract(epoch FROM max(s.\"timestamp\")) * 1000)::bigint")
           if ts else sql.SQL("NULL::bigint, NULL::bigint"))
    return sql.SQL("SELECT ({}), {} FROM {} s").format(
        _largest_row(columns), agg, stage)


def _largest_row(columns: Mapping[str, str]) -> sql.Composed:
    var = [(c, t) for c, t in columns.items() if t in ("text", "bytea", "json", "jsonb")]
    parts = [sql.SQL("coalesce({}(s.{}), 0)").format(
        sql.SQL("octet_length" if t in ("text", "bytea") else "pg_column_size"),
        sql.Identifier(c)) for c, t in var]
    fixed = sql.Literal(_SCALAR_BYTES * (len(columns) - len(var)))
    return sql.SQL("coalesce(max({}), 0) + {}").format(
        sql.SQL(" + ").join(parts) if parts else sql.SQL("0"), fixed)


def row_bytes_sql(columns: Mapping[str, str], stage: sql.Composable) -> sql.Composed:
    """The largest staged row in bytes: its text, bytea and json columns (no value is
    detoasted: octet_length reads the stored length; jsonb its stored size) plus a fixed
    allowance per other column. What the driver holds per row fetched is a few times that
    (bytea arrives as hex, then bytes): `rows_per_fetch` sizes its fetches by it."""
    return sql.SQL("SELECT {} FROM {} s").format(_largest_row(columns), stage)


def rows_per_fetch(max_row_bytes: int, budget_bytes: int, max_rows: int) -> int:
    """Rows per fetch of the stage so that one fetch stays within `budget_bytes` of driver
    memory: a row costs about three times its staged bytes (hex text in the result, the
    bytes object, the record handed to librdkafka)."""
    return max(1, min(max_rows, budget_bytes // (3 * max_row_bytes + 256)))


def record_headers(batch_id: int, topic: str, partition: int, offset: int,
                   carried: list[dict[str, Any]] | None
                   ) -> list[tuple[str, bytes | str | None]]:
    """The source record's headers (staged as JSON, binary values base64) and the two
    offsetflow headers that name the batch and the source record."""
    out: list[tuple[str, bytes | str | None]] = []
    for h in carried or ():
        v = h.get("value")
        out.append((str(h.get("key")), None if v is None else base64.b64decode(v)))
    out.append((BATCH_HEADER, str(batch_id).encode()))
    out.append((SOURCE_HEADER, f"{topic}/{partition}/{offset}".encode()))
    return out
