"""Packed tasks on real Kafka, PostgreSQL and Spark (issue 19, item 1): many small ranges are
read by a few tasks, each with one consumer into one stage part, and exactly-once holds when
a packed task dies half-way, is retried, or meets a part of another packing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

import offsetflow.job.driver as job
import offsetflow.job.tasks as job_tasks
import offsetflow.source
from offsetflow.commit import create_stage_tables
from offsetflow.errors import StagedRowsLostError
from offsetflow.job import run_batch
from offsetflow.job.tasks import make_read_and_stage, stage_columns
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.ranges import split_ranges
from offsetflow.source import packed as reader_packed
from offsetflow.source import reader
from offsetflow.source.chunk import RawChunk
from offsetflow.stage import claim_pack_tasks, stage_generation
from offsetflow.stage.reset import packing_of
from tests.tooling.pipeline_data import end_offsets, pipeline_for, produce_plain, query

READ_RANGES = reader_packed.read_ranges


class Killed(Exception):
    """Stands for the task's process dying between two of its ranges."""


def _exactly_once(pg_dsn: str, table: str, n: int) -> None:
    assert query(pg_dsn, f'SELECT count(*), count(DISTINCT (partition, "offset")), '
                         f'count(DISTINCT event_id) FROM {table}')[0] == (n, n, n)


