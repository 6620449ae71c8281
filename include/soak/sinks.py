"""What differs per sink in the soak, one small class each: the pipeline's sink section, the
faults that apply to it, how a fault reaches into its commit (a pause or a kill at its own
commit), its maintenance, and how its target is read back for the checker.

The sink's own commit is step 4 of the commit protocol; for an external sink (Iceberg table,
Kafka topic) it is a commit of its own between the fence and the ledger's commit, with
test-only fault points (`OFFSETFLOW_ICEBERG_FAULT`, `OFFSETFLOW_TEST_SINK_KAFKA_FAULT`) to
pause there or die right after it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import PipelineConfig
from offsetflow.ledger import Batch
from offsetflow.ranges import TopicPartition
from offsetflow.sinks.iceberg.commit import FAULT_ENV as ICEBERG_FAULT_ENV
from offsetflow.sinks.iceberg.tasks import TASK_FAULT_ENV as ICEBERG_TASK_FAULT_ENV
from offsetflow.sinks.kafka.sink import FAULT_ENV as KAFKA_FAULT_ENV
from offsetflow.sinks.kafka.sink import PAUSED_ENV as KAFKA_PAUSED_ENV
from offsetflow.sinks.kafka.sink import RESUME_ENV as KAFKA_RESUME_ENV
from tests.tooling import chaos
from tests.tooling.checker import DeadLetter, ProducedRecord, SinkRow, check
from tests.tooling.iceberg_rows import iceberg_sink_rows, iceberg_table
from tests.tooling.topic_checker import read_topic
from tests.tooling.topic_checker import sink_rows as topic_rows

# faults every sink takes (see include/soak/faults.py)
COMMON = ("kill_after_plan", "task_failure", "kill_after_staging", "cut_commit_connection",
          "restart_postgres", "crash_postgres", "restart_kafka", "kill_kafka", "kill_executor",
          "kill_after_commit", "zombie_same_batch", "large_records", "tombstones", "replay",
          "maintenance")
# faults at a sink's own commit (between the fence and the ledger's commit)
AT_SINK_COMMIT = ("kill_in_sink_commit", "kill_after_sink_commit",
                  "crash_postgres_at_sink_commit")
TRANSFORM = "tests.tooling.chaos.maybe_fail_task"  # fails tasks with OFFSETFLOW_CHAOS_TASK_FAIL


def run_logged(cmd: list[str], log: Path, env: Mapping[str, str]) -> str:
    """Run a maintenance command to its end; its output (also appended to `log`)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(env))
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}  (rc {done.returncode})\n{done.stdout}{done.stderr}\n")
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed (rc {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout


class SinkSoak:
    """One sink's part of a soak; the run itself (`include/soak/run.py`) never asks which."""

    kind: ClassVar[str]
    faults: ClassVar[tuple[str, ...]] = COMMON
    tombstones: ClassVar[str] = "dead_letter"  # where the checker wants a null value
    external: ClassVar[bool] = True  # a commit of its own before the ledger's

    def __init__(self, out: Path, name: str, dsn: str, bootstrap: str) -> None:
        self.out, self.name, self.dsn, self.bootstrap = out, name, dsn, bootstrap
        self.counts: Counter[str] = Counter()  # what its maintenance did

    def prepare(self) -> None:
        """Create what the target needs before the first batch."""

    def config(self) -> dict[str, Any]:
        """The pipeline's config beyond the shared part: its sink (and a transform)."""
        raise NotImplementedError

    def task_failure_env(self, tag: str) -> dict[str, str]:
        """A job's environment in which a Spark task attempt fails (Spark retries it)."""
        return {"OFFSETFLOW_CHAOS_TASK_FAIL": "1"}

    def pause_env(self, tag: str) -> dict[str, str]:
        """A job's environment in which it waits inside its sink's commit for `resume`."""
        raise NotImplementedError

    def paused(self, tag: str) -> bool:
        raise NotImplementedError

    def resume(self, tag: str) -> None:
        raise NotImplementedError

    def kill_after_sink_commit_env(self) -> dict[str, str]:
        """A job's environment in which it dies after its sink's commit, before the ledger's."""
        raise NotImplementedError

    def maintain(self, file: Path, env: Mapping[str, str], idle: bool) -> None:
        """A maintenance run; `idle`: no job writes meanwhile (an open batch may wait)."""
        run_logged(["offsetflow", "cleanup"], self.out / "maintenance.log", env)
        self.counts["cleanup_runs"] += 1

    def refused(self, large: Collection[str]) -> Collection[str]:
        """Records the target cannot take as they are (dead letters by design)."""
        return frozenset()

    def rows(self, cfg: PipelineConfig) -> list[SinkRow]:
        """The target read back, as readers see it."""
        raise NotImplementedError

    def extra(self, cfg: PipelineConfig, produced: Iterable[ProducedRecord],
              positions: Mapping[TopicPartition, int], dead: list[DeadLetter],
              batches: list[Batch], large: Collection[str]) -> tuple[dict[str, Any], bool]:
        """Figures and verdict of targets besides the main one (a replay topic)."""
        return {}, True


class PostgresSoak(SinkSoak):
    """The target's rows and the ledger commit in one PostgreSQL transaction: no commit of
    its own to break; the transform path (tasks fail through the transform)."""

    kind = "postgres"
    external = False

    def config(self) -> dict[str, Any]:
        return {"transform": TRANSFORM, "sink": {"connection": self.dsn, "table": self.name}}

    def rows(self, cfg: PipelineConfig) -> list[SinkRow]:
        return chaos.sink_rows(self.dsn, cfg.sink.table)


class IcebergSoak(SinkSoak):
    """An append table in a file warehouse, SQL catalog on the stack's PostgreSQL; no
    transform, so the tasks write the data files themselves (the sink's fast path)."""

    kind = "iceberg"
    faults = COMMON + AT_SINK_COMMIT

    def config(self) -> dict[str, Any]:
        warehouse = self.out / "warehouse"
        warehouse.mkdir(exist_ok=True)
        return {"sink": {"type": "iceberg", "connection": self.dsn,
                         "table": f"lake.{self.name}",
                         "catalog": {"warehouse": f"file://{warehouse}"},
                         "partition_by": ["partition"], "sort_by": ["offset"]}}

    def task_failure_env(self, tag: str) -> dict[str, str]:
        # one task attempt dies after writing its data files, before its marker
        return {ICEBERG_TASK_FAULT_ENV: f"kill-after-files:{self.out / f'task-{tag}'}"}

    def pause_env(self, tag: str) -> dict[str, str]:
        return {ICEBERG_FAULT_ENV: f"pause-before-commit:{self.out / f'pause-{tag}'}"}

    def paused(self, tag: str) -> bool:
        return (self.out / f"pause-{tag}").exists()

    def resume(self, tag: str) -> None:
        (self.out / f"pause-{tag}").unlink(missing_ok=True)

    def kill_after_sink_commit_env(self) -> dict[str, str]:
        return {ICEBERG_FAULT_ENV: "after-commit"}

    def maintain(self, file: Path, env: Mapping[str, str], idle: bool) -> None:
        """Expire every snapshot the expiry allows; sweep unreferenced files of any age when
        no job writes, else only those older than an hour (the docs' rule: never younger
        than the longest write)."""
        super().maintain(file, env, idle)
        out = run_logged([sys.executable, "-m", "offsetflow.sinks.iceberg.maint",
                          "--pipeline-file", str(file), "--expire-snapshots-older-than-days",
                          "0", "--orphans-older-than-hours", "0" if idle else "1"],
                         self.out / "maintenance.log", env)
        for what, pattern in (("snapshots_expired", r"expired (\d+) snapshots"),
                              ("orphan_files_removed", r"removed (\d+) orphan")):
            m = re.search(pattern, out)
            self.counts[what] += int(m.group(1)) if m else 0
        self.counts["iceberg_maint_runs"] += 1

    def rows(self, cfg: PipelineConfig) -> list[SinkRow]:
        return iceberg_sink_rows(cfg, self.dsn)

    def extra(self, cfg: PipelineConfig, produced: Iterable[ProducedRecord],
              positions: Mapping[TopicPartition, int], dead: list[DeadLetter],
              batches: list[Batch], large: Collection[str]) -> tuple[dict[str, Any], bool]:
        table = iceberg_table(cfg, self.dsn)
        files = list((self.out / "warehouse").rglob("*.parquet"))
        return {"snapshots_left": len(table.snapshots()), "data_files_left": len(files)}, True


class KafkaSoak(SinkSoak):
    """A topic with a replay_topic; the transform path (tasks fail through the transform).
    The producer's record limit (500,000 bytes) is below the 1 MB records: those go to the
    dead letters by design (stage `sink`), so dead letters and their replays are soaked."""

    kind = "kafka"
    faults = COMMON + AT_SINK_COMMIT + ("kill_kafka_at_sink_commit",)
    tombstones = "row"  # a Kafka sink forwards a tombstone as a tombstone
    RECORD_LIMIT = 500_000

    @property
    def topic(self) -> str:
        return f"{self.name}-out"

    @property
    def replay_topic(self) -> str:
        return f"{self.name}-replayed"

    def prepare(self) -> None:
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for f in admin.create_topics([NewTopic(t, 3, 1) for t in (self.topic,
                                                                   self.replay_topic)]).values():
            f.result(30)

    def config(self) -> dict[str, Any]:
        return {"transform": TRANSFORM,
                "sink": {"type": "kafka", "connection": self.dsn, "topic": self.topic,
                         "replay_topic": self.replay_topic,
                         "producer": {"message.max.bytes": self.RECORD_LIMIT}}}

    def pause_env(self, tag: str) -> dict[str, str]:
        return {KAFKA_FAULT_ENV: "pause_before_commit",
                KAFKA_PAUSED_ENV: str(self.out / f"paused-{tag}"),
                KAFKA_RESUME_ENV: str(self.out / f"resume-{tag}")}

    def paused(self, tag: str) -> bool:
        return (self.out / f"paused-{tag}").exists()

    def resume(self, tag: str) -> None:
        (self.out / f"resume-{tag}").write_text("go")

    def kill_after_sink_commit_env(self) -> dict[str, str]:
        return {KAFKA_FAULT_ENV: "kill_after_commit"}

    def refused(self, large: Collection[str]) -> Collection[str]:
        return large

    def rows(self, cfg: PipelineConfig) -> list[SinkRow]:
        return topic_rows(read_topic(self.bootstrap, self.topic, "read_committed", 900))

    def extra(self, cfg: PipelineConfig, produced: Iterable[ProducedRecord],
              positions: Mapping[TopicPartition, int], dead: list[DeadLetter],
              batches: list[Batch], large: Collection[str]) -> tuple[dict[str, Any], bool]:
        """The replay topic holds each record of the committed replays' ranges once (a
        record over the limit: its dead letter once); nothing else."""
        windows = [(r.topic, r.partition, r.from_offset, r.until_offset) for b in batches
                   if b.kind == "replay" and b.status == "committed" for r in b.ranges]

        def in_windows(topic: str, part: int, off: int) -> bool:
            return any(t == topic and p == part and lo <= off < hi for t, p, lo, hi in windows)

        replayed = [p for p in produced if in_windows(*p.coordinates)]
        rows = topic_rows(read_topic(self.bootstrap, self.replay_topic, "read_committed", 900))
        rep = check(replayed, rows, positions,
                    [d for d in dead if in_windows(d.topic, d.partition, d.offset)],
                    tombstones=self.tombstones, refused=large)
        in_log = {t: len(read_topic(self.bootstrap, t, "read_uncommitted", 900))
                  for t in (self.topic, self.replay_topic)}
        figures = {"replay_topic": rep.summary(),
                   "replay_topic_examples": rep.explain() if not rep.ok else "",
                   "records_in_log_incl_aborted_attempts": in_log}
        return figures, rep.ok and rep.expected == sum(1 for p in replayed if p.committed)


SINKS: dict[str, type[SinkSoak]] = {s.kind: s for s in (PostgresSoak, IcebergSoak, KafkaSoak)}
