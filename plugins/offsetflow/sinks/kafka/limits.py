"""The Kafka topic sink's look-ups and routing around its transaction
(`offsetflow.sinks.kafka.sink`): what the broker allows (the output topic's settings it
enforces on produce, `TopicSettings`; the longest transaction) and the records the topic can
never take, moved to the dead-letter table in the ledger's transaction."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg2.extensions
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource
from psycopg2 import sql

from offsetflow.commit import LINEAGE_COLUMN, dead_letters_from
from offsetflow.config import PipelineConfig
from offsetflow.errors import KafkaSinkError, StagedRowsLostError
from offsetflow.ledger import Batch, qualified, stage_table
from offsetflow.sinks.kafka.form import BATCH_OVERHEAD, record_limit
from offsetflow.sinks.kafka.mark import NotProduced

log = logging.getLogger(__name__)

# transaction.timeout.ms unless sink.producer sets it: the broker's transaction.max.timeout.ms
# up to this (its default), so a big batch is not aborted by the broker half way; 5 min
# (librdkafka's default is 1 min) when the broker's setting cannot be read
TXN_TIMEOUT_CAP_MS = 900_000
TXN_TIMEOUT_FALLBACK_MS = 300_000


def broker_txn_timeout_ms(admin: AdminClient, batch: Batch, timeout_s: float) -> int:
    """The longest transaction the broker allows (transaction.max.timeout.ms), capped;
    a longer transaction.timeout.ms would fail init_transactions."""
    try:
        brokers = sorted(admin.list_topics(timeout=timeout_s).brokers)
        res = ConfigResource("broker", str(brokers[0]))
        entries = admin.describe_configs([res], request_timeout=timeout_s)[res].result(
            timeout=timeout_s)
        allowed = int(entries["transaction.max.timeout.ms"].value)
    # TimeoutError: the future's own wait can end before the request's timeout answers
    except (KafkaException, TimeoutError, KeyError, IndexError, ValueError, TypeError) as e:
        log.warning("batch %d: cannot read the broker's transaction.max.timeout.ms (%s); "
                    "transaction.timeout.ms is %d", batch.batch_id, e,
                    TXN_TIMEOUT_FALLBACK_MS)
        return TXN_TIMEOUT_FALLBACK_MS
    return min(allowed, TXN_TIMEOUT_CAP_MS)


# the topic-level settings `TopicSettings` reads (their broker-level defaults included:
# DescribeConfigs answers with the value in force)
TOPIC_CONFIGS = ("max.message.bytes", "segment.bytes", "cleanup.policy", "compression.type",
                 "message.timestamp.type", "message.timestamp.before.max.ms",
                 "message.timestamp.after.max.ms", "message.timestamp.difference.max.ms",
                 "min.insync.replicas")
LONG_MAX = 2**63 - 1
# the most key, value and coordinate bytes one statement routes to the dead-letter table
# (PostgreSQL refuses a statement over 1 GB; the literal is built in driver memory too)
DEAD_LETTER_CHUNK_BYTES = 8 << 20
# the broker checks a timestamp when it appends the record, on its own clock: a record
# this close to a bound is taken as refused (a retry later would be refused anyway)
TIMESTAMP_MARGIN_MS = 5_000
# the most a record batch grows when the broker compresses it into the topic's codec
# (librdkafka sends a batch uncompressed when compression would grow it; the broker then
# compresses it all the same), and the codec's own framing
CODEC_GROWTH = {"gzip": 1 / 1000, "snappy": 1 / 6, "lz4": 1 / 255, "zstd": 1 / 128}
CODEC_FRAMING = 64
PRODUCER_BATCH_BYTES = 1_000_000  # librdkafka's default batch.size


@dataclass(frozen=True)
class TopicSettings:
    """What the output topic's broker-side settings ask of what the sink produces, so that
    none of them refuses a batch on every run: the record batch size (`max.message.bytes`,
    and `segment.bytes`, which the broker also holds a batch to), the codec the broker
    stores (`compression.type`: a codec other than the producer's is recompressed by the
    broker and may grow), keyless records (`cleanup.policy=compact`), timestamps
    (`message.timestamp.*`) and the in-sync replicas acks=all needs
    (`min.insync.replicas`). None: not set, or the configs could not be read."""

    topic: str
    max_message_bytes: int | None = None
    segment_bytes: int | None = None
    compacted: bool = False
    codec: str | None = None  # the topic's compression.type when it names one ("none")
    log_append_time: bool = False
    before_max_ms: int | None = None  # None: no bound
    after_max_ms: int | None = None
    min_insync: int | None = None

    @staticmethod
    def parse(topic: str, entries: Mapping[str, str | None]) -> TopicSettings:
        """From DescribeConfigs' answer (name -> value)."""

        def num(name: str) -> int | None:
            v = entries.get(name)
            try:
                n = int(str(v))
            except ValueError:
                return None
            return None if n >= LONG_MAX or n < 0 else n

        diff = num("message.timestamp.difference.max.ms")  # before Kafka 4: both ways

        def bound(name: str) -> int | None:
            b = num(name)
            return b if diff is None else diff if b is None else min(b, diff)

        codec = str(entries.get("compression.type") or "producer").lower()
        return TopicSettings(
            topic=topic, max_message_bytes=num("max.message.bytes"),
            segment_bytes=num("segment.bytes"),
            compacted="compact" in str(entries.get("cleanup.policy") or ""),
            codec=None if codec == "producer" else "none" if codec == "uncompressed" else codec,
            log_append_time=str(entries.get("message.timestamp.type")) == "LogAppendTime",
            before_max_ms=bound("message.timestamp.before.max.ms"),
            after_max_ms=bound("message.timestamp.after.max.ms"),
            min_insync=num("min.insync.replicas"))

    @property
    def batch_limit(self) -> int | None:
        """The largest record batch the broker appends to the topic."""
        sizes = [s for s in (self.max_message_bytes, self.segment_bytes) if s is not None]
        return min(sizes) if sizes else None

    def stored_codec(self, producer: Mapping[str, Any]) -> str:
        """The codec the topic's batches are stored in: the topic's, else the producer's."""
        return self.codec or str(producer.get("compression.type",
                                              producer.get("compression.codec", "none")))

    def producer_settings(self, producer: Mapping[str, Any]) -> dict[str, Any]:
        """What the producer must use for this topic, over `sink.producer`: the topic's
        codec (the broker would recompress into it anyway, and a batch it recompresses
        may outgrow the limit), and `batch.size` capped so that a record batch, even
        recompressed by the broker, fits `batch_limit` (librdkafka's batches of up to 1 MB
        otherwise fail every run on a topic with a small max.message.bytes)."""
        out: dict[str, Any] = {}
        if self.codec is not None:
            out["compression.type"] = self.codec
        limit = self.batch_limit
        if limit is not None:
            cap = limit - BATCH_OVERHEAD
            if self.codec not in (None, "none"):
                cap = int((cap - CODEC_FRAMING) / (1 + CODEC_GROWTH.get(self.codec, 1 / 6)))
            wanted = int(producer.get("batch.size", PRODUCER_BATCH_BYTES))
            if wanted > cap:
                out["batch.size"] = max(1, cap)
        return out

    def record_limit(self, producer: Mapping[str, Any]) -> int:
        """The largest record the sink can produce (checked before producing): the
        producer's message.max.bytes, and the topic's batch limit unless the topic stores
        compressed batches (then the broker's answer decides; a record it refuses alone is
        found by the failure path)."""
        compressed = self.stored_codec(producer) != "none"
        return record_limit(producer, None if compressed else self.batch_limit)

    def timestamp_bounds(self, now_ms: int, margin_ms: int = TIMESTAMP_MARGIN_MS
                         ) -> tuple[int, int]:
        """The record timestamps (epoch ms) the topic takes now, `margin_ms` inside its
        bounds; every timestamp for a LogAppendTime topic (the broker stamps its own)."""
        if self.log_append_time:
            return -LONG_MAX, LONG_MAX
        lo = -LONG_MAX if self.before_max_ms is None else now_ms - self.before_max_ms + margin_ms
        hi = LONG_MAX if self.after_max_ms is None else now_ms + self.after_max_ms - margin_ms
        return lo, hi


