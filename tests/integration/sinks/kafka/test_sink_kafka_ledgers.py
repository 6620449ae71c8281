"""The Kafka topic sink's record of a commit belongs to one ledger and one output topic
(review M2): two ledgers (two PostgreSQL databases, e.g. staging and prod) running a pipeline
of the same name on one Kafka cluster never take each other's commit records, and an open
batch whose record was written in the format before the ledger identity is still found."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import psycopg2
import psycopg2.extensions
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer
from confluent_kafka import TopicPartition as KTopicPartition
from psycopg2 import sql

from offsetflow.errors import BatchStateError, KafkaSinkError, LedgerIdentityError
from offsetflow.job import run_batch
from offsetflow.ledger import Batch, Ledger, adopt_identity, ledger_identity
from offsetflow.ops import plan_only
from tests.tooling.chaos import Workload
from tests.tooling.kafka_case import kafka_sink_pipeline
from tests.tooling.pipeline_data import ledger_database
from tests.tooling.topic_checker import check_topic, read_topic


@pytest.fixture
def other_ledger(admin_dsn: str, unique: str) -> Iterator[str]:
    """A second ledger: a database of its own, migrated."""
    with ledger_database(admin_dsn, f"offsetflow_test_{os.getpid()}_other_{unique}") as dsn:
        yield dsn


def test_two_ledgers_with_the_same_pipeline_name_each_write_their_own_batches(
        spark: Any, pg_dsn: str, other_ledger: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    src = make_topic("kl-src", 2)
    prod_out, staging_out = make_topic("kl-prod", 2), make_topic("kl-staging", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kl{unique}")
    w.plain(120)
    name = f"kl_{unique}"  # the same pipeline name in both ledgers
    prod = kafka_sink_pipeline(name, src, pg_dsn, kafka_bootstrap, topic=prod_out)
    staging = kafka_sink_pipeline(name, src, other_ledger, kafka_bootstrap, topic=staging_out)
    verdicts = {}
    bids = []
    for cfg, dsn, out in ((prod, pg_dsn, prod_out), (staging, other_ledger, staging_out)):
        if bids:  # both ledgers number the batch alike (as two fresh ledgers do)
            with Ledger(dsn) as ledger, ledger.transaction() as cur:
                cur.execute("SELECT setval(pg_get_serial_sequence('offsetflow.batches', "
                            "'batch_id'), %s, false)", (bids[0],))
        planned = plan_only(cfg, dsn)
        assert planned.batch is not None
        bids.append(planned.batch.batch_id)
        rep = run_batch(spark, cfg, planned.batch.batch_id, dsn)
        assert rep.result.status == "committed", rep.result
        with Ledger(dsn) as ledger:
            positions = ledger.positions(name)
        verdicts[out] = check_topic(kafka_bootstrap, out, w.produced.values(), positions)
    assert bids[0] == bids[1]
    for out, verdict in verdicts.items():
        assert verdict.committed.ok, (out, verdict.committed.explain())
        assert verdict.committed.found == 120 and verdict.in_log == 120, out
    ids = set()
    for dsn in (pg_dsn, other_ledger):
        with Ledger(dsn) as ledger, ledger.transaction() as cur:
            ids.add(ledger_identity(cur).installation_id)
    assert len(ids) == 2
    assert len(read_topic(kafka_bootstrap, prod_out, "read_uncommitted")) == 120


def legacy_transaction(bootstrap: str, name: str, out: str, batch: Batch, records: int
                       ) -> Producer:
    """What the sink before the ledger identity did for a live batch, up to (not including)
    the commit: its transactional.id and group `offsetflow-sink-<pipeline>`, metadata
    `offsetflow pipeline=<p> batch=<id>`."""
    txn = f"offsetflow-sink-{name}"
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn,
                  "enable.idempotence": True})
    p.init_transactions(30)
    p.begin_transaction()
    for i in range(records):
        p.produce(out, f"legacy-{i}".encode(),
                  headers=[("offsetflow.batch", str(batch.batch_id).encode())])
    assert p.flush(30) == 0
    meta = f"offsetflow pipeline={name} batch={batch.batch_id}"
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": txn})
    p.send_offsets_to_transaction(
        [KTopicPartition(r.topic, r.partition, r.until_offset, metadata=meta)
         for r in batch.ranges if r.until_offset > r.from_offset],
        c.consumer_group_metadata(), 30)
    c.close()
    return p


def test_open_batches_of_the_format_before_the_ledger_identity(
        spark: Any, other_ledger: str, kafka_bootstrap: str, make_topic: Any,
        unique: str) -> None:
    """An upgrade with open batches: one the older sink committed in Kafka (killed before
    the ledger) is found under the older names and completed without producing; one whose
    older transaction is still open (a zombie of the older version) is fenced under the
    older transactional.id before it is written, so the zombie's commit fails."""
    src, out = make_topic("ku-src", 2), make_topic("ku-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"ku{unique}")
    w.plain(40)
    name = f"ku_{unique}"
    cfg = kafka_sink_pipeline(name, src, other_ledger, kafka_bootstrap, topic=out)
    with Ledger(other_ledger) as ledger, ledger.transaction() as cur:
        # every batch of this test counts as planned before the identity existed
        cur.execute("UPDATE offsetflow.ledger_identity SET first_batch_id = 1000000")
    planned = plan_only(cfg, other_ledger)
    assert planned.batch is not None
    first = planned.batch
    legacy_transaction(kafka_bootstrap, name, out, first, 3).commit_transaction(30)
    rep = run_batch(spark, cfg, first.batch_id, other_ledger)
    assert rep.result.status == "committed" and rep.result.rows_written == 40
    assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) == 3  # none again

    w.plain(30)
    planned = plan_only(cfg, other_ledger)
    assert planned.batch is not None and planned.batch.batch_id != first.batch_id
    zombie = legacy_transaction(kafka_bootstrap, name, out, planned.batch, 5)
    rep = run_batch(spark, cfg, planned.batch.batch_id, other_ledger)
    assert rep.result.status == "committed" and rep.result.rows_written == 30
    with pytest.raises(KafkaException) as e:
        zombie.commit_transaction(30)
    assert e.value.args[0].code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                                      KafkaError.INVALID_PRODUCER_EPOCH), e.value
    visible = read_topic(kafka_bootstrap, out)
    assert len(visible) == 3 + 30  # the first batch's 3 (legacy) and the second's 30
    assert sorted(r.batch_id for r in visible) == [first.batch_id] * 3 + [
        planned.batch.batch_id] * 30


