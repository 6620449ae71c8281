"""Read exactly one OffsetRange with a confluent-kafka consumer that assigns and seeks.
A task reading several small ranges (`offsetflow.stage.packing`) passes one consumer
(`range_consumer`) to each `read_range` in turn: per range it costs an assign, not a
consumer (with its connections and metadata). Large ranges get a consumer each: see
`SHARED_MAX_SPAN`.

The KafkaRDD of the direct approach, as a plain iterator of Arrow record batches so it
runs inside Spark's `mapInArrow` (and in tests without Spark). Preconditions as in
KafkaRDD: no group subscription, no auto-commit, `auto.offset.reset` = error.

Gaps are normal (transaction markers, aborted or compacted records): reading stops at
`until_offset` and never waits for an offset that cannot come. Reaching the end of the
partition before `until_offset`, or finding the start deleted, is an error.

What a record becomes in a chunk (and in Arrow), and which records are refused, is
`offsetflow.source.chunk`; here: the consumer, the read loop, and Kafka's errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTopicPartition

from offsetflow.errors import DataLossError, RangeReadError
from offsetflow.ranges import OffsetRange
from offsetflow.source.chunk import RawChunk, append_record
from offsetflow.source.retry import RETRIABLE_CODES

log = logging.getLogger(__name__)

REQUIRED_SETTINGS = {"enable.auto.commit": "false", "auto.offset.reset": "error"}
# A chunk is cut at whichever comes first: rows or bytes of keys + values + header names and
# values. The byte cap keeps a task's memory flat and every Arrow array far below its 2 GiB
# offsets limit when records are large (1 MB records x 20,000 rows would be 20 GB); a chunk
# exceeds it by one record at most. One consume() call asks for no more records than the
# chunk has room for (by the range's average record size so far; the first asks for
# FIRST_CONSUME), since what it returns is in memory next to the chunk.
MAX_CHUNK_ROWS = 20_000
MAX_CHUNK_BYTES = 64 << 20
MAX_CONSUME = 10_000
FIRST_CONSUME = 8
# A consumer shared by a task's ranges switches partitions with assign(); the fetch left
# outstanding for the partition it read up to the log end is long-polled by the broker for
# fetch.wait.max.ms (500 ms by default) before the next partition's fetch goes out, which made
# every switch cost half a second. The shared consumer waits SHARED_FETCH_WAIT_MS instead
# (a pipeline's client.fetch.wait.max.ms wins): ~3 ms a switch, against ~6 ms for a fresh
# consumer locally and far more against a remote TLS cluster. While it sits at a log end it
# then fetches every few ms, so only ranges of up to SHARED_MAX_SPAN offsets share it (read
# in milliseconds); a larger range gets a consumer of its own with the default wait.
SHARED_FETCH_WAIT_MS = 2
SHARED_MAX_SPAN = 10_000
# glibc gives a thread that finds the arenas in use one of its own, up to 8 per core, and
# every consumer starts librdkafka threads (a main thread, one per broker) that allocate its
# fetches there. Memory freed in an arena mostly stays mapped, so a Spark Python worker that
# runs task after task, each with new consumer threads, carried ~100-150 MB of such arenas
# over its ~300 MB (10M records: 480-514 MB peak; with 2 arenas 386). The reader caps the
# process at MALLOC_ARENAS before its first consumer (an explicit MALLOC_ARENA_MAX wins).
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt(3)
# Transient errors (leader moving, broker restarting): retried with exponential backoff for
# as long as a read may stall (`stall_timeout_s`)
RETRY_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def consumer_conf(conf: Mapping[str, str]) -> dict[str, str]:
    """The pipeline's consumer settings as the reader uses them. Records larger than
    `max.partition.fetch.bytes` (1 MB) still come, one batch per fetch (KIP-74), so a
    10 MB record needs no setting; the prefetch queue is bounded (librdkafka's default,
    stated here so a task's memory is: chunk + queue + one fetch)."""
    out = dict(conf)
    out.setdefault("queued.max.messages.kbytes", str(64 << 10))
    return out


@dataclass
class Backoff:
    """Bounded exponential backoff for transient errors: `wait()` sleeps the next step, or
    returns False once errors have come for `limit_s` without progress (`reset()`)."""

    limit_s: float
    steps: tuple[float, ...] = RETRY_BACKOFF_S
    failures: int = 0
    since: float | None = None

    def wait(self) -> bool:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif now - self.since > self.limit_s:
            return False
        time.sleep(self.steps[min(self.failures, len(self.steps) - 1)])
        self.failures += 1
        return True

    def reset(self) -> None:
        self.failures, self.since = 0, None


def consume_size(room_rows: int, room_bytes: int, left_in_range: int, seen_records: int,
                 seen_bytes: int) -> int:
    """How many records to ask one consume() call for: what the chunk has room for, in rows
    and (by the average record size seen so far) in bytes, never more than the range can
    still hold (consume() waits for them or its timeout), at least one."""
    want = min(room_rows, MAX_CONSUME, left_in_range)
    if seen_records == 0:
        want = min(want, FIRST_CONSUME)
    elif seen_bytes > 0:
        want = min(want, room_bytes * seen_records // seen_bytes)
    return max(1, want)


def check_preconditions(conf: Mapping[str, str]) -> None:
    """Refuse consumer settings that would let Kafka, not the ledger, decide offsets."""
    for k, v in REQUIRED_SETTINGS.items():
        if str(conf.get(k, "")).lower() != v:
            raise ValueError(f"reader consumer needs {k}={v}, got {conf.get(k)!r}")


_arenas_capped: bool | None = None


def cap_malloc_arenas(n: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas of this process at `n` (see MALLOC_ARENAS), once; False
    where that cannot be done (not glibc) or MALLOC_ARENA_MAX already decides. glibc fixes
    the cap when a thread first needs a new arena past its default test count, so this
    runs before the process's first consumer starts threads."""
    global _arenas_capped
    if _arenas_capped is None:
        _arenas_capped = False
        if sys.platform.startswith("linux") and "MALLOC_ARENA_MAX" not in os.environ:
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):  # not glibc (musl has no mallopt arenas)
                return False
            mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            _arenas_capped = mallopt(_M_ARENA_MAX, n) == 1
    return _arenas_capped


@contextlib.contextmanager
def range_consumer(conf: Mapping[str, str], shared: bool = False) -> Iterator[Consumer]:
    """A consumer for reading ranges; `shared`: one after the other, small ones
    (`read_range(consumer=...)`, see SHARED_FETCH_WAIT_MS)."""
    check_preconditions(conf)
    cap_malloc_arenas()
    settings = consumer_conf(conf)
    if shared:
        settings.setdefault("fetch.wait.max.ms", str(SHARED_FETCH_WAIT_MS))
    consumer = Consumer(settings)
    try:
        yield consumer
    finally:
        consumer.close()


def read_range(conf: Mapping[str, str], r: OffsetRange, max_rows: int = MAX_CHUNK_ROWS,
               poll_timeout_s: float = 1.0, stall_timeout_s: float = 300.0,
               max_bytes: int = MAX_CHUNK_BYTES, consumer: Consumer | None = None
               ) -> Iterator[RawChunk]:
    """Yield the records of `r` in offset order, in chunks of at most `max_rows` records
    and about `max_bytes` of keys, values and headers (a chunk ends after the record that
    passes it). With `consumer` (`range_consumer`), that one is assigned to `r` (its
    previous assignment ends) and left open, else one of its own is made and closed.
    A record whose timestamp cannot be written is kept, with its reason in `refused`."""
    if r.is_empty:
        return
    with contextlib.ExitStack() as own:
        if consumer is None:
            consumer = own.enter_context(range_consumer(conf))
        else:
            check_preconditions(conf)
        yield from _read(consumer, r, max_rows, poll_timeout_s, stall_timeout_s, max_bytes)


def _foreign(m: Any, r: OffsetRange) -> bool:
    """A record or partition event (end of partition, say) of another partition than `r`'s;
    errors of no partition (topic None) concern every range."""
    topic = m.topic()
    return topic is not None and (topic != r.topic or m.partition() != r.partition)


def _other_partition(msgs: list[Any], r: OffsetRange) -> bool:
    """Whether a consume() batch may hold a record or event of a range read before `r` on
    the same consumer. librdkafka discards what it fetched for an old assignment; this
    checks that it did, per batch, not per record (its first and last message: what is
    left of an old assignment comes first)."""
    return _foreign(msgs[0], r) or _foreign(msgs[-1], r)


def _read(consumer: Consumer, r: OffsetRange, max_rows: int, poll_timeout_s: float,
          stall_timeout_s: float, max_bytes: int) -> Iterator[RawChunk]:
    """The body of `read_range`, on a consumer it may not own."""
    consumer.assign([KTopicPartition(r.topic, r.partition, r.from_offset)])
    chunk = RawChunk()
    reached = r.from_offset  # every offset below this is accounted for
    last_progress = time.monotonic()
    backoff = Backoff(stall_timeout_s)
    seen_records = seen_bytes = 0
    while reached < r.until_offset:
        want = consume_size(max_rows - len(chunk), max_bytes - chunk.nbytes,
                            r.until_offset - reached, seen_records, seen_bytes)
        msgs = consumer.consume(num_messages=want, timeout=poll_timeout_s)
        if not msgs:
            check_stall(consumer, r, reached, last_progress, stall_timeout_s)
            continue
        if _other_partition(msgs, r):
            msgs = [m for m in msgs if not _foreign(m, r)]
        before = reached
        until = r.until_offset
        for m in msgs:  # the hot loop: one pass per record, locals only
            err = m.error()
            if err is not None:
                reached = handle_error(consumer, r, err, m.offset(), reached, backoff)
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
            nb = append_record(chunk, m, off)
            seen_bytes += nb
            seen_records += 1
            reached = off + 1
            if len(chunk.offsets) >= max_rows or chunk.nbytes >= max_bytes:
                yield chunk
                chunk = RawChunk()
        if reached > before:
            last_progress = time.monotonic()
            backoff.reset()
    if len(chunk):
        yield chunk


def check_stall(consumer: Consumer, r: OffsetRange, reached: int, last_progress: float,
                stall_timeout_s: float) -> None:
    """After a consume() that returned nothing: warn every 30 s, and give up on `r` (at
    `reached`) once nothing came for `stall_timeout_s`."""
    stalled = time.monotonic() - last_progress
    if stalled > 30 and int(stalled) % 30 == 0:
        log.warning("%s: no record for %.0fs at offset %d (broker restarting or "
                    "leader moving?); still waiting", r, stalled, reached)
    if stalled > stall_timeout_s:
        lo, hi = watermarks(consumer, r)
        raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset,
                             reached, f"no progress for {stall_timeout_s:.0f}s "
                                      f"(partition offsets now [{lo}, {hi}))")


def watermarks(consumer: Consumer, r: OffsetRange, limit_s: float = 5.0) -> tuple[int, int]:
    """Low and high watermark, retried with backoff; (-1, -1) if the broker never answers
    (callers use them for diagnostics and treat -1 as unknown)."""
    backoff = Backoff(limit_s)
    while True:
        try:
            lo, hi = consumer.get_watermark_offsets(KTopicPartition(r.topic, r.partition),
                                                    timeout=10)
            return int(lo), int(hi)
        except KafkaException as e:
            if not _retriable(e.args[0]) or not backoff.wait():
                log.warning("%s: no watermarks from the broker: %s", r, e)
                return -1, -1


# planning's "ask again" codes, plus those only a fetch sees (a replica set below
# min.insync.replicas, a broker's disk error while a leader moves)
TRANSIENT = RETRIABLE_CODES | frozenset({
    KafkaError.NETWORK_EXCEPTION, KafkaError.NOT_ENOUGH_REPLICAS, KafkaError._MSG_TIMED_OUT,
    KafkaError.KAFKA_STORAGE_ERROR})


def _retriable(err: object) -> bool:
    if not isinstance(err, KafkaError):
        return False
    return bool(err.retriable()) or err.code() in TRANSIENT


def handle_error(consumer: Consumer, r: OffsetRange, err: KafkaError, at: int | None,
                  reached: int, backoff: Backoff | None = None) -> int:
    code = err.code()
    if code == KafkaError._PARTITION_EOF:
        # Everything up to the end (the last stable offset under read_committed) is read;
        # the rest of the range was markers or aborted records.
        end = at if at is not None and at >= 0 else reached
        if end >= r.until_offset:
            return r.until_offset
        lo, hi = watermarks(consumer, r)
        if hi < r.until_offset and hi >= 0:
            raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset, end,
                                 f"partition ends at {hi}; was the topic recreated or "
                                 f"truncated?")
        return max(reached, end)  # a transaction is still open: keep polling
    if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
        lo, hi = watermarks(consumer, r)
        if lo > reached:
            raise DataLossError(r.topic, r.partition, reached, min(lo, r.until_offset),
                                "deleted before they were read (retention or delete-records)")
        raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset, reached,
                             f"offset out of range (partition offsets [{lo}, {hi})): {err}")
    if err.fatal() or code in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                               KafkaError.TOPIC_AUTHORIZATION_FAILED):
        raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset, reached,
                             str(err))
    # leader moving, broker restarting, a timeout: librdkafka retries the fetch itself;
    # wait a little longer each time this surfaces, and give up after a bound
    backoff = backoff or Backoff(300.0)
    log.warning("%s: transient Kafka error (%d in a row), retrying: %s", r,
                backoff.failures + 1, err)
    if not backoff.wait():
        raise RangeReadError(r.topic, r.partition, r.from_offset, r.until_offset, reached,
                             f"transient Kafka errors for {backoff.limit_s:.0f}s without "
                             f"progress ({backoff.failures} retries), last: {err}")
    return reached
