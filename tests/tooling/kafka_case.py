"""The Kafka topic sink's test pipelines: a config for one, and the fault tests' case (a
planned batch of a workload on a fresh source topic into a fresh output topic, its job run as
a process with the sink's test-only fault points) with the means to inspect and break it."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg2
import yaml

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.sinks.kafka.sink import FAULT_ENV, PAUSED_ENV, RESUME_ENV
from tests.tooling import chaos
from tests.tooling.chaos import SCHEMA, Workload
from tests.tooling.topic_checker import TopicVerdict, check_topic

RECORDS = 400


@dataclass
class KafkaCase:
    """A Kafka-sink pipeline with its planned batch (`make_case`), run as a process."""

    name: str
    src: str
    out: str
    dsn: str
    bootstrap: str
    dir: Path
    workload: Workload
    cfg: PipelineConfig
    batch_id: int

    @property
    def file(self) -> Path:
        return self.dir / f"{self.name}.yaml"

    @property
    def log(self) -> Path:
        return self.dir / "job.log"

    def start(self, fault: str, connect_url: str | None = None) -> Any:
        """The batch's job as a process with the sink's fault point `fault`: its own JVM, or
        with `connect_url` a thin client of that Spark Connect server (`chaos.connect_file`;
        the fault points are in the driver's commit, after every task has ended)."""
        env = {FAULT_ENV: fault, PAUSED_ENV: str(self.dir / "paused"),
               RESUME_ENV: str(self.dir / "resume")}
        file = chaos.connect_file(self.file, connect_url) if connect_url else self.file
        return chaos.run_batch_process(file, self.batch_id, self.log, env=env)

    def wait_paused(self, proc: Any) -> None:
        chaos.wait_for(lambda: (self.dir / "paused").exists() or proc.poll() is not None,
                       300, "the job to hold its Kafka transaction open")
        assert proc.poll() is None, self.output()[-3000:]

    def high_watermarks(self) -> dict[int, int]:
        """The output topic's end offset per partition (read_uncommitted: open transactions'
        records and their control records count)."""
        from confluent_kafka import Consumer, TopicPartition

        # read_uncommitted: under librdkafka's default (read_committed) the end offset
        # asked for is the last stable one, which stops before an open transaction
        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"hw-{self.name}",
                      "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
        try:
            parts = c.list_topics(self.out, timeout=10).topics[self.out].partitions
            return {p: c.get_watermark_offsets(TopicPartition(self.out, p), timeout=10)[1]
                    for p in parts}
        finally:
            c.close()

    def wait_aborted_by_the_broker(self, open_ends: dict[int, int], timeout_s: float) -> None:
        """Until the broker ended the open transaction on its own: an abort marker after
        the records in each partition that has some (`open_ends`: the end offsets while the
        transaction was open), which the coordinator writes after bumping the epoch."""
        def ended() -> bool:
            now = self.high_watermarks()
            return all(now[p] > end for p, end in open_ends.items() if end > 0)
        chaos.wait_for(ended, timeout_s, f"the broker to abort the transaction open on "
                                         f"{self.out}", every_s=0.5)

    def resume(self) -> None:
        (self.dir / "resume").write_text("go")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def status(self) -> str:
        with Ledger(self.dsn) as ledger:
            return ledger.get_batch(self.batch_id).status

    def verdict(self) -> TopicVerdict:
        with Ledger(self.dsn) as ledger:
            positions = ledger.positions(self.name)
        v = check_topic(self.bootstrap, self.out, self.workload.produced.values(), positions)
        assert v.committed.ok, v.committed.explain()
        assert v.committed.found == v.committed.expected == RECORDS
        assert v.batches == {self.batch_id}
        return v


def make_case(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
              tmp_path: Path, *, spark: dict[str, Any] | None = None,
              dead_letter: bool = False, out_config: dict[str, str] | None = None,
              before_plan: Any = None, task_files: str = "off") -> KafkaCase:
    """The pipeline and its planned batch; `before_plan(src)` adds records to the batch.
    `task_files`: `sink.task_files`, the PostgreSQL stage unless asked (`auto`, the
    sink's default, would write task files on this local master: the cases of the stage
    path would not run it; the task-file cases ask through `KafkaTopicSink.task_files_dir`
    or a directory)."""
    src = make_topic("kf-src", 2)
    out = make_topic("kf-out", 2, out_config)
    w = Workload(kafka_bootstrap, src, 2, f"kf{unique}")
    w.plain(RECORDS - 100)
    w.transaction(60, commit=False)
    w.transaction(100, commit=True)
    if before_plan is not None:
        before_plan(src)
    name = f"kf_{unique}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [src], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"type": "kafka", "connection": pg_dsn, "topic": out,
                 "key_column": "event_id", "task_files": task_files},
        "spark": {"master": "local[2]", **(spark or {})},
    }
    if dead_letter:
        raw.update({"bad_records": "dead_letter", "dead_letter_table": f"{name}_dead"})
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    cfg = parse_pipeline(raw, str(tmp_path / f"{name}.yaml"), {})
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    return KafkaCase(name, src, out, pg_dsn, kafka_bootstrap, tmp_path, w, cfg,
                planned.batch.batch_id)