@contextlib.contextmanager
def ledger_copy(admin_dsn: str, dsn: str, name: str) -> Iterator[str]:
    """A copy of the ledger at `dsn` as it is now (CREATE DATABASE ... TEMPLATE: its rows,
    its batch-id sequence and its identity row), dropped afterwards: a backup to restore, or
    a clone made from a dump."""
    source = psycopg2.extensions.parse_dsn(dsn)["dbname"]
    conn = psycopg2.connect(admin_dsn, connect_timeout=10)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(source)))
        yield psycopg2.extensions.make_dsn(dsn, dbname=name)
    finally:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
        conn.close()


def test_a_ledger_restored_from_a_backup_does_not_produce_committed_batches_again(
        spark: Any, admin_dsn: str, other_ledger: str, kafka_bootstrap: str,
        make_topic: Any, unique: str) -> None:
    """Review H1: a backup taken after batch 1, restored after batches 2 and 3 committed,
    rewinds positions and the batch-id counter under the same ledger identity. Its next
    batch (id 2 again, the ranges batch 2 had) finds the sink group ahead of its from_offset
    under another batch of this ledger: refused, nothing produced twice. The way out the
    error names (positions moved to the sink group's offsets) then works."""
    from offsetflow.commit import sink_holds
    from offsetflow.ops import kafka_for, reset_positions
    from offsetflow.sinks import external_sink

    src, out = make_topic("kr-src", 2), make_topic("kr-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kr{unique}")
    name = f"kr_{unique}"
    cfg = kafka_sink_pipeline(name, src, other_ledger, kafka_bootstrap, topic=out)

    def commit(dsn: str) -> Batch:
        planned = plan_only(cfg if dsn == other_ledger else restored_cfg, dsn)
        assert planned.batch is not None
        rep = run_batch(spark, cfg if dsn == other_ledger else restored_cfg,
                        planned.batch.batch_id, dsn)
        assert rep.result.status == "committed", rep.result
        return planned.batch

    w.plain(40)
    commit(other_ledger)
    with ledger_copy(admin_dsn, other_ledger, f"offsetflow_test_{os.getpid()}_bk_{unique}"
                     ) as backup:
        restored_cfg = kafka_sink_pipeline(name, src, backup, kafka_bootstrap, topic=out)
        w.plain(30)
        second = commit(other_ledger)
        w.plain(20)
        commit(other_ledger)
        with Ledger(other_ledger) as ledger:
            live_positions = ledger.positions(name)
        before = len(read_topic(kafka_bootstrap, out, "read_uncommitted"))
        # restored under another database name: the operator says it is the same ledger
        with Ledger(backup) as ledger, ledger.transaction() as cur:
            adopt_identity(cur)

        planned = plan_only(restored_cfg, backup)
        assert planned.batch is not None
        assert planned.batch.batch_id == second.batch_id  # the counter was rewound
        with pytest.raises(KafkaSinkError) as e:
            run_batch(spark, restored_cfg, planned.batch.batch_id, backup)
        msg = str(e.value)
        for part in (name, f"batch {planned.batch.batch_id}", f"{src}[0]", "reset-position",
                     "restored"):
            assert part in msg, (part, msg)
        assert len(read_topic(kafka_bootstrap, out, "read_uncommitted")) == before
        verdict = check_topic(kafka_bootstrap, out, w.produced.values(), live_positions)
        assert verdict.committed.ok, verdict.committed.explain()
        assert verdict.committed.found == 90

        # the way out: abandon the refused batch (as `offsetflow abandon` does: the sink
        # does not hold it), move the positions to the sink's offsets
        assert not sink_holds(backup, planned.batch, external_sink(restored_cfg, backup))
        with Ledger(backup) as ledger:
            ledger.abandon(planned.batch.batch_id, "restored ledger behind its sink")
            topic_id = kafka_for(restored_cfg).topic_ids([src]).get(src)
            for (topic, partition), offset in live_positions.items():
                reset_positions(ledger, name, topic, [partition], offset, "restore",
                                topic_id=topic_id, live_topic=out)
        w.plain(10)
        commit(backup)
        with Ledger(backup) as ledger:
            positions = ledger.positions(name)
        verdict = check_topic(kafka_bootstrap, out, w.produced.values(), positions)
        assert verdict.committed.ok, verdict.committed.explain()
        assert verdict.committed.found == 100


