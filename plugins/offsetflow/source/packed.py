"""Read a packed task's small OffsetRanges all at once, with one consumer assigned to every
one of them (issue 19: 1,000 partitions x 10 records).

Read one after the other, each range cost an assign and a fetch round trip (~2 ms) before
its first record: 1,000 ranges spent 2.25 task-seconds reading 10,000 records. Assigned
together, the broker answers one fetch with records of many partitions. Each range keeps
the guarantees of `reader.read_range`: its records in offset order, none twice, none at or
past `until_offset`, gaps (transaction markers, aborted or compacted records) crossed,
the end of the partition before `until_offset` or a deleted start an error naming the
range. A range read to its end is paused, so the consumer stops fetching it.

Chunks hold rows of several ranges (each row's topic and partition in `RawChunk.topics` /
`partitions`), cut at the same row and byte bounds as a single range's, so what follows
(deserialize, Arrow, COPY) runs once per chunk, not once per range.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KTopicPartition

from offsetflow.errors import InvalidRangeError
from offsetflow.ranges import OffsetRange
from offsetflow.source.chunk import RawChunk, append_record
from offsetflow.source.reader import (
    MAX_CHUNK_BYTES,
    MAX_CHUNK_ROWS,
    Backoff,
    check_stall,
    consume_size,
    handle_error,
)


@dataclass
class _Open:
    """A range still being read: every offset below `reached` is accounted for."""

    r: OffsetRange
    reached: int
    backoff: Backoff


def _new_chunk() -> RawChunk:
    return RawChunk(topics=[], partitions=[])


def read_ranges(consumer: Consumer, ranges: Sequence[OffsetRange],
                max_rows: int = MAX_CHUNK_ROWS, poll_timeout_s: float = 1.0,
                stall_timeout_s: float = 300.0, max_bytes: int = MAX_CHUNK_BYTES
                ) -> Iterator[RawChunk]:
    """Yield the records of `ranges` (one per topic-partition) in chunks of at most
    `max_rows` records and about `max_bytes`; within a partition in offset order. The
    consumer (`reader.range_consumer(shared=True)`) is left with no assignment, nothing
    paused, so it can read the next range (`reader.read_range(consumer=...)`)."""
    todo: dict[tuple[str, int], _Open] = {}
    for r in ranges:
        if r.is_empty:
            continue
        if r.topic_partition in todo:
            raise InvalidRangeError(f"{r.topic}[{r.partition}] is read twice in one pass "
                                    f"({todo[r.topic_partition].r} and {r})")
        todo[r.topic_partition] = _Open(r, r.from_offset, Backoff(stall_timeout_s))
    if not todo:
        return
    consumer.assign([KTopicPartition(o.r.topic, o.r.partition, o.r.from_offset)
                     for o in todo.values()])

    paused: list[KTopicPartition] = []

    def done(o: _Open) -> None:
        del todo[o.r.topic_partition]
        paused.append(KTopicPartition(o.r.topic, o.r.partition))
        consumer.pause(paused[-1:])

    try:
        yield from _consume(consumer, todo, done, max_rows, poll_timeout_s, stall_timeout_s,
                            max_bytes)
    finally:
        _release(consumer, paused)


def _release(consumer: Consumer, paused: list[KTopicPartition]) -> None:
    """Leave the consumer with no assignment, nothing paused. A reader abandoned part-way
    (its task failed) may be closed only after its consumer was (when the exception's
    traceback, which holds it, goes): a closed consumer has nothing left to undo, and an
    error here would hide the one that stopped the task (or print as "Exception ignored"
    from the garbage collector)."""
    try:
        consumer.unassign()
        if paused:
            consumer.resume(paused)
    except RuntimeError as e:  # confluent-kafka's "Consumer closed"
        if "closed" not in str(e):
            raise


def _consume(consumer: Consumer, todo: dict[tuple[str, int], _Open],
             done: Callable[[_Open], None], max_rows: int, poll_timeout_s: float,
             stall_timeout_s: float, max_bytes: int) -> Iterator[RawChunk]:
    """The body of `read_ranges`: until every range in `todo` is `done`."""
    left = sum(o.r.until_offset - o.reached for o in todo.values())  # not accounted for
    chunk = _new_chunk()
    assert chunk.topics is not None and chunk.partitions is not None
    last_progress = time.monotonic()
    anyone = Backoff(stall_timeout_s)  # errors of no partition
    seen_records = seen_bytes = 0
    while todo:
        want = consume_size(max_rows - len(chunk), max_bytes - chunk.nbytes, left,
                            seen_records, seen_bytes)
        msgs = consumer.consume(num_messages=want, timeout=poll_timeout_s)
        if not msgs:
            first = next(iter(todo.values()))
            check_stall(consumer, first.r, first.reached, last_progress, stall_timeout_s)
            continue
        before = left
        for m in msgs:
            topic, err = m.topic(), m.error()
            if err is not None and topic is None:  # concerns every range: the first names it
                first = next(iter(todo.values()))
                handle_error(consumer, first.r, err, None, first.reached, anyone)
                continue
            o = todo.get((topic, m.partition()))  # type: ignore[arg-type]
            if o is None:  # a range read to its end (what its last fetch held), or foreign
                continue
            until = o.r.until_offset
            if err is not None:
                reached = handle_error(consumer, o.r, err, m.offset(), o.reached, o.backoff)
                left -= min(reached, until) - o.reached
                o.reached = reached
                if reached >= until:
                    done(o)
                continue
            off = m.offset()
            if off is None:
                continue
            if off >= until:
                left -= until - o.reached
                o.reached = until
                done(o)
                continue
            if off < o.reached:  # never yield an offset twice
                continue
            nb = append_record(chunk, m, off)
            chunk.topics.append(o.r.topic)
            chunk.partitions.append(o.r.partition)
            seen_bytes += nb
            seen_records += 1
            left -= off + 1 - o.reached
            o.reached = off + 1
            if o.reached >= until:
                done(o)
            if len(chunk.offsets) >= max_rows or chunk.nbytes >= max_bytes:
                yield chunk
                chunk = _new_chunk()
                assert chunk.topics is not None and chunk.partitions is not None
        if left < before:
            last_progress = time.monotonic()
            anyone.reset()
            for o in todo.values():
                o.backoff.reset()
    if len(chunk):
        yield chunk
