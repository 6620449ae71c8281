"""Bad records across retries on real Kafka and PostgreSQL: a retried read whose chunk
boundaries differ from the killed attempt's (compaction between attempts, another chunk
size) must record every bad record exactly once, on the fused path and on the transform
path (where reading and staging are separate tasks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer

import offsetflow.source
from offsetflow.commit import create_stage_tables
from offsetflow.config import parse_pipeline
from offsetflow.job.tasks import make_read_and_stage, make_reader, stage_columns
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.ranges import split_ranges
from offsetflow.source import packed as reader_packed
from offsetflow.source import reader
from offsetflow.source.chunk import RawChunk
from offsetflow.stage import bad_record_summary
from tests.tooling.pipeline_data import query

BAD_AT = (3, 25, 47)
N = 60
READ_RANGE = reader.read_range
READ_RANGES = reader_packed.read_ranges


class Killed(Exception):
    """Stands for the task dying between two chunks."""


def _setup(kafka_bootstrap: str, pg_dsn: str, make_topic: Any, table: str,
           transform: bool) -> tuple[Any, int, list[dict[str, Any]]]:
    topic = make_topic("retrybad", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for i in range(N):
        value = b"not json %d" % i if i in BAD_AT else json.dumps(
            {"event_id": f"e-{i}", "seq": i}).encode()
        p.produce(topic, value, partition=0)
    assert p.flush(30) == 0
    raw: dict[str, Any] = {
        "name": table, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "json", "schema": {"event_id": "string", "seq": "long"}},
        "sink": {"connection": pg_dsn, "table": table},
        "bad_records": "dead_letter", "dead_letter_table": f"dl_{table}",
        "spark": {"master": "local[2]", "max_offsets_per_task": 1000}}
    if transform:
        raw["transform"] = "tests.integration.stage.test_records_retry.identity"
    cfg = parse_pipeline(raw, f"<test {table}>", {})
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    batch_id = planned.batch.batch_id
    with Ledger(pg_dsn) as ledger:
        batch = ledger.get_batch(batch_id)
    specs = [r.to_dict() for r in split_ranges(batch.ranges, cfg.spark.max_offsets_per_task)]
    assert len(specs) == 1
    create_stage_tables(pg_dsn, batch_id, stage_columns(cfg), parts=1)
    return cfg, batch_id, specs


def identity(df: Any) -> Any:
    return df


def _attempt(monkeypatch: pytest.MonkeyPatch, task: Any, rows: int,
             kill_after: int | None) -> None:
    """One attempt of the task reading sub-range 0 in chunks of `rows` records, killed
    before its chunk number `kill_after` (or after its last chunk) when given."""
    def killing(chunks: Iterator[RawChunk]) -> Iterator[RawChunk]:
        for i, c in enumerate(chunks):
            if kill_after is not None and i == kill_after:
                raise Killed
            yield c
        if kill_after is not None:  # fewer chunks than that: killed after the last one
            raise Killed

    def one(conf: Any, r: Any, **kw: Any) -> Iterator[RawChunk]:
        return killing(READ_RANGE(conf, r, **{**kw, "max_rows": rows}))

    def packed(consumer: Any, ranges: Any, **kw: Any) -> Iterator[RawChunk]:
        return killing(READ_RANGES(consumer, ranges, **{**kw, "max_rows": rows}))
    # a small sub-range of a packed task is read by read_ranges (the fused path), a
    # transform's by read_range: whichever the task takes is chunked and killed, patched on
    # `offsetflow.source`, where the task looks them up when it runs
    monkeypatch.setattr(offsetflow.source, "read_range", one)
    monkeypatch.setattr(offsetflow.source, "read_ranges", packed)
    try:
        for _ in task(iter([pa.RecordBatch.from_pydict({"id": [0]})])):
            pass
    except Killed:
        assert kill_after is not None
    else:
        assert kill_after is None


# a killed attempt's packed reader is closed after its consumer (when the traceback that
# holds it goes): its clean-up must not raise ("Consumer closed" from `unassign()`)
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("transform", [False, True], ids=["fused", "transform"])
@pytest.mark.parametrize("first,second", [(10, 1000), (1000, 10)],
                         ids=["small_then_big", "big_then_small"])
def test_bad_records_survive_a_retry_with_other_chunk_boundaries(
        monkeypatch: pytest.MonkeyPatch, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, transform: bool, first: int, second: int) -> None:
    cfg, batch_id, specs = _setup(kafka_bootstrap, pg_dsn, make_topic, f"rb_{unique}",
                                  transform)
    make = make_reader if transform else make_read_and_stage
    _attempt(monkeypatch, make(cfg, batch_id, pg_dsn, specs), first, kill_after=1)
    _attempt(monkeypatch, make(cfg, batch_id, pg_dsn, specs), second, kill_after=None)
    # a speculative or late duplicate attempt adds nothing either
    _attempt(monkeypatch, make(cfg, batch_id, pg_dsn, specs), second, kill_after=None)
    dead = [r[0] for r in query(pg_dsn, f'SELECT "offset" FROM offsetflow_stage.b{batch_id}'
                                        f'_dead ORDER BY 1')]
    assert dead == list(BAD_AT)
    with Ledger(pg_dsn) as ledger:
        count, samples = bad_record_summary(ledger, batch_id)
    assert count == len(BAD_AT)
    assert sorted({s["offset"] for s in samples}) == list(BAD_AT)
