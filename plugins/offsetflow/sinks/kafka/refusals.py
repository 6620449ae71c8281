"""What the broker refused of a Kafka sink's transaction, and why (the failure path of
`offsetflow.sinks.kafka.sink`; nothing here runs while records are produced).

A delivery report carries the failed message's partition, key and value, but no headers
(nor a timestamp), so `find_sources` reads the batch's records once more and finds each failed
message's source records by key and value digest. `judge` then tells a record refused for itself,
which no run can produce as it is (over the topic's size limit alone in its record batch,
a timestamp the topic refuses, a keyless record for a compacted topic: a `NotProduced` for
the dead-letter table), from records refused only with the record batch they were in, and
from errors no record causes (`refusal_error` names the record and the setting).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError

from offsetflow.config import KafkaSinkConfig
from offsetflow.ledger import Batch
from offsetflow.sinks.kafka.form import (
    record_headers,
    record_key,
    record_size,
    value_digest,
)
from offsetflow.sinks.kafka.limits import TopicSettings
from offsetflow.sinks.kafka.mark import BATCH_HEADER, SOURCE_HEADER, NotProduced
from offsetflow.sinks.kafka.txn import PURGED, Failed

Coordinates = tuple[str, int, int]
# a failed message's source record: its coordinates, record size and timestamp (ms or None)
Source = tuple[Coordinates, int, int | None, bool]

TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
REPLICAS = frozenset({KafkaError.NOT_ENOUGH_REPLICAS,
                      KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND})


def primary(failed: Iterable[Failed]) -> list[Failed]:
    """The reports of messages the broker or librdkafka refused (not those purged by the
    abort that followed)."""
    return [f for f in failed if f.code not in PURGED]


def find_sources(records: Iterable[Sequence[tuple[Any, ...]]], batch: Batch,
                 sink: KafkaSinkConfig, failed: Sequence[Failed],
                 encode: Callable[[str], bytes] | None = None, hex_keys: bool = True
                 ) -> dict[Failed, list[Source]]:
    """Each failed message's source records (several when staged rows make identical
    records, `judge` then tells them apart by their own size and timestamp): one read of
    the batch's records in chunks, as the produce loop reads them (`KafkaTopicSink.records`:
    the stage as `select_sql` builds them, keys as hex text, or the task files, keys as
    bytes: `hex_keys` False; `encode`: value_format avro's encoder, so a value is compared
    as it was produced; one that does not encode was never)."""
    wanted: dict[tuple[bytes | None, bytes | None], list[Failed]] = {}
    for f in failed:
        wanted.setdefault((f.key, f.value), []).append(f)
    found: dict[Failed, list[Source]] = {f: [] for f in failed}
    by_source = sink.partitioning == "source"
    for chunk in records:
        for s_topic, s_part, s_off, key, value, hdrs, ts in chunk:
            if hex_keys:
                key = record_key(key)
            if value is not None and not isinstance(value, str):
                value = bytes(value)
            elif value is not None and encode is not None:
                try:
                    value = encode(value)
                except ValueError:  # ValueDoesNotFit: left out, never produced
                    continue
            hits = wanted.get((key, value_digest(value)))
            if not hits:
                continue
            headers: list[tuple[str, Any]] = (
                [(BATCH_HEADER, str(batch.batch_id).encode()),
                 (SOURCE_HEADER, f"{s_topic}/{s_part}/{s_off}")]
                if hdrs is None else
                record_headers(batch.batch_id, s_topic, s_part, s_off, hdrs))
            src: Source = ((s_topic, s_part, s_off), record_size(key, value, headers),
                           ts, key is None)
            for f in hits:
                # a failed message's report has no timestamp (-1) as a rule
                if (not by_source or f.partition == s_part) and (
                        not ts or f.timestamp <= 0 or f.timestamp == ts):
                    found[f].append(src)
    return found


def judge(found: Mapping[Failed, Sequence[Source]], settings: TopicSettings,
          batch_bytes: int, bounds: tuple[int, int]) -> list[NotProduced]:
    """The source records refused for themselves, as NotProduced: over the size limit and
    larger than a record batch (`batch_bytes`: such a record is alone in its batch), a
    timestamp outside `bounds` (the topic's, with a margin for the time the pass took), a
    keyless record for a compacted topic. Records of the same failed record batch that are
    none of these are left out of it (they are produced again)."""
    out: dict[Coordinates, NotProduced] = {}
    lo, hi = bounds
    for f, sources in found.items():
        for coords, size, ts, keyless in sources:
            rec: NotProduced | None = None
            if f.code in TOO_LARGE and size > batch_bytes:
                rec = NotProduced(*coords, size, limit=settings.batch_limit)
            elif f.code == KafkaError.INVALID_TIMESTAMP and ts and not lo <= ts <= hi:
                rec = NotProduced(*coords, None, ts)
            elif f.code == KafkaError.INVALID_RECORD and keyless:
                rec = NotProduced(*coords, None)
            if rec is not None:
                out.setdefault(coords, rec)
    return [out[c] for c in sorted(out)]


def refusal_error(batch: Batch, topic: str, failed: Sequence[Failed],
                  found: Mapping[Failed, Sequence[Source]], settings: TopicSettings,
                  batch_bytes: int) -> str:
    """Why the broker refused the transaction's records when no record was refused for
    itself: the first failure, its source record (`topic/partition/offset`), the setting and
    the way out."""
    f = failed[0]
    srcs = found.get(f) or []
    named = ("record " + " or ".join(f"{c[0]}/{c[1]}/{c[2]}" for c, *_ in srcs[:3])
             if srcs else f"a record of partition {f.partition} (not found in the stage)")
    head = (f"batch {batch.batch_id}: producing to {topic} failed: the broker refused "
            f"{named} ({f.reason}; {len(failed)} records failed); nothing of the "
            f"transaction is visible")
    if f.code in TOO_LARGE:
        return (f"{head}. A record batch of {topic} was over its max.message.bytes "
                f"({settings.max_message_bytes}) or segment.bytes "
                f"({settings.segment_bytes}) though the sink's batch.size is {batch_bytes}: "
                f"raise max.message.bytes on {topic}, or lower sink.producer.batch.size")
    if f.code == KafkaError.INVALID_TIMESTAMP:
        return (f"{head}. {topic} refuses record timestamps outside its "
                f"message.timestamp.before.max.ms ({settings.before_max_ms}) / "
                f"message.timestamp.after.max.ms ({settings.after_max_ms}); raise them, or set "
                f"message.timestamp.type=LogAppendTime on {topic}")
    if f.code in REPLICAS or f.code == KafkaError._MSG_TIMED_OUT:
        return (f"{head}. Partition {topic}[{f.partition}] did not take the record in time: "
                f"with fewer in-sync replicas than the topic's min.insync.replicas "
                f"({settings.min_insync}) the broker refuses acks=all writes; bring the "
                f"replicas back in sync or lower min.insync.replicas, then run the batch again")
    if f.code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return (f"{head}. The sink's principal may not write to {topic}: grant it WRITE "
                f"(and DESCRIBE) on the topic")
    if f.code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC,
                  KafkaError._UNKNOWN_PARTITION):
        return (f"{head}. {topic} (or that partition) is gone: it was deleted or shrunk "
                f"while the batch ran; create it again before running the batch")
    return f"{head}; the next run produces the batch again"
