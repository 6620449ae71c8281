"""The Kafka sink's task files: one attempt's records, read only as the marker names them."""

from __future__ import annotations

import dataclasses
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from offsetflow.errors import StagedRowsLostError, TaskFileLostError
from offsetflow.sinks.kafka.taskfile import (
    FILE_SCHEMA,
    WRITE_CHUNK_BYTES,
    PartFile,
    check_directory,
    drop_batch_files,
    read_part_file,
    split_by_bytes,
)
from offsetflow.sinks.kafka.values import json_values


def _records(lo: int, n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({
        "topic": ["src"] * n, "partition": [0] * n, "offset": list(range(lo, lo + n)),
        "key": [f"k{i}".encode() for i in range(n)], "value": [b"{}"] * n,
        "headers": [None] * n, "ts": [1_700_000_000_000] * n}, schema=FILE_SCHEMA)


def _written(tmp_path: Path, part: int = 0, ledger: str = "L1") -> dict[str, object]:
    f = PartFile(str(tmp_path), ledger, 7, part)
    f.write(_records(0, 100))
    f.write(_records(100, 50))
    return f.close()


def test_a_file_reads_back_as_written(tmp_path: Path) -> None:
    entry = _written(tmp_path)
    got = pa.Table.from_batches(list(read_part_file(7, 0, entry)))
    assert got.column("offset").to_pylist() == list(range(150))
    assert entry["records"] == 150 and Path(str(entry["path"])).name.startswith("L1_b7_p0_")


def test_two_attempts_of_one_part_write_two_files(tmp_path: Path) -> None:
    a, b = _written(tmp_path), _written(tmp_path)
    other = _written(tmp_path, ledger="L2")  # another ledger's batch 7: never dropped here
    assert a["path"] != b["path"] and a["attempt"] != b["attempt"]
    assert drop_batch_files(str(tmp_path), "L1", 7) == 2
    assert list(tmp_path.iterdir()) == [Path(str(other["path"]))]


@pytest.mark.parametrize("damage", ["missing", "short", "corrupt", "longer", "count"])
def test_a_file_not_the_markers_is_a_clear_error(tmp_path: Path, damage: str) -> None:
    entry = _written(tmp_path)
    path = Path(str(entry["path"]))
    data = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "short":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "longer":
        path.write_bytes(data + b"x")
    else:  # the marker counts other records than the file holds
        entry = {**entry, "records": 149}
    with pytest.raises(TaskFileLostError) as e:
        list(read_part_file(7, 0, entry))
    assert isinstance(e.value, StagedRowsLostError) and e.value.parts == [0]
    msg = str(e.value)
    assert "batch 7" in msg and "part 0" in msg and str(path) in msg and "re-stages" in msg


def test_a_failed_attempt_leaves_no_file(tmp_path: Path) -> None:
    f = PartFile(str(tmp_path), "L1", 7, 1)
    f.write(_records(0, 10))
    f.discard()
    assert not list(tmp_path.iterdir())


def test_the_directory_is_checked(tmp_path: Path) -> None:
    check_directory(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_directory(str(tmp_path / "nowhere"))


def test_values_not_built_in_the_task_are_left_to_postgresql() -> None:
    """A type not built here, or a timestamp outside years 1-9999: None (the stage path)."""
    b = pa.RecordBatch.from_pydict({"n": pa.array([1], pa.int64()),
                                    "j": pa.array(['{"a": 1}'])})
    assert json_values(b, ["n", "j"], {"n": "bigint", "j": "jsonb"}) is None
    far = pa.array([datetime(1, 1, 1, tzinfo=UTC)], pa.timestamp("us", "UTC"))
    b = pa.RecordBatch.from_arrays([pa.array([-62_135_596_800_000_001], pa.int64())
                                    .cast(pa.timestamp("us", "UTC"))], names=["t"])
    assert json_values(b, ["t"], {"t": "timestamptz"}) is None
    ok = pa.RecordBatch.from_arrays([far], names=["t"])
    assert json_values(ok, ["t"], {"t": "timestamptz"}) is not None


def test_a_column_the_task_cannot_build_falls_back_to_the_stage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`sink.task_files` on, a value column of a type the task does not build (numeric):
    that batch is staged in PostgreSQL (None: no task files), with a note in the log, not
    refused. Decided before anything is read or connected."""
    from offsetflow.config import parse_pipeline
    from offsetflow.ledger import Batch
    from offsetflow.sinks.kafka import KafkaPipelineSink

    cfg = parse_pipeline({
        "name": "orders", "kafka": {"bootstrap_servers": "k:9092"},
        "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "long", "amount": "decimal(10,2)"}},
        "sink": {"type": "kafka", "connection": "postgresql://x/y", "topic": "o",
                 "task_files": str(tmp_path)}}, "orders.yaml", {})
    sink = KafkaPipelineSink(cfg)
    assert sink.tasks_write_files
    batch = Batch.__new__(Batch)
    object.__setattr__(batch, "batch_id", 5)
    cols = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
            ("key", "bytea"), ("value", "bytea"), ("timestamp", "timestamptz"),
            ("headers", "jsonb"), ("id", "bigint"), ("amount", "numeric")]
    with caplog.at_level("INFO"):
        assert sink.task_files("postgresql://unused/x", batch, cols) is None
    assert "amount" in caplog.text and "not in task files" in caplog.text


def test_every_lost_part_is_named_at_once_and_an_unshared_directory_is_said(
        tmp_path: Path) -> None:
    """`check_present`: every part's file missing or short is named in one error (the
    parts dropped together); files written on another host the driver cannot see mean
    the directory is not shared, said with the way out."""
    from offsetflow.sinks.kafka.taskfile import check_present

    entries = {p: _written(tmp_path, p) for p in range(3)}
    check_present(1, entries, str(tmp_path))  # all there
    Path(str(entries[0]["path"])).unlink()
    Path(str(entries[2]["path"])).write_bytes(b"short")
    with pytest.raises(TaskFileLostError) as e:
        check_present(1, entries, str(tmp_path))
    assert e.value.parts == [0, 2] and "sink.task_files" in str(e.value), str(e.value)
    elsewhere = {0: {**entries[0], "host": "executor-7"}}
    with pytest.raises(TaskFileLostError, match=r"executor-7.*every host shares"):
        check_present(1, elsewhere, str(tmp_path))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_part_written_in_one_large_batch_is_read_back_in_bounded_pieces(
        tmp_path: Path) -> None:
    """Spark hands a task Arrow batches of up to 10,000 records whatever their size: one
    batch of 60 x 1 MB records was one 60 MB record batch in the file, and the driver read
    it whole (and, mapped, kept every page of the file resident while it produced)."""
    n, size = 60, 1 << 20
    f = PartFile(str(tmp_path), "L1", 7, 0)
    big = pa.RecordBatch.from_pydict({
        "topic": ["src"] * n, "partition": [0] * n, "offset": list(range(n)),
        "key": [b"k"] * n, "value": [bytes([i]) * size for i in range(n)],
        "headers": [None] * n, "ts": [1_700_000_000_000] * n}, schema=FILE_SCHEMA)
    f.write(big)
    entry = f.close()
    del big
    start, peak_arrow, peak_rss, seen = pa.total_allocated_bytes(), 0, 0, []
    rss0 = _rss()
    for rb in read_part_file(7, 0, entry):
        peak_arrow = max(peak_arrow, pa.total_allocated_bytes() - start)
        peak_rss = max(peak_rss, _rss() - rss0)
        assert rb.nbytes <= WRITE_CHUNK_BYTES + size, rb.nbytes
        seen.extend(v[:1] for v in rb.column("value").to_pylist())
        del rb
    assert seen == [bytes([i]) for i in range(n)]  # every record, in order
    assert peak_arrow <= 2 * (WRITE_CHUNK_BYTES + size), peak_arrow
    assert peak_rss < 30 * size, f"the reader grew by {peak_rss >> 20} MB"


def test_split_by_bytes_keeps_every_record_and_a_record_over_the_limit_alone() -> None:
    rb = _records(0, 10)
    assert [p.num_rows for p in split_by_bytes(rb, 1 << 20)] == [10]  # under the limit
    pieces = list(split_by_bytes(rb, 1))  # every record over the limit: one each
    assert [p.column("offset").to_pylist() for p in pieces] == [[i] for i in range(10)]


def test_a_file_missing_that_another_host_wrote_names_both_causes(tmp_path: Path) -> None:
    """The writer's host name differs from the driver's also where the directory is shared
    (a pod's host name on Kubernetes): a file missing that another host wrote may be an
    unshared directory or a file removed from a shared one. The hint says both, without
    claiming either."""
    from offsetflow.sinks.kafka.taskfile import check_present

    entry = {**_written(tmp_path), "host": "executor-7"}
    Path(str(entry["path"])).unlink()
    with pytest.raises(TaskFileLostError) as e:
        check_present(1, {0: entry}, str(tmp_path))
    msg = str(e.value)
    assert "executor-7" in msg and "shares" in msg and "removed" in msg, msg
    assert "must be one directory" not in msg, msg


def _as_another_user(fn: Any) -> str:
    """`fn()`'s exception (type: message) run as a user without access to root's files: in
    a forked child as `nobody` when the test runs as root (chmod does not stop root), else
    here (the caller chmods the file 000)."""
    import os
    import traceback

    if os.geteuid() != 0:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, no group of root's
        os.close(r)
        out = "no error"
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            fn()
        except Exception as e:
            out = f"{type(e).__name__}: {e}"
        except BaseException:
            out = traceback.format_exc()
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    return got


def test_a_file_the_driver_may_not_read_is_a_permission_error_not_a_lost_part() -> None:
    """A driver running as a user the file's mode does not let read (executors as one uid,
    the driver as another, no shared group): a `TaskFileAccessError` naming the file, its
    owner and mode, the driver's uid and the way out (a shared group, or
    sink.task_files_mode), never a `TaskFileLostError` (whose part would be dropped and
    written again unreadable, every run)."""
    import os
    import shutil
    import tempfile

    from offsetflow.sinks.kafka.taskfile import check_present

    d = Path(tempfile.mkdtemp(prefix="offsetflow-taskfile-perm-"))
    try:
        d.chmod(0o755)  # searchable by the other user: the file's own mode decides
        entry = _written(d)
        if os.geteuid() != 0:
            Path(str(entry["path"])).chmod(0)
        for name, fn in (("check_present", lambda: check_present(7, {0: entry}, str(d))),
                         ("read_part_file", lambda: list(read_part_file(7, 0, entry)))):
            got = _as_another_user(fn)
            assert got.startswith("TaskFileAccessError: "), (name, got)
            assert str(entry["path"]) in got and "sink.task_files_mode" in got, (name, got)
            assert "group" in got and "uid" in got and "0o640" in got, (name, got)
    finally:
        shutil.rmtree(d)


def test_a_file_is_created_with_the_mode_asked_for(tmp_path: Path) -> None:
    """`sink.task_files_mode` 0644 (a driver without a group in common with the executors
    reads them); the umask narrows it as any file's."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        f = PartFile(str(tmp_path), "L1", 7, 0, 0o644)
        f.write(_records(0, 3))
        entry = f.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(Path(str(entry["path"])).stat().st_mode) == 0o644