def topic_settings(admin: AdminClient, batch: Batch, topic: str, timeout_s: float
                   ) -> TopicSettings:
    """The output topic's settings; none known when they cannot be read (no
    DescribeConfigs ACL, the topic not there): records are then checked against the
    producer's limits only, and the failure path names what the broker refuses."""
    try:
        futures = admin.describe_configs([ConfigResource("topic", topic)],
                                         request_timeout=timeout_s)
        entries = next(iter(futures.values())).result(timeout=timeout_s)
    except (KafkaException, TimeoutError) as e:  # (the future's wait can end first)
        log.warning("batch %d: cannot read the configs of %s (%s); records are checked "
                    "against the producer's message.max.bytes only", batch.batch_id,
                    topic, e)
        return TopicSettings(topic)
    return TopicSettings.parse(topic, {k: entries[k].value for k in TOPIC_CONFIGS
                                       if k in entries})


def route_not_produced(cur: psycopg2.extensions.cursor, cfg: PipelineConfig,
                       columns: Mapping[str, str], batch: Batch,
                       skipped: Sequence[NotProduced], topic: str, limit: int | None,
                       stage_gone: bool = False,
                       records: Mapping[tuple[str, int, int],
                                        tuple[bytes | None, bytes | None, int | None]]
                       | None = None) -> None:
    """The left-out records, with their source key and value, into the dead-letter
    table in the ledger's transaction. `stage_gone` (`offsetflow complete`): the stage and
    the Kafka records are lost, so only what the commit's metadata names is left: their
    coordinates and sizes, with an error saying the key and value are gone. `records`:
    the batch's records are in task files, not the stage (`KafkaTopicSink.left_out`): each
    left-out record's key, value and timestamp (ms) as built for the topic."""
    if not skipped:
        return
    if not (cfg.bad_records == "dead_letter" and cfg.dead_letter_table):
        raise KafkaSinkError(
            f"batch {batch.batch_id}: its Kafka transaction left out {len(skipped)} "
            f"records for the dead-letter table (first: {skipped[0].topic}/"
            f"{skipped[0].partition}/{skipped[0].offset}), but the pipeline no longer "
            f"has bad_records: dead_letter; restore it to complete the batch")

    # every left-out record's key and value in one literal would be refused past ~500 MB
    # (after the Kafka commit, on every rerun: a wedge): statements of bounded size instead
    for chunk in _bounded_chunks(skipped, records):
        _route_chunk(cur, cfg, columns, batch, chunk, topic, limit, stage_gone, records)


