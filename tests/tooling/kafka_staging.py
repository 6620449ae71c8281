"""The Kafka topic sink's part-wise commit driven without Spark (`KafkaStaging`): a planned
batch whose stage is created as a run creates it, each part read and staged by the code its
Spark task runs, so a test decides when a part becomes staged relative to what the commit
(`offsetflow.commit.PartwiseCommit`, the sink its step 4) produces. `json_staging`: a batch
of JSON records checked exactly-once with tests.tooling.topic_checker; `oversized_staging`:
raw records of which one is too large for the output topic, dead-lettered."""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg2
from psycopg2 import sql

from offsetflow.commit import CommitSpec, PartwiseCommit, create_stage_tables, ensure_dead_letter
from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.job.tasks import ReadContext, read_subrange, stage_columns
from offsetflow.ledger import Batch, Ledger, stage_part_table
from offsetflow.ops import plan_only
from offsetflow.ranges import split_ranges
from offsetflow.sinks import sink_for
from offsetflow.sinks.kafka import KafkaTopicSink
from offsetflow.sinks.kafka.form import OUTPUT_SETTINGS, parts_select_sql
from offsetflow.stage import TaskClock, binary_encoder, pgcopy, stage_generation, stage_rows
from tests.tooling import chaos
from tests.tooling.chaos import SCHEMA, Workload
from tests.tooling.kafka_topics import produce
from tests.tooling.topic_checker import TopicVerdict, check_topic, read_topic

# the oversized case's small records: (partition, key, value, timestamp) for `produce`
SMALL = [(i % 2, f"k{i}".encode(), f"{i:05d}".encode() * 40, 0) for i in range(60)]


class KafkaStaging:
    """One planned batch into the output topic `out`, split into parts of `split` offsets,
    its stage created as a run creates it; `stage(i)` does what the Spark task of part i
    does. `workload`: the source's records, for `verdict` (a JSON batch only)."""

    def __init__(self, cfg: PipelineConfig, batch: Batch, dsn: str, bootstrap: str, out: str,
                 split: int, workload: Workload | None = None) -> None:
        self.dsn, self.bootstrap, self.out, self.cfg, self.batch = dsn, bootstrap, out, cfg, batch
        self.name = cfg.name
        self.workload = workload
        with Ledger(dsn) as ledger:
            self.generation = stage_generation(ledger, batch, split)
        self.specs = [r.to_dict() for r in split_ranges(batch.ranges, split)]
        self.columns = stage_columns(cfg)
        create_stage_tables(dsn, batch.batch_id, self.columns, parts=len(self.specs))
        self.timings: dict[str, float] = {}
        self.sink: KafkaTopicSink | None = None

    def stage(self, part: int, fail_after_rows: int | None = None) -> int:
        """Part `part` staged as its task does (an attempt that fails after
        `fail_after_rows` rows: its transaction, marker and rows roll back). Returns the
        rows it staged (0: staged by an earlier attempt)."""
        rc = ReadContext.of(self.cfg, self.batch.batch_id, self.dsn, self.specs,
                            self.generation)
        clock = TaskClock()
        rows: Iterator[Any] = read_subrange(rc, part, clock)
        if fail_after_rows is not None:
            rows = _failing(rows, fail_after_rows)
        stats = stage_rows(self.dsn, self.batch.batch_id, part, rows, clock,
                           binary_encoder([t for _, t in self.columns]),
                           table=stage_part_table(self.batch.batch_id, part),
                           generation=self.generation)
        return 0 if stats.get("skipped") else int(stats["rows"])

    def committer(self) -> PartwiseCommit:
        """The commit a run starts before its tasks (`job.driver`), the sink its step 4."""
        dead = self.cfg.dead_letter_table
        if dead is not None:  # as the run creates it before the read
            with Ledger(self.dsn) as ledger, ledger.transaction() as cur:
                ensure_dead_letter(cur, dead)
        spec = CommitSpec(columns=tuple(c for c, _ in self.columns), dead_letter_table=dead,
                          bad_records_staged=dead is not None,
                          config_fingerprint=self.batch.config_fingerprint,
                          stage_generation=self.generation, subrange_parts=True)
        sink = sink_for(self.cfg).external(self.dsn, self.columns, spec)
        assert isinstance(sink, KafkaTopicSink)
        self.sink = sink
        return PartwiseCommit(self.dsn, self.batch, columns=spec.columns,
                              parts=len(self.specs), dead_letter_table=dead,
                              timings=self.timings,
                              spec=dataclasses.replace(spec, external=sink))

    def in_log(self) -> int:
        return len(read_topic(self.bootstrap, self.out, "read_uncommitted"))

    def visible(self) -> int:
        return len(read_topic(self.bootstrap, self.out, "read_committed"))

    def verdict(self, expected: int) -> TopicVerdict:
        assert self.workload is not None, "verdict: a JSON batch (json_staging) only"
        with Ledger(self.dsn) as ledger:
            positions = ledger.positions(self.name)
        v = check_topic(self.bootstrap, self.out, self.workload.produced.values(), positions)
        assert v.committed.ok, v.committed.explain()
        assert v.committed.found == v.committed.expected == expected
        assert v.batches == {self.batch.batch_id}
        return v

    def dead_letters(self) -> list[tuple[str, int, int]]:
        """(topic, partition, offset) of each record in the dead-letter table."""
        assert self.cfg.dead_letter_table is not None
        return [(d.topic, d.partition, d.offset)
                for d in chaos.dead_letters(self.dsn, self.cfg.dead_letter_table, self.name)]


