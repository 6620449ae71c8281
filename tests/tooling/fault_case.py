"""The fault tests' `Case`: one pipeline on one fresh topic, with a workload that remembers
what it wrote, and the ways to break its batch at each step (jobs as real processes)."""

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

    def job(self, batch_id: int) -> subprocess.Popen[Any]:
        return chaos.run_batch_process(self.file, batch_id, self.log)

    def planned_batch(self, records: int, seed: int) -> int:
        """Write a mixed workload and plan a batch over it."""
        self.workload.mixed(records, random.Random(seed))
        planned = plan_only(self.cfg, self.dsn)
        assert planned.batch is not None
        return planned.batch.batch_id

    @contextlib.contextmanager
    def job_waiting_to_commit(self, batch_id: int) -> Iterator[subprocess.Popen[Any]]:
        """A job process that has staged everything and waits at the commit's first step
        (the batch row is held), for a fault to be injected right there."""
        with chaos.hold_positions(self.dsn, self.cfg.name):
            proc = self.job(batch_id)
            chaos.wait_for(lambda: chaos.commit_waiting(self.dsn), 300, "the commit to start")
            assert self.batch(batch_id).status == "running"
            assert chaos.staged_rows(self.dsn, batch_id) > 0, "the fault must come after staging"
            yield proc

    def postgres_down_in_commit(self, batch_id: int, stop: str) -> None:
        """The job stages everything and waits in its commit; PostgreSQL then goes down
        (`stop`: the stack.sh command, pg-stop or pg-crash) and comes back. The job must
        fail, and nothing may be committed. Only our own lock connection's death is
        expected here: a commit window that never opened is an error, not that."""
        proc = None
        try:
            with self.job_waiting_to_commit(batch_id) as proc:
                chaos.stack(stop)
        except psycopg2.Error:
            pass
        finally:
            chaos.stack("pg-start")
        assert proc is not None and proc.wait(timeout=120) != 0
        assert set(self.positions().values()) == {0}  # the start: nothing committed

    def job_output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