def _bounded_chunks(skipped: Sequence[NotProduced],
                    records: Mapping[tuple[str, int, int],
                                     tuple[bytes | None, bytes | None, int | None]] | None
                    ) -> Iterator[list[NotProduced]]:
    """`skipped` in runs whose keys and values (from `records`) and coordinates take at
    most `DEAD_LETTER_CHUNK_BYTES` (at least one record each)."""
    chunk: list[NotProduced] = []
    size = 0
    for r in skipped:
        got = records.get((r.topic, r.partition, r.offset)) if records else None
        n = 2 * (len(got[0] or b"") + len(got[1] or b"")) if got else 0  # hex in the literal
        n += len(r.topic) + 256  # coordinates and error text
        if chunk and size + n > DEAD_LETTER_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(r)
        size += n
    if chunk:
        yield chunk


def _arr(values: list[Any], pg_type: str) -> sql.Composable:
    return sql.SQL("{}::{}[]").format(sql.Literal(values), sql.SQL(pg_type))


def _route_chunk(cur: psycopg2.extensions.cursor, cfg: PipelineConfig,
                 columns: Mapping[str, str], batch: Batch, skipped: Sequence[NotProduced],
                 topic: str, limit: int | None, stage_gone: bool,
                 records: Mapping[tuple[str, int, int],
                                  tuple[bytes | None, bytes | None, int | None]] | None) -> None:
    """One bounded run of `route_not_produced`'s records into the dead-letter table."""
    if stage_gone:
        gone = ("; its key and value are gone (the stage and the source records were lost "
                "before the ledger's commit; the batch was completed by offsetflow complete)")
        src = sql.SQL("unnest({t}, {p}, {o}, {e}) AS s(topic, partition, \"offset\", error)"
                      ).format(t=_arr([r.topic for r in skipped], "text"),
                               p=_arr([r.partition for r in skipped], "int"),
                               o=_arr([r.offset for r in skipped], "bigint"),
                               e=_arr([r.error(topic, limit) + gone for r in skipped], "text"))
        dead_letters_from(cur, batch, cfg.dead_letter_table, src, [], sql.SQL("true"),
                          sql.SQL("s.error"), "sink")
        return
    if records:
        missing = [r for r in skipped if (r.topic, r.partition, r.offset) not in records]
        if missing:
            raise StagedRowsLostError(batch.batch_id, None, f"{len(missing)} records the "
                                                            f"Kafka transaction left out are "
                                                            f"not in the batch's task files "
                                                            f"(first: {missing[0].topic}/"
                                                            f"{missing[0].partition}/"
                                                            f"{missing[0].offset})")
        got = [records[(r.topic, r.partition, r.offset)] for r in skipped]
        src = sql.SQL("unnest({t}, {p}, {o}, {k}, {v}, {ts}, {e}) AS s(topic, partition, "
                      "\"offset\", key, value, ms, error)").format(
            t=_arr([r.topic for r in skipped], "text"),
            p=_arr([r.partition for r in skipped], "int"),
            o=_arr([r.offset for r in skipped], "bigint"),
            k=_arr([g[0] for g in got], "bytea"), v=_arr([g[1] for g in got], "bytea"),
            ts=_arr([g[2] for g in got], "bigint"),
            e=_arr([r.error(topic, limit) for r in skipped], "text"))
        src = sql.SQL("(SELECT topic, partition, \"offset\", key, value, error, "
                      "to_timestamp(ms / 1000.0) AS \"timestamp\" FROM {}) s").format(src)
        dead_letters_from(cur, batch, cfg.dead_letter_table, src,
                          ["timestamp", "key", "value"], sql.SQL("true"),
                          sql.SQL("s.error"), "sink")
        return
    src = sql.SQL(
        "{st} s JOIN unnest({t}, {p}, {o}, {e}) AS r(topic, partition, off, error) "
        "ON s.topic = r.topic AND s.partition = r.partition AND s.\"offset\" = r.off"
    ).format(st=stage_table(batch.batch_id), t=_arr([r.topic for r in skipped], "text"),
             p=_arr([r.partition for r in skipped], "int"),
             o=_arr([r.offset for r in skipped], "bigint"),
             e=_arr([r.error(topic, limit) for r in skipped], "text"))
    # a transform's non-bytea key or value stays out (the coordinates name the record)
    cols = [c for c in columns if c not in ("key", "value") or columns[c] == "bytea"]
    n = dead_letters_from(cur, batch, cfg.dead_letter_table, src, cols,
                          sql.SQL("true"), sql.SQL("r.error"), "sink")
    if n != len(skipped):
        raise StagedRowsLostError(batch.batch_id, None, f"{len(skipped)} records the "
                                                        f"Kafka transaction left out, "
                                                        f"{n} of them in the stage")


