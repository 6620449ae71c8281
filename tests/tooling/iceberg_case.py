"""The Iceberg sink's fault `Case`: the same pipeline and workload writing an Iceberg table
in a file warehouse, judged by a pyiceberg scan; and a replay or backfill window run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offsetflow.ledger import Ledger
from offsetflow.ops import kafka_for, plan_window, run_batches, submit_window
from offsetflow.plan import parse_request
from tests.tooling import chaos
from tests.tooling.checker import check
from tests.tooling.fault_case import Case
from tests.tooling.iceberg_rows import iceberg_sink_rows, snapshot_batches


class IcebergCase(Case):
    """A fault `Case` whose pipeline writes an Iceberg table."""

    def __init__(self, tmp: Path, *args: Any, **kw: Any) -> None:
        super().__init__(tmp, *args, **kw)
        self.warehouse = tmp / "warehouse"
        self.warehouse.mkdir()
        self.raw["sink"] = {"type": "iceberg", "connection": self.dsn,
                            "table": f"lake.{self.table}",
                            "catalog": {"warehouse": f"file://{self.warehouse}"},
                            "partition_by": ["partition"], "sort_by": ["offset"]}
        self.write_config()

    def assert_exactly_once(self, expect_all: bool = True,
                            tombstones: str = "dead_letter") -> None:
        """The table's rows of this case's topic (other pipelines may write the table
        too) and its dead letters against everything produced."""
        cfg = self.cfg
        rows = [r for r in iceberg_sink_rows(cfg, self.dsn) if r.topic == self.workload.topic]
        rep = check(self.workload.produced.values(), rows,
                    self.positions(),
                    chaos.dead_letters(self.dsn, cfg.dead_letter_table, cfg.name),
                    tombstones=tombstones)
        assert rep.ok, rep.explain()
        if expect_all:
            assert rep.expected == self.workload.committed_count, rep.explain()

    def job_with(self, batch_id: int, connect_url: str | None = None, **env: str) -> Any:
        """`offsetflow run-batch` with `env`: its own spark-submit JVM, or with `connect_url`
        a thin client of that Spark Connect server (`chaos.connect_file`: for a driver-side
        fault after the batch's tasks ended; a task-side fault needs the job's own JVM)."""
        file = chaos.connect_file(self.file, connect_url) if connect_url else self.file
        return chaos.run_batch_process(file, batch_id, self.log, env=env)

    def two_runs_at_once(self, spark: Any, batch_id: int, connect_url: str) -> None:
        """A job process (a thin client of the Spark Connect server at `connect_url`) runs
        the batch; once it has taken it (running), a second run starts in this process's
        warm Spark session, so both work on it at once, two drivers in two processes (no
        JVM of its own for either). The commit's fencing must let exactly one commit it."""
        from offsetflow.job import run_batch

        proc = self.job_with(batch_id, connect_url)
        chaos.wait_for(lambda: self.batch(batch_id).status == "running"
                       or proc.poll() is not None, 300, "the job process to take the batch")
        try:
            here = run_batch(spark, self.cfg, batch_id, self.dsn).result.status
        except Exception as e:  # noqa: BLE001 - the losing run may fail; one must commit
            here = repr(e)
        code = proc.wait(timeout=600)
        assert code == 0 or here in ("committed", "already_committed"), (
            here, self.job_output()[-4000:])
        assert self.batch(batch_id).status == "committed"
        assert snapshot_batches(self.cfg, self.dsn) == [batch_id]

    def data_files(self) -> set[Path]:
        return set(self.warehouse.rglob("*.parquet"))

    def died_between_the_commits(self, spark: Any, batch_id: int, after: str) -> None:
        """`died_between_the_commits` for this case's pipeline; the batch is not committed."""
        died_between_the_commits(spark, self.cfg, batch_id, self.dsn, after)
        assert self.batch(batch_id).status != "committed"


def window(case: IcebergCase, spark: Any, kind: str, **conf: Any) -> list[int]:
    """A `kind` window (replay, backfill) of `conf` planned, submitted and run; its batch ids."""
    cfg = case.cfg
    req = parse_request(kind, {"pipeline": cfg.name, "topic": case.workload.topic, **conf})
    with Ledger(case.dsn) as ledger:
        ids = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req), "test")
    run_batches(cfg, case.dsn, ids, spark)
    return ids


def died_between_the_commits(spark: Any, cfg: Any, batch_id: int, dsn: str, after: str
                             ) -> None:
    """Run the batch and stop where a killed driver would, in this process (no job JVM of
    its own): `after` "files" (the tasks' data files written and listed in their markers,
    no catalog commit) or "iceberg" (the snapshot committed, the ledger's transaction not).
    Either way the ledger's transaction rolls back, as a killed driver's connection does."""
    import pytest

    from offsetflow.commit import protocol
    from offsetflow.job import run_batch
    from offsetflow.sinks.iceberg import commit

    def die(*_: Any) -> None:
        raise RuntimeError(f"test: died after {after}")

    with pytest.MonkeyPatch.context() as m:
        if after == "files":
            m.setattr(commit, "_fault", lambda point: die() if point == "after-files"
                      else None)
        else:
            m.setattr(protocol, "record_batch", die)
        with pytest.raises(RuntimeError, match="test: died"):
            run_batch(spark, cfg, batch_id, dsn)