def test_an_unreadable_file_is_written_again_only_where_a_new_one_would_differ() -> None:
    """`written_otherwise`, as a driver that may not read the file (another user): the
    same mode and no setgid group since, nothing (refused again: written again, it would be
    as unreadable); `sink.task_files_mode` or `sink.task_files` changed, or the directory
    given a setgid group since, the part (a way out `TaskFileAccessError` names changes new
    files only, so the kept one is written again). A file the driver reads is never
    named."""
    import os
    import shutil
    import tempfile

    from offsetflow.sinks.kafka.taskfile import written_otherwise

    d = Path(tempfile.mkdtemp(prefix="offsetflow-taskfile-again-"))
    try:
        d.chmod(0o755)
        entry = _written(d)
        assert entry["mode"] == 0o640
        assert written_otherwise({0: entry}, 0o644, "/elsewhere") == {}  # its owner reads it
        if os.geteuid() != 0:
            Path(str(entry["path"])).chmod(0)

        def again(mode: int, where: str = str(d)) -> str:
            def fn() -> None:
                raise LookupError(sorted(written_otherwise({0: entry}, mode, where)))
            return _as_another_user(fn)

        assert again(0o640) == "LookupError: []"
        assert again(0o644) == "LookupError: [0]"
        assert again(0o640, str(d / "moved")) == "LookupError: [0]"  # the setting moved
        if os.geteuid() == 0:
            os.chown(d, -1, 4242)
            d.chmod(0o2775)
            assert again(0o640) == "LookupError: [0]"
    finally:
        shutil.rmtree(d)


