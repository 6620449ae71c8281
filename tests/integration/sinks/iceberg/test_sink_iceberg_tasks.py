"""Task-side Iceberg data files (issue 17): the Spark tasks write the table's Parquet data
files and list them in their markers; the driver commits them in one catalog commit
without reading a row. Faults hit a task attempt after its files are written and before
its marker commits; the checker reads the table back with a pyiceberg scan."""

from __future__ import annotations

import contextlib
import re
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pyarrow.compute as pc
import pytest

from offsetflow.job import run_batch
from offsetflow.ledger import connect, stage_table
from offsetflow.ops import run_until_caught_up
from offsetflow.ops.runner import run_cycle
from offsetflow.sinks import task_data_files
from offsetflow.sinks.iceberg import sink as sink_iceberg
from offsetflow.sinks.iceberg.files import canonical_path, referenced_files
from offsetflow.sinks.iceberg.sink import load_catalog
from offsetflow.sinks.iceberg.tasks import MAX_OPEN_WRITERS, TASK_FAULT_ENV
from tests.tooling import chaos
from tests.tooling.iceberg_case import IcebergCase
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.pipeline_data import pipeline_for, produce_with_negative_amounts, query


@pytest.fixture
def case(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
         unique: str) -> IcebergCase:
    topic = make_topic("icet", 2)
    return IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, topic, 2, unique)


@pytest.fixture(scope="module", autouse=True)
def fault_file(spark: Any, tmp_path_factory: Any) -> Iterator[Path]:
    """TASK_FAULT_ENV for the Python workers of this process's Spark session, no job
    process (no JVM) of its own: PySpark hands `SparkContext.environment` to every function
    it wraps. Spark starts a worker daemon and new workers per distinct environment, so the
    variable names this file (`@path`) for the whole module, and `task_fault` writes it."""
    path = tmp_path_factory.mktemp("task_fault") / "fault"
    env = spark.sparkContext.environment
    env[TASK_FAULT_ENV] = f"@{path}"
    yield path
    env.pop(TASK_FAULT_ENV, None)


@contextlib.contextmanager
def task_fault(fault_file: Path, fault: str) -> Iterator[None]:
    """`fault` in the tasks of the runs inside the block (none outside it)."""
    fault_file.write_text(fault)
    try:
        yield
    finally:
        fault_file.unlink(missing_ok=True)


@contextlib.contextmanager
def running(spark: Any, case: IcebergCase, batch_id: int) -> Iterator[Future[Any]]:
    """`run_batch` of `batch_id` in a thread of this process (its Spark session), while
    the test breaks things around it; the block waits for it to end."""
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(run_batch, spark, case.cfg, batch_id, case.dsn)
        try:
            yield run
        finally:
            with contextlib.suppress(Exception):
                run.exception(timeout=300)


def _failure(run: Future[Any]) -> str:
    """What a failed run says: its error and traceback (a job process's output)."""
    err = run.exception(timeout=300)
    assert err is not None, "the run did not fail"
    return "".join(traceback.format_exception(err))


def _unreferenced(case: IcebergCase) -> set[str]:
    referenced = referenced_files(iceberg_table(case.cfg, case.dsn))
    return {str(p) for p in case.data_files()} - referenced