def replace_window_dead_letters(cur: psycopg2.extensions.cursor, cfg: PipelineConfig,
                                batch: Batch) -> int:
    """A replay or backfill batch's dead letters replace those that earlier replays and
    backfills of its ranges into the same side topic (the batch's `target_table`,
    `kafka:<topic>`) left, in the ledger's transaction, as a replay replaces its window's
    dead letters in a table. The live batches' stay: the live topic still lacks those
    records (a replay into a side topic does not touch it), and so do another side
    topic's. Nor those of an earlier window of another incarnation of the source topic
    (its ranges' Kafka ids differ, as `check_window_repeat` tells them apart): those are
    other records, which that replay left out of the side topic. Returns how many were
    removed."""
    dl = cfg.dead_letter_table
    if batch.kind not in ("replay", "backfill") or not dl:
        return 0
    cur.execute("SELECT to_regclass(%s)", (dl,))
    row = cur.fetchone()
    if row is None or row[0] is None:
        return 0
    removed = 0
    for r in batch.ranges:
        cur.execute(sql.SQL(
            "DELETE FROM {dl} d USING offsetflow.batches b, offsetflow.batch_ranges br, "
            "offsetflow.batch_ranges cr WHERE d.{lin} = b.batch_id "
            "AND b.pipeline = %s AND b.target_table = %s AND b.kind IN ('replay', 'backfill') "
            "AND b.batch_id <> %s AND d.pipeline = %s AND d.topic = %s AND d.partition = %s "
            "AND d.\"offset\" >= %s AND d.\"offset\" < %s "
            # the same incarnation of the source topic (an unknown id: taken for the same)
            "AND br.batch_id = b.batch_id AND br.topic = d.topic "
            "AND br.partition = d.partition AND br.from_offset <= d.\"offset\" "
            "AND br.until_offset > d.\"offset\" AND cr.batch_id = %s AND cr.topic = d.topic "
            "AND cr.partition = d.partition AND cr.from_offset <= d.\"offset\" "
            "AND cr.until_offset > d.\"offset\" AND (br.topic_id IS NULL "
            "OR cr.topic_id IS NULL OR br.topic_id = cr.topic_id)").format(
                dl=qualified(dl), lin=sql.Identifier(LINEAGE_COLUMN)),
            (batch.pipeline, batch.target_table, batch.batch_id, batch.pipeline, r.topic,
             r.partition, r.from_offset, r.until_offset, batch.batch_id))
        removed += cur.rowcount
    if removed:
        log.info("batch %d: %d dead letters of earlier %s windows into %s replaced",
                 batch.batch_id, removed, batch.kind, batch.target_table)
    return removed


