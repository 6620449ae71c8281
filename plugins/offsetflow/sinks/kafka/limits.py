"""The Kafka topic sink's look-ups and routing around its transaction
(`offsetflow.sinks.kafka.sink`): what the broker allows (the record size limit and compaction of
the output topic, the longest transaction) and the records the topic can never take, moved
to the dead-letter table in the ledger's transaction."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg2.extensions
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource
from psycopg2 import sql

from offsetflow.commit import dead_letters_from
from offsetflow.config import PipelineConfig
from offsetflow.errors import KafkaSinkError, StagedRowsLostError
from offsetflow.ledger import Batch, stage_table
from offsetflow.sinks.kafka.form import record_limit
from offsetflow.sinks.kafka.mark import NotProduced

log = logging.getLogger(__name__)

# transaction.timeout.ms unless sink.producer sets it: the broker's transaction.max.timeout.ms
# up to this (its default), so a big batch is not aborted by the broker half way; 5 min
# (librdkafka's default is 1 min) when the broker's setting cannot be read
TXN_TIMEOUT_CAP_MS = 900_000
TXN_TIMEOUT_FALLBACK_MS = 300_000


def broker_txn_timeout_ms(cfg: PipelineConfig, batch: Batch, timeout_s: float) -> int:
    """The longest transaction the broker allows (transaction.max.timeout.ms), capped;
    a longer transaction.timeout.ms would fail init_transactions."""
    admin = AdminClient(dict(cfg.admin_settings()))  # type: ignore[arg-type]
    try:
        brokers = sorted(admin.list_topics(timeout=timeout_s).brokers)
        res = ConfigResource("broker", str(brokers[0]))
        entries = admin.describe_configs([res], request_timeout=timeout_s)[res].result(
            timeout=timeout_s)
        allowed = int(entries["transaction.max.timeout.ms"].value)
    except (KafkaException, KeyError, IndexError, ValueError, TypeError) as e:
        log.warning("batch %d: cannot read the broker's transaction.max.timeout.ms (%s); "
                    "transaction.timeout.ms is %d", batch.batch_id, e,
                    TXN_TIMEOUT_FALLBACK_MS)
        return TXN_TIMEOUT_FALLBACK_MS
    return min(allowed, TXN_TIMEOUT_CAP_MS)


def topic_limits(cfg: PipelineConfig, batch: Batch, topic: str, timeout_s: float
                 ) -> tuple[int, bool]:
    """The record size limit for `topic` and whether it is compacted (then a keyless
    record is refused by the broker, which aborts the whole transaction)."""
    assert cfg.sink.kafka is not None
    producer = cfg.sink.kafka.producer
    admin = AdminClient(dict(cfg.admin_settings()))  # type: ignore[arg-type]
    try:
        futures = admin.describe_configs([ConfigResource("topic", topic)],
                                         request_timeout=timeout_s)
        entries = next(iter(futures.values())).result(timeout=timeout_s)
    except KafkaException as e:  # e.g. no DescribeConfigs ACL: the producer's limit
        log.warning("batch %d: cannot read the configs of %s (%s); records are checked "
                    "against the producer's message.max.bytes only", batch.batch_id,
                    topic, e)
        return record_limit(producer, None), False
    tmax, policy = entries.get("max.message.bytes"), entries.get("cleanup.policy")
    limit = record_limit(producer, int(tmax.value) if tmax is not None and tmax.value else None)
    return limit, policy is not None and "compact" in str(policy.value or "")


def route_not_produced(cur: psycopg2.extensions.cursor, cfg: PipelineConfig,
                       columns: Mapping[str, str], batch: Batch,
                       skipped: Sequence[NotProduced], topic: str, limit: int | None,
                       stage_gone: bool = False) -> None:
    """The left-out records, with their source key and value, into the dead-letter
    table in the ledger's transaction. `stage_gone` (`offsetflow complete`): the stage and
    the Kafka records are lost, so only what the commit's metadata names is left: their
    coordinates and sizes, with an error saying the key and value are gone."""
    if not skipped:
        return
    if not (cfg.bad_records == "dead_letter" and cfg.dead_letter_table):
        raise KafkaSinkError(
            f"batch {batch.batch_id}: its Kafka transaction left out {len(skipped)} "
            f"records for the dead-letter table (first: {skipped[0].topic}/"
            f"{skipped[0].partition}/{skipped[0].offset}), but the pipeline no longer "
            f"has bad_records: dead_letter; restore it to complete the batch")

    def arr(values: list[Any], pg_type: str) -> sql.Composable:
        return sql.SQL("{}::{}[]").format(sql.Literal(values), sql.SQL(pg_type))

    if stage_gone:
        gone = ("; its key and value are gone (the stage and the source records were lost "
                "before the ledger's commit; the batch was completed by offsetflow complete)")
        src = sql.SQL("unnest({t}, {p}, {o}, {e}) AS s(topic, partition, \"offset\", error)"
                      ).format(t=arr([r.topic for r in skipped], "text"),
                               p=arr([r.partition for r in skipped], "int"),
                               o=arr([r.offset for r in skipped], "bigint"),
                               e=arr([r.error(topic, limit) + gone for r in skipped], "text"))
        dead_letters_from(cur, batch, cfg.dead_letter_table, src, [], sql.SQL("true"),
                          sql.SQL("s.error"), "sink")
        return
    src = sql.SQL(
        "{st} s JOIN unnest({t}, {p}, {o}, {e}) AS r(topic, partition, off, error) "
        "ON s.topic = r.topic AND s.partition = r.partition AND s.\"offset\" = r.off"
    ).format(st=stage_table(batch.batch_id), t=arr([r.topic for r in skipped], "text"),
             p=arr([r.partition for r in skipped], "int"),
             o=arr([r.offset for r in skipped], "bigint"),
             e=arr([r.error(topic, limit) for r in skipped], "text"))
    # a transform's non-bytea key or value stays out (the coordinates name the record)
    cols = [c for c in columns if c not in ("key", "value") or columns[c] == "bytea"]
    n = dead_letters_from(cur, batch, cfg.dead_letter_table, src, cols,
                          sql.SQL("true"), sql.SQL("r.error"), "sink")
    if n != len(skipped):
        raise StagedRowsLostError(batch.batch_id, None, f"{len(skipped)} records the "
                                                        f"Kafka transaction left out, "
                                                        f"{n} of them in the stage")