def test_the_driver_commits_the_tasks_files_without_reading_the_stage(
        case: IcebergCase, spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows are in the tasks' data files when the driver commits: the stage holds no
    row with a value (tombstones only, routed to dead letters in PostgreSQL), and the
    driver's stage reader is never called."""
    bid = case.planned_batch(1500, seed=40)  # parts >= 2
    seen: dict[str, int] = {}
    write = sink_iceberg.IcebergSink.write

    def spy(self: Any, cur: Any, batch: Any, staged: int) -> Any:
        cur.execute(f"SELECT count(*) FILTER (WHERE value IS NOT NULL), count(*) FROM "
                    f"{stage_table(batch.batch_id).as_string(cur)}")
        seen["rows"], seen["all"] = cur.fetchone()
        seen["staged"] = staged
        cur.execute("""SELECT count(*), sum(jsonb_array_length(data_files))
                         FROM offsetflow.staged_parts WHERE batch_id = %s AND kind = 'rows'
                          AND data_files IS NOT NULL""", (batch.batch_id,))
        seen["parts"], seen["files"] = cur.fetchone()
        return write(self, cur, batch, staged)

    def no_stage_read(*_: Any, **__: Any) -> Any:
        raise AssertionError("the driver read the stage")

    monkeypatch.setattr(sink_iceberg.IcebergSink, "write", spy)
    monkeypatch.setattr(sink_iceberg, "read_stage", no_stage_read)
    rep = run_batch(spark, case.cfg, bid, case.dsn)
    assert rep.result.status == "committed"
    assert seen["rows"] == 0 and seen["staged"] > seen["all"], seen
    # every part listed the files it wrote
    assert seen["parts"] >= 2 and seen["files"] >= seen["parts"], seen
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    assert _unreferenced(case) == set()
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


@pytest.mark.slow
def test_a_task_attempt_killed_after_its_files_leaves_orphans_that_are_swept(
        case: IcebergCase, tmp_path: Path) -> None:
    """kill -9 of a Spark Python worker after its task wrote its data files and before its
    marker committed: Spark retries the task (local[2,2]), the retried attempt's files are
    committed once, the dead attempt's are referenced by no snapshot and deleted after the
    commit, in the same run (the batch's first)."""
    case.raw["spark"]["master"] = "local[2,2]"
    case.write_config()
    bid = case.planned_batch(1500, seed=41)
    flag = tmp_path / "killed"
    proc = case.job_with(bid, **{TASK_FAULT_ENV: f"kill-after-files:{flag}"})
    assert proc.wait(timeout=600) == 0, case.job_output()[-3000:]
    assert flag.exists(), "the fault never fired"
    assert "exited unexpectedly (crashed)" in case.job_output(), \
        "the faulted attempt did not die by the kill"
    dead = _written(flag)
    assert dead, "the killed attempt wrote no files"
    assert case.batch(bid).status == "committed" and case.batch(bid).attempts == 1
    assert not dead & referenced_files(iceberg_table(case.cfg, case.dsn))
    assert not any(Path(p).exists() for p in dead), "the dead attempt's files stay"
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    assert _unreferenced(case) == set()
    case.assert_exactly_once()


def _written(flag: Path) -> set[str]:
    """The files a faulted attempt wrote (the fault hook notes its pid, then them)."""
    return {canonical_path(p) for p in flag.read_text().splitlines()[1:]}


@pytest.mark.slow
def test_two_attempts_of_one_part_both_write_files_only_the_winning_markers_commit(
        case: IcebergCase, spark: Any, tmp_path: Path, pg_dsn: str, fault_file: Path) -> None:
    """A zombie: run A's task of part 0 writes its files and stalls before its marker
    commits; its PostgreSQL session is killed (as a network cut or an idle timeout
    would), run B writes part 0's files again and commits the batch; then A wakes up. A's
    files are never committed, and B's commit swept them."""
    bid = case.planned_batch(1000, seed=42)
    flag = tmp_path / "paused"
    with task_fault(fault_file, f"pause-after-files:{flag}"), running(spark, case, bid) as run_a:
        chaos.wait_for(lambda: flag.exists() or run_a.done(), 300,
                       "run A's part 0 to write its files")
        a_files = _written(flag)
        assert a_files and all(Path(p).exists() for p in a_files), a_files
        worker = int(flag.read_text().splitlines()[0])
        _terminate_sessions_of(worker, pg_dsn)
        rep = run_batch(spark, case.cfg, bid, case.dsn)  # run B
        assert rep.result.status == "committed"
        flag.unlink()  # A wakes up: its marker's session is gone
    table = iceberg_table(case.cfg, case.dsn)
    referenced = referenced_files(table)
    assert not a_files & referenced, "a file of the losing attempt was committed"
    assert any("p0-" in Path(p).name for p in referenced)  # B's part 0
    assert not any(Path(p).exists() for p in a_files), "the losing attempt's files stay"
    assert snapshot_batches(case.cfg, case.dsn) == [bid]
    assert _unreferenced(case) == set()
    run_until_caught_up(case.cfg, case.dsn, spark)
    case.assert_exactly_once()


def _terminate_sessions_of(pid: int, dsn: str) -> None:
    """Kill the PostgreSQL sessions of process `pid` (by its sockets' ports)."""
    ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
             if c.raddr}
    assert ports, f"process {pid} has no open connection"
    with connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("""SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                        WHERE client_port = ANY(%s)""", (list(ports),))
        assert cur.rowcount >= 1, "no session of the paused task found"
    time.sleep(0.5)




def test_a_quality_suite_keeps_the_stage_path_and_routes_the_failing_rows(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        gx_root: Path, tmp_path: Path) -> None:
    """The suite reads the batch's rows from the PostgreSQL stage, so such a pipeline stages
    there and the driver writes the files (`sinks.task_data_files` chooses)."""
    topic = make_topic("gxi", 1)
    bad = produce_with_negative_amounts(kafka_bootstrap, topic)
    table = f"gxi_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table,
                       quality={"suite": "amounts", "on_failure": "dead_letter"},
                       dead_letter_table=f"gxidead_{unique}",
                       sink={"type": "iceberg", "connection": pg_dsn, "table": f"lake.{table}",
                             "catalog": {"warehouse": f"file://{tmp_path}/wh"}})
    assert not task_data_files(cfg)
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    assert res.report.result.rows_written == 100 - len(bad)
    dead = query(pg_dsn, f"SELECT \"offset\", stage FROM gxidead_{unique} ORDER BY 1")
    assert dead == [(o, "quality") for o in bad]
    assert cfg.sink.iceberg is not None
    rows = load_catalog(cfg.sink.iceberg, pg_dsn).load_table(
        cfg.sink.iceberg.identifier).scan(selected_fields=("offset",)).to_arrow()
    assert sorted(rows["offset"].to_pylist()) == sorted(set(range(100)) - set(bad))
    files = list((tmp_path / "wh").rglob("*.parquet"))
    assert files and not any("-p0-" in p.name for p in files)  # the driver wrote them


