"""The fault tests' `Case`: one pipeline on one fresh topic, with a workload that remembers
what it wrote, and the ways to break its batch at each step: jobs as real processes where
the driver is killed (a Spark Connect client of the warm server where the kill comes after
the tasks, at the commit), in a thread of the test process where a service is."""

from __future__ import annotations

import contextlib
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg2
import yaml

from offsetflow.config import PipelineConfig, load_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from tests.tooling import chaos
from tests.tooling.checker import check


class Case:
    """One pipeline on one fresh topic, with a workload that remembers what it wrote."""

    def __init__(self, tmp: Path, dsn: str, bootstrap: str, topic: str, partitions: int,
                 unique: str, **source: Any) -> None:
        self.dsn = dsn
        self.table = f"f_{unique}"
        self.file = tmp / f"f_{unique}.yaml"
        self.log = tmp / "job.log"
        self.raw = {"name": f"f_{unique}", "kafka": {"bootstrap_servers": bootstrap},
                    "source": {"topics": [topic], "max_records_per_partition": 2000, **source},
                    "format": {"type": "json", "schema": dict(chaos.SCHEMA)},
                    "sink": {"connection": dsn, "table": self.table},
                    "spark": {"master": "local[2]", "max_offsets_per_task": 700}}
        self.write_config()
        self.workload = chaos.Workload(bootstrap, topic, partitions, f"w{unique}")

    def write_config(self) -> None:
        self.file.write_text(yaml.safe_dump(self.raw))

    @property
    def cfg(self) -> PipelineConfig:
        return load_pipeline(self.file)

    def positions(self) -> dict[tuple[str, int], int]:
        with Ledger(self.dsn) as ledger:
            return ledger.positions(self.cfg.name)

    def batch(self, batch_id: int) -> Any:
        with Ledger(self.dsn) as ledger:
            return ledger.get_batch(batch_id)

    def assert_exactly_once(self, expect_all: bool = True,
                            tombstones: str = "dead_letter") -> None:
        """Target rows and the pipeline's dead letters against everything produced."""
        cfg = self.cfg
        rep = check(self.workload.produced.values(), chaos.sink_rows(self.dsn, self.table),
                    self.positions(),
                    chaos.dead_letters(self.dsn, cfg.dead_letter_table, cfg.name),
                    tombstones=tombstones)
        assert rep.ok, rep.explain()
        if expect_all:
            assert rep.expected == self.workload.committed_count, rep.explain()

    def job(self, batch_id: int, connect_url: str | None = None) -> subprocess.Popen[Any]:
        """`offsetflow run-batch` as a process: its own spark-submit JVM, or with
        `connect_url` a thin client of that Spark Connect server (`chaos.connect_file`)."""
        file = chaos.connect_file(self.file, connect_url) if connect_url else self.file
        return chaos.run_batch_process(file, batch_id, self.log)

    def in_thread(self, spark: Any, batch_id: int) -> chaos.JobThread:
        """The batch run in a thread of this process, in the test's Spark session."""
        from offsetflow.job import run_batch

        cfg = self.cfg
        return chaos.JobThread(lambda: run_batch(spark, cfg, batch_id, self.dsn))

    def planned_batch(self, records: int, seed: int) -> int:
        """Write a mixed workload and plan a batch over it."""
        self.workload.mixed(records, random.Random(seed))
        planned = plan_only(self.cfg, self.dsn)
        assert planned.batch is not None
        return planned.batch.batch_id

    @contextlib.contextmanager
    def job_waiting_to_commit(self, batch_id: int, connect_url: str | None = None,
                              spark: Any = None) -> Iterator[Any]:
        """A run that has staged everything and waits at the commit's first step (the batch
        row is held), for a fault to be injected right there: a job process (`job`), or with
        `spark` a run in a thread of this process (`in_thread`: no process to kill)."""
        with chaos.hold_positions(self.dsn, self.cfg.name):
            proc = (self.in_thread(spark, batch_id) if spark is not None
                    else self.job(batch_id, connect_url))
            chaos.wait_for(lambda: chaos.commit_waiting(self.dsn) or proc.poll() is not None,
                           300, "the commit to start")
            assert proc.poll() is None, f"the run ended before its commit: {self._ended(proc)}"
            assert self.batch(batch_id).status == "running"
            assert chaos.staged_rows(self.dsn, batch_id) > 0, "the fault must come after staging"
            yield proc

    def postgres_down_in_commit(self, spark: Any, batch_id: int, stop: str) -> None:
        """The run stages everything and waits in its commit; PostgreSQL then goes down
        (`stop`: the stack.sh command, pg-stop or pg-crash) and comes back. The run must
        fail, and nothing may be committed. Only our own lock connection's death is
        expected here: a commit window that never opened is an error, not that. The run is
        a thread of this process in the test's Spark session (`in_thread`): PostgreSQL, not
        the driver, is what dies, and a job process met it the same way for a JVM more."""
        proc = None
        try:
            with self.job_waiting_to_commit(batch_id, spark=spark) as proc:
                chaos.stack(stop)
        except psycopg2.Error:
            pass
        finally:
            chaos.stack("pg-start")
        assert proc is not None and proc.wait(timeout=120) != 0
        assert set(self.positions().values()) == {0}  # the start: nothing committed

    def _ended(self, proc: Any) -> str:
        error = getattr(proc, "error", None)
        return repr(error) if error is not None else self.job_output()[-3000:]

    def job_output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

