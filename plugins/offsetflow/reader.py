"""Read exactly one OffsetRange with a confluent-kafka consumer that assigns and seeks.

The KafkaRDD of the direct approach, as a plain iterator of Arrow record batches so it
runs inside Spark's `mapInArrow` (and in tests without Spark). Preconditions as in
KafkaRDD: no group subscription, no auto-commit, `auto.offset.reset` = error.

Gaps are normal (transaction markers, aborted or compacted records): reading stops at
`until_offset` and never waits for an offset that cannot come. Reaching the end of the
partition before `until_offset`, or finding the start deleted, is an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTopicPartition

from offsetflow.errors import DataLossError, RangeReadError
from offsetflow.ranges import OffsetRange

log = logging.getLogger(__name__)

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

REQUIRED_SETTINGS = {"enable.auto.commit": "false", "auto.offset.reset": "error"}


@dataclass
class RawChunk:
    """Up to `max_rows` consecutive records of one range, column-wise."""

    offsets: list[int] = field(default_factory=list)
    timestamps: list[int | None] = field(default_factory=list)
    timestamp_types: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)
    values: list[bytes | None] = field(default_factory=list)
    headers: list[list[dict[str, Any]] | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.offsets)

    def to_arrow(self, topic: str, partition: int, indices: list[int] | None = None
                 ) -> pa.RecordBatch:
        def pick(xs: list[Any]) -> list[Any]:
            return xs if indices is None else [xs[i] for i in indices]
        n = len(self.offsets) if indices is None else len(indices)
        return pa.RecordBatch.from_arrays([
            pa.array([topic] * n, pa.string()),
            pa.array([partition] * n, pa.int32()),
            pa.array(pick(self.offsets), pa.int64()),
            pa.array(pick(self.timestamps), pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            pa.array(pick(self.timestamp_types), pa.int32()),
            pa.array(pick(self.keys), pa.binary()),
            pa.array(pick(self.values), pa.binary()),
            pa.array(pick(self.headers), HEADER_TYPE),
        ], schema=RAW_SCHEMA)


def check_preconditions(conf: Mapping[str, str]) -> None:
    """Refuse consumer settings that would let Kafka, not the ledger, decide offsets."""
    for k, v in REQUIRED_SETTINGS.items():
        if str(conf.get(k, "")).lower() != v:
            raise ValueError(f"reader consumer needs {k}={v}, got {conf.get(k)!r}")


def read_range(conf: Mapping[str, str], r: OffsetRange, max_rows: int = 20_000,
               poll_timeout_s: float = 1.0, stall_timeout_s: float = 300.0
               ) -> Iterator[RawChunk]:
    """Yield the records of `r` in offset order, in chunks of at most `max_rows`."""
    if r.is_empty:
        return
    check_preconditions(conf)
    consumer = Consumer(dict(conf))
    try:
        consumer.assign([KTopicPartition(r.topic, r.partition, r.from_offset)])
        chunk = RawChunk()
        reached = r.from_offset  # every offset below this is accounted for
        last_progress = time.monotonic()
        while reached < r.until_offset:
            # consume() waits for num_messages or the timeout: never ask for more than the
            # range can still hold, or every range's tail pays a full poll timeout
            want = max(1, min(max_rows - len(chunk), 10_000, r.until_offset - reached))
            msgs = consumer.consume(num_messages=want, timeout=poll_timeout_s)
            if not msgs:
                stalled = time.monotonic() - last_progress
                if stalled > 30 and int(stalled) % 30 == 0:
                    log.warning("%s: no record for %.0fs at offset %d (broker restarting or "
                                "leader moving?); still waiting", r, stalled, reached)
                if stalled > stall_timeout_s:
                    lo, hi = _watermarks(consumer, r)
                    raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset,
                                         reached, f"no progress for {stall_timeout_s:.0f}s "
                                                  f"(partition offsets now [{lo}, {hi}))")
                continue
            before = reached
            until = r.until_offset
            for m in msgs:  # the hot loop: one pass per record, locals only
                err = m.error()
                if err is not None:
                    reached = _handle_error(consumer, r, err, m.offset(), reached)
                    if reached >= until:
                        break
                    continue
                off = m.offset()
                if off is None:
                    continue
                if off >= until:
                    reached = until
                    break
                if off < reached:  # never yield an offset twice
                    continue
                ts_type, ts = m.timestamp()
                chunk.offsets.append(off)
                chunk.timestamps.append(ts * 1000 if ts_type else None)
                chunk.timestamp_types.append(ts_type)
                chunk.keys.append(m.key())
                chunk.values.append(m.value())
                hdrs = m.headers()
                chunk.headers.append([{"key": h[0], "value": h[1]} for h in hdrs]
                                     if hdrs else None)
                reached = off + 1
                if len(chunk.offsets) >= max_rows:
                    yield chunk
                    chunk = RawChunk()
            if reached > before:
                last_progress = time.monotonic()
        if len(chunk):
            yield chunk
    finally:
        consumer.close()


def _watermarks(consumer: Consumer, r: OffsetRange) -> tuple[int, int]:
    try:
        lo, hi = consumer.get_watermark_offsets(KTopicPartition(r.topic, r.partition),
                                                timeout=10)
        return int(lo), int(hi)
    except KafkaException:
        return -1, -1


def _handle_error(consumer: Consumer, r: OffsetRange, err: KafkaError, at: int | None,
                  reached: int) -> int:
    code = err.code()
    if code == KafkaError._PARTITION_EOF:
        # Everything up to the end (the last stable offset under read_committed) is read;
        # the rest of the range was markers or aborted records.
        end = at if at is not None and at >= 0 else reached
        if end >= r.until_offset:
            return r.until_offset
        lo, hi = _watermarks(consumer, r)
        if hi < r.until_offset and hi >= 0:
            raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset, end,
                                 f"partition ends at {hi}; was the topic recreated or "
                                 f"truncated?")
        return max(reached, end)  # a transaction is still open: keep polling
    if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
        lo, hi = _watermarks(consumer, r)
        if lo > reached:
            raise DataLossError(r.topic, r.partition, reached, min(lo, r.until_offset),
                                "deleted before they were read (retention or delete-records)")
        raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset, reached,
                             f"offset out of range (partition offsets [{lo}, {hi})): {err}")
    if err.fatal() or code in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                               KafkaError.TOPIC_AUTHORIZATION_FAILED):
        raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset, reached,
                             str(err))
    log.warning("%s: transient Kafka error, retrying: %s", r, err)
    return reached
