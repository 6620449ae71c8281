"""`sink.task_files: auto`, the Kafka sink's default (issue 32): on a local master the tasks
write task files in a private directory of this host and the driver produces from them;
where that directory could be another user's, the batch is staged in PostgreSQL. Either
way each record reaches the output topic once (read_committed)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from offsetflow.job import run_batch
from offsetflow.sinks.kafka import KafkaTopicSink
from tests.tooling.kafka_case import make_case
from tests.tooling.kafka_staging import task_file_reads


@pytest.fixture(autouse=True)
def _setting_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's own setting, not the tests' override (`OFFSETFLOW_TEST_KAFKA_TASK_FILES`)."""
    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", None)


def test_the_default_on_a_local_master_produces_from_a_private_directory_of_this_host(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No `sink.task_files` in the config: the batch's parts are read from task files in
    `offsetflow-task-files-<uid>` under spark.local.dir, made 0700; each record once in
    the topic, and the files gone after the commit."""
    local = tmp_path / "local"
    local.mkdir()
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"conf": {"spark.local.dir": str(local)}}, task_files="auto")
    assert case.cfg.sink.kafka is not None and case.cfg.sink.kafka.task_files is None
    reads = task_file_reads(monkeypatch)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    private = local / f"offsetflow-task-files-{os.geteuid()}"
    assert reads and {Path(p).parent for _, p in reads} == {private}, reads
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert not list(private.iterdir())  # dropped once the ledger committed the batch
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v


def test_auto_never_uses_a_directory_another_user_could_enter_and_stages_instead(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """`auto`'s directory found group- and world-enterable (made first by someone else on
    a shared /tmp): nothing is written there, the batch is staged in PostgreSQL with a
    warning naming the directory, and commits once."""
    local = tmp_path / "local"
    private = local / f"offsetflow-task-files-{os.geteuid()}"
    private.mkdir(parents=True)
    private.chmod(0o777)
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"conf": {"spark.local.dir": str(local)}}, task_files="auto")
    reads = task_file_reads(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="offsetflow"):
        rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert not reads and not list(private.iterdir())
    assert f"{private} has mode 0777" in caplog.text, caplog.text
    v = case.verdict()
    assert v.visible == v.committed.found, v


def test_the_kafka_tests_default_case_stages_in_postgresql(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make_case`'s pipeline without a `task_files` asked for is the PostgreSQL stage path
    (`sink.task_files: off`): the cases that name invariants 17 and 38 (the stage produced
    part by part, killed between the Kafka and the ledger commit, ...) exercise the path
    every cluster master and Spark Connect runs, not the local master's task files that
    `auto` would pick; task files are asked for (`task_files=`, the override)."""
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    reads = task_file_reads(monkeypatch)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert not reads, reads
    v = case.verdict()
    assert v.visible == v.committed.found, v


@pytest.mark.parametrize("then", ["cluster", "removed", "moved"])
def test_a_batch_written_to_auto_files_converges_wherever_the_next_run_decides(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str) -> None:
    """A local run of `auto` wrote every part to its private directory and failed before
    producing. The next runs: on a cluster master (`auto` stages; the markers are not read:
    the file parts' empty stage is refused once, dropped with their files, staged again),
    after the directory was removed (a tmp cleaner, systemd PrivateTmp: the parts are lost
    once and written again), or on this host with another spark.local.dir (the files are
    read where the markers name them, no refusal). Each converges, each record once."""
    import shutil

    from offsetflow.errors import StagedRowsLostError
    from offsetflow.job import driver
    from offsetflow.sinks.kafka import taskfile

    local = tmp_path / "local"
    local.mkdir()
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"conf": {"spark.local.dir": str(local)}}, task_files="auto")
    private = local / f"offsetflow-task-files-{os.geteuid()}"

    def failing(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("injected: the driver fails before producing")

    with monkeypatch.context() as m:
        m.setattr(taskfile, "read_part_file", failing)
        with pytest.raises(RuntimeError, match="injected"):
            run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert list(private.glob(f"*_b{case.batch_id}_p*.arrow"))
    cfg = case.cfg
    if then == "cluster":
        monkeypatch.setattr(driver, "tasks_here", lambda *_a: False)
    elif then == "removed":
        shutil.rmtree(private)
    else:
        import dataclasses

        other = tmp_path / "other"
        other.mkdir()
        cfg = dataclasses.replace(cfg, spark=dataclasses.replace(
            cfg.spark, conf={"spark.local.dir": str(other)}))
    refused = 0
    for _ in range(3):
        try:
            rep = run_batch(spark, cfg, case.batch_id, pg_dsn)
        except StagedRowsLostError:  # TaskFileLostError is one
            refused += 1
            continue
        break
    assert rep.result.status == "committed", rep.result
    assert refused == (0 if then == "moved" else 1), refused
    v = case.verdict()
    assert v.visible == v.committed.found, v


@pytest.fixture
def full_local_dir(tmp_path: Path) -> Any:
    """A real file system of one page (tmpfs, 4 KiB) to be `spark.local.dir`: `auto`'s
    directory fits, a part's task file does not (a small /tmp under a large batch)."""
    import subprocess

    d = tmp_path / "small"
    d.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k,mode=1777", "tmpfs", str(d)],
                          capture_output=True, text=True)
    if done.returncode != 0:  # the CI machine mounts (root in its container)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_task_file_the_directory_has_no_room_for_fails_once_by_name_with_the_way_out(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, full_local_dir: Path) -> None:
    """`auto` under a spark.local.dir too small for the batch's records: the run fails with
    one `TaskFileWriteError` naming the batch, the directory, the OS error and the ways
    out (not Spark's wrapped OSError of every task attempt), nothing is visible and no
    file is left; with `off`, the way out it names, the batch commits once."""
    from offsetflow.errors import TaskFileWriteError
    from tests.tooling.kafka_case import with_task_files
    from tests.tooling.topic_checker import read_topic

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"conf": {"spark.local.dir": str(full_local_dir)}},
                     task_files="auto")
    with pytest.raises(TaskFileWriteError) as e:
        run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    msg = str(e.value)
    private = full_local_dir / f"offsetflow-task-files-{os.geteuid()}"
    assert f"batch {case.batch_id}:" in msg and str(private) in msg, msg
    assert "No space left" in msg and "sink.task_files: off" in msg, msg
    assert not read_topic(kafka_bootstrap, case.out)
    assert not list(private.iterdir())  # each failed attempt removed its file
    rep = run_batch(spark, with_task_files(case.cfg, "off"), case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    v = case.verdict()
    assert v.visible == v.committed.found, v
