"""The Kafka sink's stage read (`select_sql`), on PostgreSQL alone:
the commit streams the stage in source order without sorting the batch first (the plan
has no Sort node), whether the stage is split into parts (the fused path) or not (a
transform run stages into the stage table itself), and the order it gives is source order
per partition."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
from psycopg2 import sql

from offsetflow.ledger import Ledger
from tests.tooling.chaos import payload
from tests.tooling.checker import ProducedRecord
from tests.tooling.kafka_case import kafka_sink_pipeline
from tests.tooling.topic_checker import check_topic, read_topic

# a Sort node (Merge Append's own "Sort Key" line is no such node)
SORT_NODE = re.compile(r"(^|->\s+)(Incremental )?Sort\s+\(")


def test_a_batch_of_only_aborted_records_commits_with_no_record(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A batch whose ranges hold only an aborted transaction stages no row: the commit
    indexes an empty stage, produces nothing and still commits the source offsets."""
    from offsetflow.job import run_batch
    from offsetflow.ops import plan_only
    from tests.tooling.chaos import Workload
    from tests.tooling.topic_checker import read_topic

    src = make_topic("kz-src", 2)
    out = make_topic("kz-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kz{unique}")
    w.transaction(6, commit=False)
    cfg = kafka_sink_pipeline(f"kz_{unique}", src, pg_dsn, kafka_bootstrap, topic=out,
                              partitioning="source", headers="none", split=2)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    rep = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == 0, rep.result
    assert read_topic(kafka_bootstrap, out) == []


def _produce(bootstrap: str, topic: str, counts: dict[int, int], prefix: str
             ) -> list[ProducedRecord]:
    """`counts[p]` records into partition p (the pipeline's JSON schema), as acknowledged."""
    from confluent_kafka import Producer

    out: list[ProducedRecord] = []

    def cb(err: Any, msg: Any) -> None:
        assert err is None, err
        body = json.loads(msg.value())
        out.append(ProducedRecord(body["event_id"], body["checksum"], msg.topic(),
                                  msg.partition(), msg.offset()))

    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                  "linger.ms": 20})
    seq = 0
    for part, n in counts.items():
        for _ in range(n):
            body = payload(f"{prefix}-{seq}", seq)
            seq += 1
            p.produce(topic, json.dumps(body).encode(), partition=part, on_delivery=cb)
            if seq % 5000 == 0:
                p.poll(0)
    assert p.flush(60) == 0
    return out