def note_output_partitions(cur: psycopg2.extensions.cursor, batch: Batch, topic: str,
                           partitions: int, by_key: bool) -> None:
    """Record in the batch's params (the ledger's transaction) how many partitions the
    output topic had when the batch wrote it, and warn when that differs from the last
    committed batch's record: under `partitioning: key` a key's records from here on go to
    another partition than its earlier ones (Kafka's rule for keyed topics, as the Java
    producer does: nothing lost or doubled, but per-key order and compaction across the
    change are gone); grown or recreated by hand, the topic is the operator's to judge."""
    cur.execute("""SELECT batch_id, (params->'kafka_output'->>'partitions')::int
                     FROM offsetflow.batches
                    WHERE pipeline = %s AND status = 'committed' AND batch_id <> %s
                      AND params->'kafka_output'->>'topic' = %s
                    ORDER BY batch_id DESC LIMIT 1""", (batch.pipeline, batch.batch_id, topic))
    row = cur.fetchone()
    if row is not None and int(row[1]) != partitions:
        log.warning("batch %d: output topic %s has %d partitions, %d when batch %d wrote it%s",
                    batch.batch_id, topic, partitions, int(row[1]), int(row[0]),
                    "; with partitioning: key, a key's records from this batch on go to "
                    "another partition than its earlier ones (per-key order and compaction "
                    "do not span the change)" if by_key else "")
    cur.execute("""UPDATE offsetflow.batches
                      SET params = params || jsonb_build_object('kafka_output',
                                   jsonb_build_object('topic', %s::text, 'partitions', %s::int))
                    WHERE batch_id = %s""", (topic, partitions, batch.batch_id))


def refuse_window_repeat(cur: psycopg2.extensions.cursor, batch: Batch, topic: str) -> None:
    """Before a replay or backfill batch produces: refuse it when committed replays or
    backfills already wrote its window into the same side topic (the same incarnation of
    the source topic, a range that staged something) and it was not planned with
    allow_duplicates. Planning refuses such a window (`check_window_repeat`); this catches
    a batch planned before that refusal existed, which would otherwise put the window into
    the topic a second time (Kafka cannot delete it)."""
    if batch.kind not in ("replay", "backfill") or batch.params.get("allow_duplicates"):
        return
    cur.execute("""SELECT b.batch_id, cr.topic, cr.partition,
                          greatest(br.from_offset, cr.from_offset),
                          least(br.until_offset, cr.until_offset)
                     FROM offsetflow.batch_ranges cr
                     JOIN offsetflow.batch_ranges br
                       ON br.topic = cr.topic AND br.partition = cr.partition
                      AND br.from_offset < cr.until_offset AND br.until_offset > cr.from_offset
                      AND COALESCE(br.records, 1) > 0
                      AND (br.topic_id IS NULL OR cr.topic_id IS NULL
                           OR br.topic_id = cr.topic_id)
                     JOIN offsetflow.batches b ON b.batch_id = br.batch_id
                    WHERE cr.batch_id = %s AND b.batch_id <> %s AND b.pipeline = %s
                      AND b.status = 'committed' AND b.kind IN ('replay', 'backfill')
                      AND b.target_table = %s
                    ORDER BY 1, 2, 3 LIMIT 5""",
                (batch.batch_id, batch.batch_id, batch.pipeline, batch.target_table))
    rows = cur.fetchall()
    if not rows:
        return
    bid = rows[0][0]
    what = "; ".join(f"{t}[{p}] [{lo}, {hi})" for b, t, p, lo, hi in rows if b == bid)
    raise KafkaSinkError(
        f"{batch.kind} batch {batch.batch_id} would write records to {topic} a second time: "
        f"batch {bid} already wrote {what} there, and Kafka cannot delete them (the batch "
        f"was planned before such a window was refused, and not with allow_duplicates). "
        f"Abandon it (offsetflow abandon --batch-id {batch.batch_id}); read the window "
        f"where batch {bid} put it, or ask for it again into another sink.replay_topic, or "
        f"with allow_duplicates to write it there twice anyway")
