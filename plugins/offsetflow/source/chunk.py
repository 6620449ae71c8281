"""What a Kafka record becomes on its way to a stage: `RawChunk` holds a chunk of consecutive
records column-wise (one range's, or several small ranges' on a shared consumer) and turns
it into an Arrow batch of `RAW_SCHEMA`; `append_record` adds one record, on the reader's hot
loop, and notes a record whose timestamp or headers cannot be written as refused (it is
kept, so it becomes a bad record with its coordinates, never silently dropped). Reading
the records is `offsetflow.source.reader` / `offsetflow.source.packed`.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

HEADER_TYPE = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))
RAW_SCHEMA = pa.schema([
    pa.field("topic", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    pa.field("timestamp_type", pa.int32()),
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("headers", HEADER_TYPE),
])

# Kafka timestamps are int64 milliseconds (a topic with message.timestamp.after.max.ms
# raised, or a librdkafka producer, sends any). What this pipeline writes is years 1 to
# 9999: a dead letter's timestamp (and a CSV-staged row's) is written as text, which Arrow
# writes with a wrapped year past 32,767 and PostgreSQL refuses before year 1, and
# microseconds overflow int64 past ~year 294,000. A record outside is a bad record.
MIN_TIMESTAMP_MS = -62_135_596_800_000  # 0001-01-01T00:00:00Z
MAX_TIMESTAMP_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z


@dataclass
class RawChunk:
    """Up to `max_rows` consecutive records of one range, column-wise."""

    offsets: list[int] = field(default_factory=list)
    timestamps: list[int | None] = field(default_factory=list)
    timestamp_types: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    headers: list[list[dict[str, Any]] | None] = field(default_factory=list)
    nbytes: int = 0  # keys + values + headers
    refused: dict[int, str] = field(default_factory=dict)  # index -> why it cannot be written
    # a chunk of several ranges (`reader_packed`): each row's topic and partition
    topics: list[str] | None = None
    partitions: list[int] | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def to_arrow(self, topic: str, partition: int, indices: list[int] | None = None
                 ) -> pa.RecordBatch:
        def pick(xs: list[Any]) -> list[Any]:
            return xs if indices is None else [xs[i] for i in indices]
        n = len(self.offsets) if indices is None else len(indices)
        return pa.RecordBatch.from_arrays([
            pa.array([topic] * n if self.topics is None else pick(self.topics), pa.string()),
            pa.array([partition] * n if self.partitions is None else pick(self.partitions),
                     pa.int32()),
            pa.array(pick(self.offsets), pa.int64()),
            pa.array(pick(self.timestamps), pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            pa.array(pick(self.timestamp_types), pa.int32()),
            pa.array(pick(self.keys), pa.binary()),
            pa.array(pick(self.values), pa.binary()),
            pa.array(pick(self.headers), HEADER_TYPE),
        ], schema=RAW_SCHEMA)


def append_record(chunk: RawChunk, m: Any, off: int) -> int:
    """Add record `m` (at offset `off`) to `chunk`; returns its size in bytes (keys, values,
    header names and values). A timestamp or headers that cannot be written are noted in
    `refused`, the record is kept."""
    ts_type, ts = m.timestamp()
    if ts_type and ts > MAX_TIMESTAMP_MS:
        chunk.refused[len(chunk.offsets)] = (
            f"Kafka timestamp {ts} ms is after year 9999, the latest this pipeline writes")
        ts_type = 0
    elif ts_type and ts < MIN_TIMESTAMP_MS:
        chunk.refused[len(chunk.offsets)] = (
            f"Kafka timestamp {ts} ms is before year 1, the earliest this pipeline writes")
        ts_type = 0
    chunk.offsets.append(off)
    chunk.timestamps.append(ts * 1000 if ts_type else None)
    chunk.timestamp_types.append(ts_type)
    key, value = m.key(), m.value()
    chunk.keys.append(key)
    chunk.values.append(value)
    nb = 0
    if value is not None:
        nb = len(value)
    if key is not None:
        nb += len(key)
    hdrs = _headers(m)
    if hdrs is _UNREADABLE:
        chunk.refused[len(chunk.offsets) - 1] = UNREADABLE_HEADERS
        hdrs = None
    if hdrs:
        chunk.headers.append([{"key": h[0], "value": h[1]} for h in hdrs])
        # names as characters (ASCII in practice), values as bytes
        nb += sum(len(h[0]) + (len(h[1]) if h[1] is not None else 0) for h in hdrs)
    else:
        chunk.headers.append(None)
    chunk.nbytes += nb
    return nb


_UNREADABLE: list[tuple[str, bytes | None]] = []
UNREADABLE_HEADERS = ("its headers cannot be read: a header name is not UTF-8 (the record's "
                      "key and value are kept)")


def _headers(m: Any) -> list[tuple[str, bytes | None]] | None:
    """The record's headers, or `_UNREADABLE`. A header name that is not UTF-8 makes
    confluent-kafka build a (NULL, value) tuple and return it with the UnicodeDecodeError
    still set: Python raises SystemError then, or (once the call site is specialised) hands
    back the broken list, whose NULL item crashes the process when read, with the error
    pending. Tuples visit only their non-NULL items for the garbage collector, so counting
    those finds a NULL without touching it, and the checked call surfaces a pending error
    as SystemError here rather than somewhere later."""
    try:
        hdrs = m.headers()
        if hdrs and len(gc.get_referents(*hdrs)) != 2 * len(hdrs):
            return _UNREADABLE
    except SystemError:
        return _UNREADABLE
    return hdrs  # type: ignore[no-any-return]