@pytest.fixture
def explained(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The plan of every stage read the commit streams (EXPLAIN of its cursor, on its
    connection, before the fetching thread starts)."""
    import offsetflow.sinks.kafka.sink as sink_module

    plans: list[str] = []
    real = sink_module.prefetched

    def spy(conn: Any, name: str, query: Any, *args: Any, **kw: Any) -> Any:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("EXPLAIN DECLARE offsetflow_explain CURSOR FOR {}").format(
                query))
            plans.append("\n".join(r[0] for r in cur.fetchall()))
        return real(conn, name, query, *args, **kw)

    monkeypatch.setattr(sink_module, "prefetched", spy)
    return plans


def test_a_packed_and_split_stage_is_produced_without_a_sort_in_source_order(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        explained: list[str]) -> None:
    """Partitions split over several parts, packed (part 0 holds the first sub-range of
    partition 0 and the last of partition 5, not adjacent in source order): the commit
    reads the parts segment by segment as stored, with no Sort in its plan, and every
    output partition holds its source partition's records once, in offset order."""
    from offsetflow.job import run_batch
    from offsetflow.ops import plan_only
    from offsetflow.ranges import split_ranges
    from offsetflow.stage import pack

    src = make_topic("kp-src", 6)
    out = make_topic("kp-out", 6)
    produced = _produce(kafka_bootstrap, src, dict.fromkeys(range(6), 1500), f"kp{unique}")
    # the stage path's plan (task files, the default on local[2], stage nothing)
    cfg = kafka_sink_pipeline(f"kp_{unique}", src, pg_dsn, kafka_bootstrap, topic=out,
                              partitioning="source", split=1000, task_files="off")
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    split = split_ranges(planned.batch.ranges, 1000)
    assert pack(split, 8, 1000).groups[0] == (0, 11)  # packed (local[2]: 8 tasks)
    rep = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == len(produced)
    # one query per group of parts the overlap produced as they were staged (test_sink_kafka_
    # overlap.py), and one for what was left after the read: none of them sorts
    assert explained
    for plan in explained:
        assert not [line for line in plan.splitlines() if SORT_NODE.search(line.strip())], plan
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(cfg.name)
    v = check_topic(kafka_bootstrap, out, produced, positions)
    assert v.committed.ok, v.committed.explain()
    assert v.aborted_in_log == 0  # one pass: nothing was produced and taken back
    records = read_topic(kafka_bootstrap, out)
    for part in range(6):
        sources = [r.source for r in sorted(records, key=lambda r: r.offset)
                   if r.partition == part]
        assert [s[2] for s in sources] == sorted(s[2] for s in sources), part
        assert {s[1] for s in sources} == {part}


def test_a_stage_read_out_of_source_order_is_taken_back_and_read_sorted(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The unsorted read trusts the parts' storage order only as far as it checks it: a
    record that comes before an earlier offset of its partition (here: the segments handed
    over in the wrong order) aborts that transaction, and the batch is produced again from
    the sorted read in the same commit. read_committed consumers see each record once, in
    order, and nothing of the aborted pass."""
    import offsetflow.sinks.kafka.sink as sink_module
    from offsetflow.job import run_batch
    from offsetflow.ops import plan_only

    real = sink_module.segments

    def reversed_segments(*args: Any) -> Any:
        got = real(*args)
        return None if got is None else got[::-1]

    monkeypatch.setattr(sink_module, "segments", reversed_segments)
    src = make_topic("kr-src", 2)
    out = make_topic("kr-out", 2)
    produced = _produce(kafka_bootstrap, src, {0: 60, 1: 60}, f"kr{unique}")
    cfg = kafka_sink_pipeline(f"kr_{unique}", src, pg_dsn, kafka_bootstrap, topic=out,
                              partitioning="source", split=20)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    with caplog.at_level(logging.WARNING, logger="offsetflow.sinks.kafka.sink"):
        rep = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == 120
    assert "producing the batch again from the stage read sorted" in caplog.text
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(cfg.name)
    v = check_topic(kafka_bootstrap, out, produced, positions)
    assert v.committed.ok, v.committed.explain()  # 0 lost, 0 duplicated
    # (the aborted pass's records may never have left the producer's queue)
    assert v.visible == 120 and v.batches == {planned.batch.batch_id}
    records = read_topic(kafka_bootstrap, out)
    for part in (0, 1):
        offsets = [r.source[2] for r in sorted(records, key=lambda r: r.offset)
                   if r.partition == part]
        assert offsets == sorted(offsets) and len(offsets) == 60, part


def test_a_stage_read_out_of_order_late_in_a_large_pass_commits_each_record_once(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The surprise comes late in the pass (the last two segments swapped), when thousands
    of the unsorted pass's records have been sent, acknowledged or are still queued: the
    transaction is aborted and the sorted pass, in a new transaction of the same commit,
    still produces each record once in offset order (the producer's sequence numbers and
    the purged records' reports of the aborted pass must not spoil it)."""
    import offsetflow.sinks.kafka.sink as sink_module
    from offsetflow.job import run_batch
    from offsetflow.ops import plan_only

    real = sink_module.segments

    def late_swap(*args: Any) -> Any:
        got = real(*args)
        return None if got is None else [*got[:-2], got[-1], got[-2]]

    monkeypatch.setattr(sink_module, "segments", late_swap)
    src = make_topic("kl-src", 2)
    out = make_topic("kl-out", 2)
    produced = _produce(kafka_bootstrap, src, {0: 6000, 1: 2000}, f"kl{unique}")
    cfg = kafka_sink_pipeline(f"kl_{unique}", src, pg_dsn, kafka_bootstrap, topic=out,
                              partitioning="source", split=1000)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    with caplog.at_level(logging.WARNING, logger="offsetflow.sinks.kafka.sink"):
        rep = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == 8000, rep.result
    assert "producing the batch again from the stage read sorted" in caplog.text
    # the sorted pass is not spoiled by the aborted one's purged records' reports (a pass
    # lost so counts against MAX_PASSES)
    assert "failed with no record refused" not in caplog.text, caplog.text
    with Ledger(pg_dsn) as ledger:
        positions = ledger.positions(cfg.name)
    v = check_topic(kafka_bootstrap, out, produced, positions)
    assert v.committed.ok, v.committed.explain()
    assert v.visible == 8000 and v.batches == {planned.batch.batch_id}
    records = read_topic(kafka_bootstrap, out)
    for part, n in ((0, 6000), (1, 2000)):
        offsets = [r.source[2] for r in sorted(records, key=lambda r: r.offset)
                   if r.partition == part]
        assert offsets == sorted(offsets) and len(offsets) == n, part