@contextlib.contextmanager
def killed_at_end(proc: Any) -> Any:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            chaos.kill(proc)


def cut_idle_ledger_transactions(dsn: str) -> int:
    """pg_terminate_backend of every OffsetFlow connection idle inside a transaction: a held
    job's commit, whose batch row lock then goes with it."""
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn, conn.cursor() as cur:
            cur.execute("""SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                            WHERE application_name = 'offsetflow'
                              AND state = 'idle in transaction'
                              AND datname = current_database()""")
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def range_records(dsn: str, batch_id: int) -> dict[tuple[str, int], int]:
    """batch_ranges.records of the batch, per topic/partition."""
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT topic, partition, records FROM offsetflow.batch_ranges "
                    "WHERE batch_id = %s", (batch_id,))
        found = {(t, int(p)): int(n or 0) for t, p, n in cur.fetchall()}
    conn.close()
    return found


def delete_batch_records(bootstrap: str, dsn: str, batch_id: int) -> None:
    """delete-records up to each range's until_offset: as if retention had run."""
    from confluent_kafka import TopicPartition as KTP
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    with Ledger(dsn) as ledger:
        ranges = ledger.get_batch(batch_id).ranges
    for f in admin.delete_records([KTP(r.topic, r.partition, r.until_offset)
                                   for r in ranges]).values():
        f.result(30)


def kafka_sink_pipeline(name: str, source: str, dsn: str, bootstrap: str,
                        **sink: Any) -> PipelineConfig:
    split = sink.pop("split", 100_000)
    raw: dict[str, Any] = {
        "name": name,
        "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [source], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"type": "kafka", "connection": dsn, **sink},
        "spark": {"master": "local[2]", "max_offsets_per_task": split},
    }
    return parse_pipeline(raw, f"<test {name}>", {})


def with_task_files(cfg: PipelineConfig, where: Path | str, mode: int | None = None
                    ) -> PipelineConfig:
    """`cfg` with `sink.task_files` set to `where`: a directory, or "off" (the PostgreSQL
    stage) or "auto" (the default); `mode`: `sink.task_files_mode`."""
    kafka = cfg.sink.kafka
    assert kafka is not None
    named = str(where) not in ("off", "auto")
    kafka = dataclasses.replace(kafka, task_files=str(where) if named else None,
                                task_files_auto=str(where) == "auto")
    if mode is not None:
        kafka = dataclasses.replace(kafka, task_files_mode=mode)
    return dataclasses.replace(cfg, sink=dataclasses.replace(cfg.sink, kafka=kafka))
