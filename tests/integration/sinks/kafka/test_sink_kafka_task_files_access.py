"""Task files the driver may not read (`TaskFileAccessError`), and the ways out its message
and docs/sinks/kafka.md give: the files and markers are kept, so a way out must reach the
files already written, not only the ones a later run would write."""

from __future__ import annotations

import builtins
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.tooling.kafka_case import with_task_files

# the group the emulated driver's user is in (not the executors' primary group, root's 0)
DRIVER_GID = 4242


def _driver_as_another_user(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """The driver's reads of task files under `root` as a user who owns none of them and is in group
    DRIVER_GID only (executors as one uid, the driver as another). The tests run as root,
    whom no mode stops: the module's `open` (its one way to open a task file, before any
    map) applies the permission check a kernel would for that user."""
    def as_other(file: Any, *a: Any, **k: Any) -> Any:
        p = Path(str(file))
        if root in p.parents:
            st = os.stat(p)  # FileNotFoundError as the kernel would
            mode = stat.S_IMODE(st.st_mode)
            if not (mode & stat.S_IROTH or (mode & stat.S_IRGRP and st.st_gid == DRIVER_GID)):
                raise PermissionError(13, "Permission denied", str(p))
        return builtins.open(file, *a, **k)

    from offsetflow.sinks.kafka import taskfile

    monkeypatch.setattr(taskfile, "open", as_other, raising=False)


@pytest.mark.parametrize("way_out", ["mode", "setgid", "directory"])
def test_the_way_out_an_access_error_names_lets_the_next_run_commit(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way_out: str) -> None:
    """The executors write their files 0640 in their own group; the driver, another user,
    may not read them: the run fails with `TaskFileAccessError`, files and markers kept.
    The operator takes a way out the message names: `sink.task_files_mode: '0644'`, or
    the directory given the driver's group and made setgid, or `sink.task_files` moved to
    a new directory of the driver's group. Each changes how or where a file is
    written, not the files kept (their mode and group are the old ones): the next run must
    write those parts again under the new setting and commit the batch once, not fail
    with the same error on every run."""
    from offsetflow.errors import TaskFileAccessError
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", None)  # the setting decides
    d = tmp_path / "task-files"
    d.mkdir()
    d.chmod(0o755)
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    cfg = with_task_files(case.cfg, d)
    _driver_as_another_user(monkeypatch, tmp_path)
    with pytest.raises(TaskFileAccessError) as e:
        run_batch(spark, cfg, case.batch_id, pg_dsn)
    assert "sink.task_files_mode" in str(e.value) and "setgid" in str(e.value), e.value
    kept = sorted(d.glob(f"*_b{case.batch_id}_p*.arrow"))
    assert kept and all(stat.S_IMODE(f.stat().st_mode) == 0o640 for f in kept), kept

    if way_out == "mode":
        cfg = with_task_files(case.cfg, d, 0o644)
    elif way_out == "setgid":
        os.chown(d, -1, DRIVER_GID)
        d.chmod(0o2775)
    else:
        moved = tmp_path / "task-files-of-the-group"
        moved.mkdir()
        os.chown(moved, -1, DRIVER_GID)
        moved.chmod(0o2775)
        cfg = with_task_files(case.cfg, moved)
    rep = run_batch(spark, cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v
    assert not [f for f in tmp_path.rglob("*.arrow*")]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_setting_turned_off_for_a_batch_written_to_files_converges(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    """A run with `sink.task_files` wrote every part to files and failed before producing;
    the setting is then unset (docs/sinks/kafka.md: "Unset the setting instead and the
    whole batch is staged again by the next run"). The runs after it stage the batch in
    PostgreSQL and the topic gets each record once: the file parts' empty stage is never
    taken for records."""
    from offsetflow.errors import StagedRowsLostError
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink, taskfile
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", None)
    monkeypatch.setattr(KafkaTopicSink, "overlap", overlap)
    d = tmp_path / "task-files"
    d.mkdir()
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)

    def failing(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("injected: the driver fails before producing")

    with monkeypatch.context() as m:
        m.setattr(taskfile, "read_part_file", failing)
        with pytest.raises(RuntimeError, match="injected"):
            run_batch(spark, with_task_files(case.cfg, d), case.batch_id, pg_dsn)
    assert list(d.glob(f"*_b{case.batch_id}_p*.arrow"))
    for _ in range(3):  # the setting off: at most one run refuses the file parts
        try:
            rep = run_batch(spark, with_task_files(case.cfg, "off"), case.batch_id, pg_dsn)
        except StagedRowsLostError:
            continue
        break
    assert rep.result.status == "committed", rep.result
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v