@pytest.mark.slow
def test_a_partition_spec_change_before_the_commit_drops_the_parts_and_rewrites_them(
        case: IcebergCase, spark: Any, tmp_path: Path, fault_file: Path) -> None:
    """The tasks write their files under the table's spec (identity(partition)); before
    the driver commits, the spec gains a field (as warn_layout_drift tells a user to do).
    The commit refuses the files written under the old spec (StagedRowsLostError naming
    the spec change, never a bare IndexError from the manifest writer nor wrong partition
    values), the re-run writes them under the new spec, and a scan filtered on the new
    partition field returns every row."""
    from pyiceberg.expressions import EqualTo

    bid = case.planned_batch(800, seed=43)
    flag = tmp_path / "paused"
    with task_fault(fault_file, f"pause-after-files:{flag}"), running(spark, case, bid) as run:
        chaos.wait_for(lambda: flag.exists() or run.done(), 300,
                       "part 0 to write its files")
        table = iceberg_table(case.cfg, case.dsn)
        old_spec = table.spec().spec_id
        with table.update_spec() as update:
            update.add_identity("timestamp_type")
        flag.unlink()
        out = _failure(run)
    assert "IndexError" not in out, out[-3000:]
    assert "partition spec" in out and str(old_spec) in out, out[-3000:]
    assert case.batch(bid).status != "committed"
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert case.batch(bid).status == "committed"
    case.assert_exactly_once()
    table = iceberg_table(case.cfg, case.dsn)
    new_spec = table.spec().spec_id
    assert new_spec != old_spec
    every = table.scan(selected_fields=("timestamp_type",)).to_arrow()
    values = set(every.column("timestamp_type").to_pylist())
    assert every.num_rows == case.workload.committed_count and values, values
    for v in values:  # a file with wrong partition values is pruned away here
        want = every.filter(pc.equal(every.column("timestamp_type"), v)).num_rows
        assert table.scan(row_filter=EqualTo("timestamp_type", v)).to_arrow().num_rows == want
    assert _unreferenced(case) == set()


@pytest.mark.slow
def test_a_part_with_hundreds_of_partition_values_keeps_few_files_open(
        case: IcebergCase, spark: Any, tmp_path: Path, fault_file: Path) -> None:
    """identity(offset): every row of a part is its own partition value (600 per part).
    A task attempt keeps at most MAX_OPEN_WRITERS files open (the least recently used is
    closed and stays a valid data file), not one per value (about 1 MB and an fd each,
    which runs a part with thousands of values out of memory or fds on every attempt);
    every row is committed once."""
    case.raw["sink"]["partition_by"] = ["offset"]
    case.write_config()
    bid = case.planned_batch(2400, seed=44)
    notes = tmp_path / "open"
    notes.mkdir()
    with task_fault(fault_file, f"note-open:{notes}"):
        assert run_batch(spark, case.cfg, bid, case.dsn).result.status == "committed"
    peaks = {p.name: int(p.read_text()) for p in notes.iterdir()}
    assert peaks, "no task attempt noted its open writers"
    assert max(peaks.values()) <= MAX_OPEN_WRITERS, peaks
    referenced = referenced_files(iceberg_table(case.cfg, case.dsn))
    per_part = Counter(re.sub(r".*-(p\d+)-[0-9a-f]{12}-\d{5}\.parquet$", r"\1", p)
                       for p in referenced)
    assert max(per_part.values()) >= 500, per_part  # the part spanned that many values
    assert case.batch(bid).status == "committed"
    assert _unreferenced(case) == set()
    case.assert_exactly_once()


def test_a_first_run_sweeps_only_the_folders_its_files_went_to(
        case: IcebergCase, spark: Any, tmp_path: Path, fault_file: Path) -> None:
    """The orphan sweep after a batch's first run lists the folders of the files the batch
    added, not the table's whole data tree (whose listing grows with the table): a file
    with the batch's prefix in a partition folder the batch never wrote to is not seen
    (the maintenance command's age-based sweep takes such files), while the folders the
    batch wrote to are still swept (test_a_task_attempt_killed_after_its_files_...)."""
    bid = case.planned_batch(400, seed=45)
    flag = tmp_path / "paused"
    with task_fault(fault_file, f"pause-after-files:{flag}"), running(spark, case, bid) as run:
        chaos.wait_for(lambda: flag.exists() or run.done(), 300,
                       "part 0 to write its files")
        prefix = Path(next(iter(_written(flag)))).name.split("p0-")[0]
        elsewhere = (next(case.warehouse.rglob("data")) / "partition=99" /
                     f"{prefix}p9-0.parquet")
        elsewhere.parent.mkdir()
        elsewhere.write_bytes(b"not listed by the batch's sweep")
        flag.unlink()
        assert run.result(timeout=300).result.status == "committed"
    assert case.batch(bid).status == "committed" and case.batch(bid).attempts == 1
    assert elsewhere.exists(), "the sweep listed a folder the batch never wrote to"
    assert _unreferenced(case) == {str(elsewhere)}
    case.assert_exactly_once()