def _failing(rows: Iterator[Any], after: int) -> Iterator[Any]:
    seen = 0
    for b in rows:
        yield b
        seen += b.num_rows
        if seen >= after:
            raise RuntimeError(f"test: this task attempt fails after {seen} rows")


def json_staging(dsn: str, bootstrap: str, make_topic: Any, unique: str, *,
                 records: int = 400, split: int = 100,
                 producer: dict[str, str] | None = None) -> KafkaStaging:
    """`records` JSON records on a 2-partition source into a fresh 2-partition output topic,
    keyed by event_id."""
    src = make_topic("ov-src", 2)
    out = make_topic("ov-out", 2)
    workload = Workload(bootstrap, src, 2, f"ov{unique}")
    workload.plain(records)
    raw: dict[str, Any] = {
        "name": f"ov_{unique}", "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [src], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"type": "kafka", "connection": dsn, "topic": out,
                 "key_column": "event_id", "producer": producer or {}},
        "spark": {"master": "local[2]", "max_offsets_per_task": split}}
    return KafkaStaging(*_planned(raw, dsn), dsn, bootstrap, out, split, workload)


def oversized_staging(dsn: str, bootstrap: str, make_topic: Any, unique: str, prefix: str, *,
                      max_message_bytes: str, at: int
                      ) -> tuple[KafkaStaging, tuple[str, int, int]]:
    """The 60 `SMALL` raw records with one of 3,000 random bytes put before SMALL[at] (at
    60: last), on a 2-partition source, into a 2-partition output topic of
    `max_message_bytes`, lz4 compressed, bad records to a dead-letter table, parts of 10
    offsets; with the large record's (topic, partition, offset)."""
    src = make_topic(f"{prefix}-src", 2)
    out = make_topic(f"{prefix}-out", 2, {"max.message.bytes": max_message_bytes})
    coords = produce(bootstrap, src, [*SMALL[:at], (1, b"oversized", os.urandom(3000), 0),
                                      *SMALL[at:]])
    name = f"{prefix}_{unique}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [src]}, "format": {"type": "raw"},
        "sink": {"type": "kafka", "connection": dsn, "topic": out,
                 "value_format": "raw", "producer": {"compression.type": "lz4"}},
        "bad_records": "dead_letter", "dead_letter_table": f"{name}_dead",
        "spark": {"master": "local[2]", "max_offsets_per_task": 10}}
    return KafkaStaging(*_planned(raw, dsn), dsn, bootstrap, out, split=10), (src, *coords[at])


def _planned(raw: dict[str, Any], dsn: str) -> tuple[PipelineConfig, Batch]:
    cfg = parse_pipeline(raw, f"<test {raw['name']}>", {})
    planned = plan_only(cfg, dsn)
    assert planned.batch is not None
    return cfg, planned.batch


def task_file_reads(monkeypatch: Any) -> list[tuple[int, str]]:
    """(part, path) of every task file the driver in this process reads from now on
    (`taskfile.read_part_file` spied on for the test)."""
    from offsetflow.sinks.kafka import taskfile

    seen: list[tuple[int, str]] = []
    real = taskfile.read_part_file

    def spy(batch_id: int, part: int, entry: Any, *args: Any, **kw: Any) -> Any:
        seen.append((part, str(entry["path"])))
        return real(batch_id, part, entry, *args, **kw)

    monkeypatch.setattr(taskfile, "read_part_file", spy)
    return seen


def stage_query_rows(dsn: str, name: str, types: dict[str, str], batch: Any,
                     sink_cfg: Any, session: Sequence[str] = ()) -> list[tuple[Any, ...]]:
    """The sink's stage query (`parts_select_sql`, under its OUTPUT_SETTINGS) over `batch`
    COPYed into a temporary table of the columns `types`: what the stage path would
    produce, to compare the task-built records with. `session`: statements run first (a
    session's own settings, which OUTPUT_SETTINGS must override)."""
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            for statement in session:
                cur.execute(statement)
            table = sql.Identifier(name)
            cur.execute(sql.SQL("CREATE TEMP TABLE {} ({})").format(table, sql.SQL(", ").join(
                sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
                for c, t in types.items())))
            data = pgcopy.encode(batch, list(types.values()))
            assert data is not None
            cur.copy_expert(sql.SQL("COPY {} FROM STDIN (FORMAT binary)").format(table),
                            io.BytesIO(data))
            cur.execute(OUTPUT_SETTINGS)
            cur.execute(parts_select_sql(sink_cfg, types, [(table, None)]))
            rows = cur.fetchall()
        conn.rollback()
    finally:
        conn.close()
    return rows