def test_a_ledger_copied_from_another_is_refused_until_it_has_its_own_identity(
        spark: Any, admin_dsn: str, other_ledger: str, kafka_bootstrap: str,
        make_topic: Any, unique: str) -> None:
    """Review M1: staging made from prod's ledger (CREATE DATABASE ... TEMPLATE, like a
    restored dump) shares its identity, so its transactional.id and group: its runs would
    fence prod's and overwrite prod's record of its commits. The copy is refused before it
    opens a producer, naming the command that gives it an identity of its own; after that
    it writes its own topic and prod goes on untouched."""
    from offsetflow.cli import main as cli

    src = make_topic("kc-src", 2)
    prod_out, staging_out = make_topic("kc-prod", 2), make_topic("kc-staging", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kc{unique}")
    name = f"kc_{unique}"
    prod = kafka_sink_pipeline(name, src, other_ledger, kafka_bootstrap, topic=prod_out)

    def commit(cfg: Any, dsn: str) -> None:
        planned = plan_only(cfg, dsn)
        assert planned.batch is not None
        rep = run_batch(spark, cfg, planned.batch.batch_id, dsn)
        assert rep.result.status == "committed", rep.result

    w.plain(40)
    commit(prod, other_ledger)
    with ledger_copy(admin_dsn, other_ledger, f"offsetflow_test_{os.getpid()}_cp_{unique}"
                     ) as copy:
        staging = kafka_sink_pipeline(name, src, copy, kafka_bootstrap, topic=staging_out)
        w.plain(30)
        planned = plan_only(staging, copy)
        assert planned.batch is not None
        with pytest.raises(LedgerIdentityError) as e:
            run_batch(spark, staging, planned.batch.batch_id, copy)
        msg = str(e.value)
        for part in ("new-identity", "adopt-identity", "copy"):
            assert part in msg, (part, msg)
        assert read_topic(kafka_bootstrap, staging_out, "read_uncommitted") == []

        assert cli(["--dsn", copy, "db", "new-identity"]) == 0
        rep = run_batch(spark, staging, planned.batch.batch_id, copy)
        assert rep.result.status == "committed", rep.result
        commit(prod, other_ledger)  # prod is untouched: its own group, its own batches
        with Ledger(other_ledger) as ledger:
            positions = ledger.positions(name)
        verdict = check_topic(kafka_bootstrap, prod_out, w.produced.values(), positions)
        assert verdict.committed.ok, verdict.committed.explain()
        assert verdict.committed.found == 70 and verdict.in_log == 70
        # staging's topic: what the copy read after it was made, once (the first 40 records
        # are prod's, in prod's topic, before the copy)
        staged = read_topic(kafka_bootstrap, staging_out, "read_uncommitted")
        assert sorted(r.batch_id for r in staged) == [planned.batch.batch_id] * 30
        ids = set()
        for dsn in (other_ledger, copy):
            with Ledger(dsn) as ledger, ledger.transaction() as cur:
                ids.add(ledger_identity(cur).installation_id)
        assert len(ids) == 2


def test_a_fresh_ledgers_first_batch_does_not_predate_its_identity(other_ledger: str) -> None:
    """Review LOW: migration 0008's first_batch_id is the id the sequence hands out next;
    on a fresh ledger (is_called false) that is 1, not 2, so batch 1 never takes the look-up
    (and fence) of the names before the identity. A ledger without migration 0008 is told
    to run the upgrade."""
    with Ledger(other_ledger) as ledger, ledger.transaction() as cur:
        ident = ledger_identity(cur)
        cur.execute("SELECT nextval('offsetflow.batches_batch_id_seq')")
        first = cur.fetchone()[0]
        assert ident.first_batch_id == first == 1
        assert not ident.predates(first)
    with Ledger(other_ledger) as ledger, ledger.transaction() as cur:
        cur.execute("DROP TABLE offsetflow.ledger_identity")
        with pytest.raises(BatchStateError, match="offsetflow db upgrade"):
            ledger_identity(cur)