def test_a_lost_file_written_before_the_setting_moved_is_looked_for_where_it_was(
        tmp_path: Path) -> None:
    """`sink.task_files` moved to another directory while a batch's files lie in the old
    one (the markers name them there): a file lost there is named with its own directory,
    not the new setting's (the operator would look for it in the wrong place)."""
    from offsetflow.sinks.kafka.taskfile import check_present

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    entry = _written(old)
    Path(str(entry["path"])).unlink()
    with pytest.raises(TaskFileLostError) as e:
        check_present(1, {0: entry}, str(new))
    msg = str(e.value)
    assert f"files in {old} (where they were written; sink.task_files is {new} now)" in msg, msg


# --- sink.task_files: auto (the default) ---------------------------------------------------

def test_auto_puts_the_files_under_spark_local_dir_or_tmpdir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto`'s directory: where Spark's own local files go, the first of spark.local.dir
    (comma-separated, as Spark reads it), else TMPDIR; one per user of the host."""
    from offsetflow.sinks.kafka.taskfile import auto_directory

    uid = os.geteuid()
    assert auto_directory(f"{tmp_path}/a, {tmp_path}/b") == \
        f"{tmp_path}/a/offsetflow-task-files-{uid}"
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    assert auto_directory(None) == f"{tmp_path}/offsetflow-task-files-{uid}"
    assert auto_directory("") == f"{tmp_path}/offsetflow-task-files-{uid}"


def test_auto_makes_its_directory_private_and_refuses_one_another_could_use(
        tmp_path: Path) -> None:
    """`private_directory`: made 0700 when missing; one found group- or world-enterable, a
    symlink (to a directory another user picked) or a file is refused naming why, never
    used: in a shared /tmp another user could have made it to read or swap the files."""
    from offsetflow.sinks.kafka.taskfile import private_directory

    made = tmp_path / "mine"
    assert private_directory(str(made)) == str(made)
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
    assert private_directory(str(made)) == str(made)  # found as made: used again
    made.chmod(0o750)
    with pytest.raises(PermissionError, match="mode 0750: others may enter it"):
        private_directory(str(made))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(NotADirectoryError, match="not a directory"):
        private_directory(str(tmp_path / "link"))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        private_directory(str(tmp_path / "file"))


def test_auto_refuses_a_directory_another_user_owns(tmp_path: Path) -> None:
    """A directory of `auto`'s name made by another user (it could read the records or
    replace a file between its check and its read) is refused naming the owner."""
    from offsetflow.sinks.kafka.taskfile import private_directory

    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    d = tmp_path / "squatted"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534, not by this user"):
        private_directory(str(d))


def _kafka_cfg(**sink: Any) -> Any:
    from offsetflow.config import parse_pipeline

    return parse_pipeline({
        "name": "orders", "kafka": {"bootstrap_servers": "k:9092"},
        "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "long"}},
        "sink": {"type": "kafka", "connection": "postgresql://x/y", "topic": "o", **sink}},
        "orders.yaml", {})


def test_auto_is_the_default_and_uses_files_only_where_the_tasks_run_here(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`sink.task_files` absent, `auto` or null: task files where the tasks run on the
    driver's host, else the stage with a note (no directory made, nothing connected);
    `off`: the stage. The choice never changes the pipeline's fingerprint."""
    from offsetflow.ledger import Batch
    from offsetflow.sinks.kafka import KafkaPipelineSink

    default, auto, null, off = (_kafka_cfg(), _kafka_cfg(task_files="auto"),
                                _kafka_cfg(task_files=None), _kafka_cfg(task_files="off"))
    for cfg in (default, auto, null):
        assert cfg.sink.kafka.task_files is None and cfg.sink.kafka.task_files_auto
        assert KafkaPipelineSink(cfg).tasks_write_files
    assert not off.sink.kafka.task_files_auto and off.sink.kafka.task_files is None
    assert not KafkaPipelineSink(off).tasks_write_files
    assert KafkaPipelineSink(off).files_dir is None
    assert len({c.fingerprint() for c in (default, auto, null, off)}) == 1
    batch = Batch.__new__(Batch)
    object.__setattr__(batch, "batch_id", 5)
    cols = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
            ("key", "bytea"), ("value", "bytea"), ("timestamp", "timestamptz"),
            ("headers", "jsonb"), ("id", "bigint")]
    local = _kafka_cfg(**{})
    local = dataclasses.replace(local, spark=dataclasses.replace(
        local.spark, conf={"spark.local.dir": str(tmp_path)}))
    sink = KafkaPipelineSink(local)
    with caplog.at_level("INFO"):
        assert sink.task_files("postgresql://unused/x", batch, cols, tasks_here=False) is None
    assert "only where the tasks run on the driver's host" in caplog.text
    assert not list(tmp_path.iterdir())  # nothing made for a cluster's run
    # the run's choice reaches the commit: a cluster run's sink looks no marker up
    assert sink.external("postgresql://unused/x").files_dir is None
    # a repair (no run decided) looks where this host's files would be
    assert KafkaPipelineSink(local).external("postgresql://unused/x").files_dir == \
        f"{tmp_path}/offsetflow-task-files-{os.geteuid()}"


def test_auto_stages_with_a_warning_where_its_directory_cannot_be_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`auto` with its directory unusable (here: group-enterable) stages the batch in
    PostgreSQL with a warning naming the directory and why, never fails the run."""
    from offsetflow.ledger import Batch
    from offsetflow.sinks.kafka import KafkaPipelineSink

    d = tmp_path / f"offsetflow-task-files-{os.geteuid()}"
    d.mkdir(mode=0o700)
    d.chmod(0o770)
    cfg = _kafka_cfg()
    cfg = dataclasses.replace(cfg, spark=dataclasses.replace(
        cfg.spark, conf={"spark.local.dir": str(tmp_path)}))
    batch = Batch.__new__(Batch)
    object.__setattr__(batch, "batch_id", 6)
    cols = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
            ("key", "bytea"), ("value", "bytea"), ("timestamp", "timestamptz"),
            ("headers", "jsonb"), ("id", "bigint")]
    with caplog.at_level("WARNING"):
        assert KafkaPipelineSink(cfg).task_files("postgresql://unused/x", batch, cols,
                                                 tasks_here=True) is None
    assert f"{d} has mode 0770" in caplog.text and "staged in PostgreSQL" in caplog.text


def test_auto_refuses_a_directory_in_a_base_where_another_user_could_replace_it(
        tmp_path: Path) -> None:
    """`auto`'s own checks (owner, mode, no symlink) hold only at their moment: in a base
    others may write without the sticky bit (a shared spark.local.dir, mode 0777), another
    user renames the checked directory away after the check and puts one of their own in
    its place, which the tasks then write the records into. Such a base is refused (the
    batch staged), as is one reached through a symlink to it; /tmp's sticky 1777 is not."""
    from offsetflow.sinks.kafka.taskfile import private_directory

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    mine = shared / f"offsetflow-task-files-{os.geteuid()}"
    with pytest.raises(PermissionError, match=rf"{shared} has mode 0777: writable by others"):
        private_directory(str(mine))
    assert not mine.exists()  # nothing made there
    (tmp_path / "via").symlink_to(shared)
    with pytest.raises(PermissionError, match="writable by others"):
        private_directory(str(tmp_path / "via" / "offsetflow-task-files-x"))
    shared.chmod(0o1777)  # as /tmp: only an entry's owner may rename it
    assert private_directory(str(mine)) == str(mine)


def test_a_task_file_is_never_opened_through_an_entry_found_under_its_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task creates its file's temporary name itself: a symlink planted there (in a
    directory others may write, e.g. a group's setgid sink.task_files) fails the attempt,
    never sends the records to the link's target."""
    import uuid

    from offsetflow.sinks.kafka.taskfile import PartFile

    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=0xABC))
    target = tmp_path / "theirs"
    target.write_bytes(b"")
    planted = tmp_path / f"L_b1_p0_{uuid.UUID(int=0xABC).hex[:12]}.arrow.tmp"
    planted.symlink_to(target)
    with pytest.raises(FileExistsError):
        PartFile(str(tmp_path), "L", 1, 0)
    assert target.read_bytes() == b""