def test_many_small_partitions_are_read_by_a_few_packed_tasks(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """60 partitions x 5 records on local[2]: 8 tasks (4 per core) and 8 stage parts, not
    60; every record lands once and the positions move to the end."""
    topic = make_topic("pk", 60)
    produce_plain(kafka_bootstrap, topic, 300, f"pk{unique}", 60)
    table = f"pk_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    parts: list[int] = []
    real_create = job.create_stage_tables

    def create(*args: Any, **kw: Any) -> Any:
        parts.append(kw.get("parts", 0))
        return real_create(*args, **kw)
    monkeypatch.setattr(job, "create_stage_tables", create)
    report = run_batch(spark, cfg, bid, pg_dsn)
    assert report.result.status == "committed"
    assert parts == [8], "60 one-range tasks instead of 8 packed ones"
    assert query(pg_dsn, "SELECT pack_tasks FROM offsetflow.batches WHERE batch_id = %s",
                 (bid,))[0][0] == 8
    _exactly_once(pg_dsn, table, 300)
    assert query(pg_dsn, "SELECT count(*), sum(next_offset) FROM offsetflow.positions "
                         "WHERE pipeline = %s", (cfg.name,))[0] == (60, 300)


def _planned(spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
             prefix: str) -> tuple[Any, int, list[dict[str, Any]], list[tuple[int, ...]], int]:
    """30 partitions x 4 records, planned and packed into 2 parts of 15 sub-ranges."""
    topic = make_topic(prefix, 30)
    produce_plain(kafka_bootstrap, topic, 120, f"{prefix}{unique}", 30)
    table = f"{prefix}_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    with Ledger(pg_dsn) as ledger:
        batch = ledger.get_batch(bid)
        generation = stage_generation(ledger, batch, cfg.spark.max_offsets_per_task)
        assert claim_pack_tasks(ledger, bid, 2) == 2
        batch = ledger.get_batch(bid)
    groups = list(packing_of(batch, 2).groups)
    assert [len(g) for g in groups] == [15, 15]
    specs = [r.to_dict() for r in split_ranges(batch.ranges, cfg.spark.max_offsets_per_task)]
    create_stage_tables(pg_dsn, bid, stage_columns(cfg), parts=len(groups))
    return cfg, bid, specs, groups, generation


def _attempt(monkeypatch: pytest.MonkeyPatch, task: Any, part: int,
             kill_after_chunk: int | None = None) -> None:
    """One attempt of packed part `part`, its process killed once it has read
    `kill_after_chunk` chunks of 4 records (the ranges are read all at once, in chunks that
    span them: part of its ranges read by then, and handed on to the COPY)."""
    def read(consumer: Any, ranges: Any, **kw: Any) -> Iterator[RawChunk]:
        for n, chunk in enumerate(READ_RANGES(consumer, ranges, max_rows=4), 1):
            yield chunk
            if n == kill_after_chunk:
                raise Killed
    # where the task looks it up when it runs
    monkeypatch.setattr(offsetflow.source, "read_ranges", read)
    monkeypatch.setattr(job_tasks, "_task_part", lambda: part)
    try:
        for _ in task(iter([pa.RecordBatch.from_pydict({"id": [part]})])):
            pass
    except Killed:
        assert kill_after_chunk is not None
    else:
        assert kill_after_chunk is None
    finally:
        monkeypatch.undo()


def test_a_packed_task_killed_half_way_and_retried_stages_nothing_twice(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, bid, specs, groups, generation = _planned(spark, pg_dsn, kafka_bootstrap,
                                                   make_topic, unique, "pkr")
    task = make_read_and_stage(cfg, bid, pg_dsn, specs, generation, groups)
    _attempt(monkeypatch, task, 0, kill_after_chunk=7)  # 28 of its 60 records read
    assert query(pg_dsn, f"SELECT count(*) FROM offsetflow_stage.b{bid}_p0")[0][0] == 0
    _attempt(monkeypatch, task, 0)  # the retry
    _attempt(monkeypatch, task, 0)  # a speculative duplicate: skipped
    assert query(pg_dsn, "SELECT part, rows_staged, subranges FROM offsetflow.staged_parts "
                         "WHERE batch_id = %s AND kind = 'rows'", (bid,)) == \
        [(0, 60, list(groups[0]))]
    # the run stages part 1 and takes part 0 as staged: 120 rows, each once
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    _exactly_once(pg_dsn, cfg.sink.table, 120)


def test_commit_refuses_a_part_that_read_other_sub_ranges_and_the_retry_commits_once(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A marker naming other sub-ranges than its part's under the batch's packing (a
    packing of another task count) is of another layout: the commit refuses it before
    moving a row, drops the part, and the next run stages it again."""
    cfg, bid, specs, groups, generation = _planned(spark, pg_dsn, kafka_bootstrap,
                                                   make_topic, unique, "pkf")
    task = make_read_and_stage(cfg, bid, pg_dsn, specs, generation, groups)
    _attempt(monkeypatch, task, 1)
    # part 1 of a 3-task packing would be every third sub-range
    query(pg_dsn, "UPDATE offsetflow.staged_parts SET subranges = %s WHERE batch_id = %s "
                  "AND part = 1 RETURNING 1", (list(range(1, 30, 3)), bid))
    with pytest.raises(StagedRowsLostError, match=r"part 1 read sub-ranges \[1, 4"):
        run_batch(spark, cfg, bid, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM {cfg.sink.table}")[0][0] == 0
    # dropped as soon as the append commit saw it, so the run's own task 1 may have staged
    # it again meanwhile, as its part: never the foreign marker
    assert query(pg_dsn, "SELECT subranges FROM offsetflow.staged_parts WHERE batch_id = %s "
                         "AND part = 1", (bid,)) in ([], [(list(groups[1]),)])
    assert run_batch(spark, cfg, bid, pg_dsn).result.status == "committed"
    _exactly_once(pg_dsn, cfg.sink.table, 120)


def test_a_shared_consumer_switches_ranges_without_waiting_out_a_fetch(
        kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """Each small range read to its partition's end left a fetch the broker long-polls for
    fetch.wait.max.ms (500 ms); the next range's records waited behind it: 20 ranges took
    10 s on one consumer. The shared consumer's switch costs milliseconds."""
    import time

    from offsetflow.ranges import OffsetRange

    topic = make_topic("pks", 20)
    produce_plain(kafka_bootstrap, topic, 200, f"pks{unique}", 20)
    conf = pipeline_for(topic, "postgresql://unused", kafka_bootstrap,
                        f"pks_{unique}").consumer_settings()
    with reader.range_consumer(conf, shared=True) as consumer:
        t = time.monotonic()
        got = [len(c) for p in range(20)
               for c in reader.read_range(conf, OffsetRange(topic, p, 0, 10),
                                          consumer=consumer)]
        took = time.monotonic() - t
    assert sum(got) == 200
    assert took < 4.0, f"20 ranges on one consumer took {took:.1f}s"


def _offsets(chunks: list[Any]) -> dict[tuple[str, int], list[int]]:
    got: dict[tuple[str, int], list[int]] = {}
    for c in chunks:
        for t, p, off in zip(c.topics, c.partitions, c.offsets, strict=True):
            got.setdefault((t, p), []).append(off)
    return got


def test_a_packed_task_reads_its_small_ranges_all_at_once_exactly(
        kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """All ranges assigned at once (one fetch answers many partitions): per range exactly
    its offsets, in order, none at or past until_offset (a range ending mid-partition),
    across committed and aborted transactions' gaps; chunks span ranges and keep the row
    bound; after it, the same consumer reads a partition it paused."""
    from offsetflow.ranges import OffsetRange
    from offsetflow.source import read_ranges
    from tests.tooling.pipeline_data import produce_transactional

    topic = make_topic("pkm", 6)
    produce_plain(kafka_bootstrap, topic, 60, f"pkm{unique}", 6)
    tx = make_topic("pkt", 2)
    # per partition: 3 committed, 2 aborted, 3 committed records, each txn + its marker
    produce_transactional(kafka_bootstrap, tx, [(6, True), (4, False), (6, True)],
                          f"pkt{unique}", 2)
    conf = pipeline_for(topic, "postgresql://unused", kafka_bootstrap,
                        f"pkm_{unique}").consumer_settings()
    ends = end_offsets(kafka_bootstrap, tx, 2)
    ranges = [OffsetRange(topic, p, 2, 7) if p == 0 else OffsetRange(topic, p, 0, 10)
              for p in range(6)] + [OffsetRange(tx, p, 0, ends[(tx, p)]) for p in range(2)]
    with reader.range_consumer(conf, shared=True) as consumer:
        chunks = list(read_ranges(consumer, ranges, max_rows=7))
        got = _offsets(chunks)
        assert got[(topic, 0)] == [2, 3, 4, 5, 6]
        for p in range(1, 6):
            assert got[(topic, p)] == list(range(10))
        for p in range(2):  # the committed records only, each once, in order
            offs = got[(tx, p)]
            assert len(offs) == 6 and offs == sorted(set(offs)), offs
            assert max(offs) < ends[(tx, p)]
        assert [len(c) for c in chunks[:-1]] == [7] * (len(chunks) - 1)  # cut by rows only
        assert any(len(set(c.partitions)) > 1 for c in chunks)
        again = [c.offsets for c in reader.read_range(conf, OffsetRange(topic, 0, 7, 10),
                                                      consumer=consumer)]
        assert again == [[7, 8, 9]]
