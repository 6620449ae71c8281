"""A Kafka sink's task file: one task attempt's finished records of one stage part (issue 32),
what the driver's produce loop needs and nothing else (topic, partition, offset, key and value
bytes, the staged headers as JSON text, the timestamp in epoch ms), as an Arrow IPC file.

Why a file per attempt: a retried, zombie or speculative attempt of one part writes a file of
its own (`file_name`: the attempt is in the name), and only the attempt whose part marker
commits names its file there (`PartFile.close`'s entry: path, records, bytes, CRC-32), so
the driver never reads a mix of two attempts. Written under a temporary name and renamed
once complete: a file under its final name was written whole. `read_part_file` checks the
entry against the file (present, its size, its CRC-32, its record count) before anything
of it is handed to the producer: a file missing, short or corrupt is a `TaskFileLostError`
naming batch, part and path (the part is dropped with its marker, the next run writes it
again from Kafka), never a silent skip.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile
import uuid
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from offsetflow.errors import (
    NOT_WRITABLE_ERRNOS,
    TaskFileAccessError,
    TaskFileLostError,
    TaskFileWriteError,
)

# a task file's permissions by default (`sink.task_files_mode`): read/write for its owner,
# read for its group, none for others; the umask may narrow it
FILE_MODE = 0o640
# a task file's record batches hold about this many bytes at most (`split_by_bytes`); the
# fixed columns of a record (topic name aside) count as ROW_OVERHEAD
WRITE_CHUNK_BYTES = 8 << 20
ROW_OVERHEAD = 48
FILE_SCHEMA = pa.schema([("topic", pa.string()), ("partition", pa.int32()),
                         ("offset", pa.int64()), ("key", pa.binary()),
                         ("value", pa.binary()), ("headers", pa.string()),
                         ("ts", pa.int64())])


def file_name(ledger: str, batch_id: int, part: int, attempt: str) -> str:
    """`ledger`: the ledger's installation id (`offsetflow.ledger.ledger_identity`), so
    pipelines of two ledgers sharing a directory (their batch ids repeat) never name, read
    or drop each other's files; batch ids are unique within a ledger. The attempt comes
    last: a batch's every file matches one pattern (`batch_glob`); the ledger drops exactly
    the attempt a marker names (`drop_named_task_files`), never the part's others."""
    return f"{ledger}_b{batch_id}_p{part}_{attempt}.arrow"


def batch_glob(ledger: str, batch_id: int) -> str:
    """Every attempt's file of the batch (what cleanup drops)."""
    return f"{ledger}_b{batch_id}_p*_*.arrow*"


class _Crc:
    """A sink for Arrow's writer that keeps the CRC-32 and size of what went through it."""

    def __init__(self, f: Any) -> None:
        self.f, self.crc, self.size, self.closed = f, 0, 0, False

    def write(self, data: Any) -> int:
        mv = memoryview(data)
        self.crc = zlib.crc32(mv, self.crc)
        self.size += mv.nbytes
        return int(self.f.write(mv))

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.closed = True


def sync_directory(directory: Path) -> None:
    """The rename made durable (a crash after the marker commits must not lose the name);
    a file system that cannot fsync a directory (some network mounts) is left as it is."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def record_bytes(records: pa.RecordBatch) -> pa.Array:
    """Each record's key, value and headers bytes (a null as 0): what its size on the wire
    and in a file grows with."""
    return pc.add(pc.add(pc.fill_null(pc.binary_length(records.column("key")), 0),
                         pc.fill_null(pc.binary_length(records.column("value")), 0)),
                  pc.fill_null(pc.binary_length(records.column("headers")), 0))


def split_by_bytes(records: pa.RecordBatch, limit: int) -> Iterator[pa.RecordBatch]:
    """`records` in slices of about `limit` bytes at most (a single larger record alone):
    the driver reads a file one record batch at a time, so the batches it was written in
    bound the driver's memory, whatever size Spark's Arrow batches had."""
    if records.nbytes <= limit or records.num_rows <= 1:
        yield records
        return
    start, held = 0, 0
    for i, size in enumerate(record_bytes(records).to_pylist()):
        if held and held + size + ROW_OVERHEAD > limit:
            yield records.slice(start, i - start)
            start, held = i, 0
        held += size + ROW_OVERHEAD
    yield records.slice(start)


class PartFile:
    """One task attempt's file of one part, written as its records come."""

    def __init__(self, directory: str, ledger: str, batch_id: int, part: int,
                 mode: int = FILE_MODE) -> None:
        self.batch_id, self.part, self.mode = batch_id, part, mode
        self.attempt = uuid.uuid4().hex[:12]
        self.path = Path(directory) / file_name(ledger, batch_id, part, self.attempt)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        # the batch's records: owner and group at most by default (a cluster's driver and
        # executors may share one), never other users of the host unless
        # `sink.task_files_mode` says so; the umask may narrow it further
        # a name of its own, never an entry found there (a symlink planted under it would
        # send the records where its maker reads them)
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        self._f = os.fdopen(fd, "wb")
        self._crc = _Crc(self._f)
        self._w = ipc.new_file(pa.PythonFile(self._crc, mode="w"), FILE_SCHEMA)
        self.records = 0

    def write(self, records: pa.RecordBatch) -> None:
        records = records.select(FILE_SCHEMA.names).cast(FILE_SCHEMA)
        for piece in split_by_bytes(records, WRITE_CHUNK_BYTES):
            self._w.write_batch(piece)
        self.records += records.num_rows

    def close(self) -> dict[str, Any]:
        """The file complete under its final name; the entry its part marker records."""
        self._w.close()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)
        sync_directory(self.path.parent)
        # `mode`: the sink.task_files_mode it was written with (`written_otherwise`)
        return {"path": str(self.path), "records": self.records, "bytes": self._crc.size,
                "crc32": self._crc.crc, "attempt": self.attempt, "host": this_host(),
                "mode": self.mode}

    def discard(self) -> None:
        """A failed attempt's file removed (a retry writes one of its own); its buffer
        may not flush (a full disk): that is why it is discarded."""
        try:
            with contextlib.suppress(OSError):
                self._f.close()
        finally:
            self._tmp.unlink(missing_ok=True)


def read_part_file(batch_id: int, part: int, entry: Mapping[str, Any], mapped: bool = False
                   ) -> Iterator[pa.RecordBatch]:
    """The records of the file a part's marker names, checked whole first (see the module
    doc); a `TaskFileLostError` when the file is not the one the marker names. `mapped`:
    the record batches point into a map of the file (for a reader that holds many of them
    at once, the sorted read: their pages are the page cache's, not the driver's heap)."""
    path = Path(str(entry["path"]))

    def lost(why: str) -> TaskFileLostError:
        return TaskFileLostError(batch_id, part, str(path), why)

    def opened(how: str) -> Any:
        # each open (also one after the check: removed or replaced since) fails as the
        # file's loss, or, where the driver may not read it, as an access error (not lost:
        # written again it would be as unreadable), never as a raw OSError
        try:
            return (open(path, "rb") if how == "file" else
                    pa.memory_map(str(path)) if how == "map" else pa.OSFile(str(path)))
        except FileNotFoundError:
            raise lost("it is missing") from None
        except PermissionError as e:
            raise access_error(batch_id, str(path), e, str(path.parent)) from e
        except OSError as e:
            raise lost(f"it cannot be read ({e})") from e

    size, crc = 0, 0
    with opened("file") as f:  # checked in 1 MiB reads: a part is never held whole
        try:
            while chunk := f.read(1 << 20):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
        except OSError as e:
            raise lost(f"it cannot be read ({e})") from e
    if size != int(entry["bytes"]):
        raise lost(f"it holds {size} bytes, its marker {entry['bytes']} (short or "
                   f"overwritten)")
    if crc != int(entry["crc32"]):
        raise lost("its CRC-32 is not its marker's (corrupt)")

    # counted through a map (the record batches' headers only), read through plain reads:
    # a mapped file's pages stay in the driver's resident memory as it is produced (a
    # 360 MB batch grew the driver by 345 MB), a batch read is freed once produced
    with opened("map") as source:
        try:
            reader = ipc.open_file(source)
            if reader.schema != FILE_SCHEMA:
                raise lost(f"its schema is not a task file's ({reader.schema})")
            n = reader.num_record_batches
            records = sum(reader.get_batch(i).num_rows for i in range(n))
        except pa.ArrowInvalid as e:
            raise lost(f"it is not a readable Arrow IPC file ({e})") from e
    if records != int(entry["records"]):
        raise lost(f"it holds {records} records, its marker {entry['records']}")
    with opened("map" if mapped else "read") as source:
        reader = ipc.open_file(source)
        for i in range(n):
            yield reader.get_batch(i)


def this_host() -> str:
    """The host a file is written on (its marker's entry) and the driver reads it on."""
    return socket.gethostname()


def check_present(batch_id: int, entries: Mapping[int, Mapping[str, Any]],
                  directory: str) -> None:
    """Every part's file there, readable by the driver, with its marker's size, checked
    before anything is read (an open each, not a read): the `TaskFileLostError` names every
    lost part at once, so one run drops them all (not one per run). A file the driver may
    not open (EACCES/EPERM) is a `TaskFileAccessError` instead, before any part is dropped:
    re-staged it would be as unreadable. Files written on another host that the driver
    does not find: the directory is not shared, or they were removed; the hint says both
    (a host name differs per container even on a shared volume). The CRC and record count
    are `read_part_file`'s, as each part is read."""
    lost: list[tuple[int, str, str]] = []
    elsewhere: set[str] = set()
    for part, entry in sorted(entries.items()):
        path = str(entry["path"])
        try:
            with open(path, "rb") as f:  # opened, not only stat'ed: the driver may read it
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            lost.append((part, path, "it is missing"))
            host = entry.get("host")
            if host and host != this_host():
                elsewhere.add(str(host))
            continue
        except PermissionError as e:
            raise access_error(batch_id, path, e, directory) from e
        except OSError as e:
            lost.append((part, path, f"it cannot be read ({e})"))
            continue
        if size != int(entry["bytes"]):
            lost.append((part, path, f"it holds {size} bytes, its marker {entry['bytes']} "
                                     f"(short or overwritten)"))
    if not lost:
        return
    # files written before sink.task_files moved are read (and lost) where they were
    # written: the hint names that directory, not the current setting's
    moved = sorted({os.path.dirname(os.path.abspath(p)) for _, p, _ in lost}
                   - {os.path.abspath(directory)})
    place = (f"{', '.join(moved)} (where they were written; sink.task_files is "
             f"{directory} now)" if moved else f"sink.task_files {directory}")
    hint = (f"written on host(s) {sorted(elsewhere)}, not found from the driver's host "
            f"{this_host()} (a host name differs per container even on a shared volume): "
            f"either {place} is not one directory every host shares "
            f"under the same path (mount it on every host, or unset sink.task_files to "
            f"stage in PostgreSQL), or something removed files from it (a sweep of the "
            f"directory, a full disk?; keep it for the pipeline alone)" if elsewhere else
            f"something removed or changed files in {place} (a sweep "
            f"of the directory, a full disk?); keep it for the pipeline alone, or unset "
            f"sink.task_files to stage in PostgreSQL")
    first, *more = lost
    raise TaskFileLostError(batch_id, first[0], first[1], first[2], more, hint)


def written_otherwise(entries: Mapping[int, Mapping[str, Any]], mode: int,
                      directory: str) -> dict[int, str]:
    """The parts whose file the driver may not open (EACCES/EPERM) but that a task would
    now write otherwise, each with why: outside `directory` (`sink.task_files` changed
    since), with another `sink.task_files_mode` than `mode` (or before the marker recorded
    it), or in a setgid directory whose group is not the file's (the directory was given a
    group since). A way out of a
    `TaskFileAccessError` changes how new files are written, never the files kept: those
    parts are written again (`KafkaPipelineSink.task_files` drops them before the tasks
    run), not refused on every run. A file the driver opens, or one missing (lost:
    `check_present`'s), is not here; nor one written as it would be now (still refused:
    written again, it would be as unreadable)."""
    again: dict[int, str] = {}
    for part, entry in sorted(entries.items()):
        path = Path(str(entry["path"]))
        try:
            with open(path, "rb"):
                continue
        except PermissionError:
            pass
        except OSError:
            continue
        if os.path.abspath(path.parent) != os.path.abspath(directory):
            again[part] = f"written in {path.parent}, sink.task_files is now {directory}"
            continue
        was = entry.get("mode")
        if was is None or int(was) != mode:
            again[part] = (f"written with sink.task_files_mode "
                           f"{'unrecorded' if was is None else f'{int(was):04o}'}, now "
                           f"{mode:04o}")
            continue
        try:
            st, dst = os.stat(path), os.stat(path.parent)
        except OSError:
            continue
        if dst.st_mode & stat.S_ISGID and dst.st_gid != st.st_gid:
            again[part] = (f"its group {st.st_gid} is not its setgid directory's "
                           f"{dst.st_gid}")
    return again


def access_error(batch_id: int, path: str, err: OSError, directory: str
                 ) -> TaskFileAccessError:
    """The driver may not read a task file: its owner and mode (or its directory's), the
    driver's user, and the way out."""
    def owner(p: str) -> str:
        st = os.stat(p)
        return f"owner uid {st.st_uid} gid {st.st_gid}, mode {oct(stat.S_IMODE(st.st_mode))}"

    try:
        found = f"{err.strerror}; the file's {owner(path)}"
    except OSError:
        try:
            found = (f"{err.strerror}; the file cannot be looked up, its directory's "
                     f"{owner(directory)}")
        except OSError as e:
            found = f"{err.strerror}; nor can its directory be looked up ({e.strerror})"
    me = (f"the driver runs as uid {os.geteuid()} gid {os.getegid()}, groups "
          f"{sorted(os.getgroups())}")
    return TaskFileAccessError(
        batch_id, path, f"{found}; {me}",
        f"Let the driver read the files the executors write in sink.task_files "
        f"{directory}: a group both are in, owning the directory (group-readable files: "
        f"sink.task_files_mode 0640, the default; a setgid directory gives new files its "
        f"group), or sink.task_files_mode: '0644' (every user of the hosts may then read "
        f"the records; the executors' umask must not take it away), and run the batch "
        f"again: a file kept keeps its mode and group, so that run writes again the parts "
        f"whose files a changed sink.task_files_mode, setgid directory group or "
        f"sink.task_files directory would write otherwise. After a change the driver cannot "
        f"see in the files (the executors' umask, user or group), make the kept files of "
        f"batch {batch_id} readable by hand (chmod/chgrp) before that run")


def check_directory(directory: str) -> None:
    """The task-file directory exists and is writable here (the driver checks before any
    task runs; the tasks write there, the driver reads there: on a multi-host cluster it
    must be a path every host shares). Raises OSError naming it."""
    p = Path(directory)
    if not p.is_dir():
        raise FileNotFoundError(f"the Kafka sink's task-file directory {directory} does not "
                                f"exist")
    probe = p / f".offsetflow-probe-{uuid.uuid4().hex[:8]}"
    probe.write_bytes(b"")
    probe.unlink()


def auto_directory(local_dir: str | None) -> str:
    """`sink.task_files: auto`'s directory: `offsetflow-task-files-<uid>` under the first of
    `spark.local.dir` (`local_dir`, comma-separated as Spark takes it) or the temporary
    directory (TMPDIR), where Spark's own local files go: the path only, nothing made."""
    base = (local_dir or "").split(",")[0].strip() or tempfile.gettempdir()
    return os.path.join(os.path.abspath(base), f"offsetflow-task-files-{os.geteuid()}")


def private_directory(path: str) -> str:
    """`path` (`auto_directory`) made if missing (0700) and checked: a real directory, not a
    symlink, owned by this user, that nobody else may enter. In a shared base (/tmp)
    another user could have made it first, to read the records or to swap a file between
    its check and its read: such a directory raises OSError naming what is wrong, never
    used."""
    if why := replaceable(os.path.dirname(os.path.abspath(path))):
        # the check below is worth nothing where another user may rename the directory
        # away and put one of their own in its place after it (the tasks write there later)
        raise PermissionError(f"{path} could be replaced by another user: {why}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory (a symlink or a file)")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is owned by uid {st.st_uid}, not by this user "
                              f"(uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise PermissionError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: others may "
                              f"enter it (chmod 700 it, or remove it)")
    return path


def replaceable(directory: str) -> str:
    """Why another user could rename an entry of `directory` away and put their own in its
    place ("" if nobody but this user and root can): a directory on the way to it, as
    written or as its symlinks resolve, that is writable by group or others without the
    sticky bit (/tmp has it: there only an entry's owner may rename it), or owned by
    another user than this one and root (its owner may make it writable); a symlink on the
    way owned by another user (it may be replaced the same way)."""
    me = os.geteuid()

    def chain(p: str) -> list[str]:
        out = [p]
        while (parent := os.path.dirname(p)) != p:
            out.append(parent)
            p = parent
        return out

    for p in [*chain(os.path.abspath(directory)), *chain(os.path.realpath(directory))]:
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"{p} cannot be looked up ({e.strerror})"
        if st.st_uid not in (0, me):
            return f"{p} is owned by uid {st.st_uid}"
        if stat.S_ISLNK(st.st_mode):
            continue  # its target is in the resolved chain
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{p} has mode {stat.S_IMODE(st.st_mode):04o}: writable by others "
                    f"without the sticky bit")
    return ""


def drop_batch_files(directory: str, ledger: str, batch_id: int) -> int:
    """Every file of the batch's attempts removed (after the commit); how many."""
    n = 0
    for f in Path(directory).glob(batch_glob(ledger, batch_id)):
        f.unlink(missing_ok=True)
        n += 1
    return n


class KafkaTaskFiles:
    """What the tasks need to write their parts' task files (`Sink.task_files`): shipped
    to each task (plain values), one `writer` per part attempt."""

    def __init__(self, directory: str, ledger: str, batch_id: int, sink: Any,
                 columns: Mapping[str, str]) -> None:
        self.directory, self.ledger, self.batch_id = directory, ledger, batch_id
        self.sink, self.columns = sink, dict(columns)

    def writer(self, part: int) -> PartWriter:
        return PartWriter(self, part)


class PartWriter:
    """`stage_rows`' `files` for a Kafka sink: every record of the part goes to its task
    file, nothing to the stage (the marker lists the file: `close`)."""

    def __init__(self, tf: KafkaTaskFiles, part: int) -> None:
        self.tf, self.part = tf, part
        # opened with the first record, not before: a part an earlier attempt staged
        # (`stage_rows` returns before any write) or a task failing before its first
        # record leaves no file
        self._file: PartFile | None = None
        self._closed = False
        self._unfit: list[dict[str, Any]] = []

    @property
    def file(self) -> PartFile:
        if self._file is None:
            with self._writing():
                self._file = PartFile(self.tf.directory, self.tf.ledger, self.tf.batch_id,
                                      self.part, self.tf.sink.task_files_mode)
        return self._file

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A file the directory cannot take (full, read-only, not the tasks' to write) as
        one `TaskFileWriteError` the task reports (its attempt's file removed): Spark's
        retries would meet the same, and an `auto` directory on a small /tmp would fail
        every run with a bare OSError, no way out named."""
        try:
            yield
        except OSError as e:
            if e.errno not in NOT_WRITABLE_ERRNOS:
                raise
            self.discard()
            raise TaskFileWriteError(
                f"batch {self.tf.batch_id}: a task cannot write the task file of part "
                f"{self.part} in {self.tf.directory}: {' '.join(str(e).split())}; nothing "
                f"was committed. Make room there (sink.task_files: auto puts the files "
                f"under spark.local.dir, else TMPDIR), name a directory with room in "
                f"sink.task_files, or set sink.task_files: off (the PostgreSQL stage), and "
                f"run the batch again: it commits once") from None

    def write(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, pa.RecordBatch | None]:
        from offsetflow.sinks.kafka.values import finished_records, unbuildable

        if refused := unbuildable(self.tf.sink, self.tf.columns, batch):  # bad records
            self._refuse(batch, refused)
            batch = batch.filter(pc.invert(pc.is_in(
                pa.array(range(batch.num_rows), pa.int64()),
                pa.array(list(refused), pa.int64()))))
            if not batch.num_rows:
                return batch, None
        records = finished_records(self.tf.sink, self.tf.columns, batch)
        if records is None:  # checked before the read (`KafkaPipelineSink.task_files`)
            self.discard()
            raise ValueError(f"batch {self.tf.batch_id}: a record of part {self.part} "
                             f"cannot be built in the task (a column of a type the task "
                             f"does not build)")
        with self._writing():
            self.file.write(records)
        return batch, None

    def take_unfit(self) -> list[dict[str, Any]]:
        """The records refused since the last call, as dead-letter rows (`unbuildable`)."""
        out, self._unfit = self._unfit, []
        return out

    def _refuse(self, batch: pa.RecordBatch, refused: dict[int, str]) -> None:
        idx = sorted(refused)
        rows = batch.select(["topic", "partition", "offset", "timestamp", "key", "value"]
                            ).take(pa.array(idx, pa.int64())).to_pylist()
        self._unfit += [{**row, "error": refused[i]} for i, row in zip(idx, rows, strict=True)]

    def close(self) -> list[dict[str, Any]]:
        with self._writing():
            entry = self.file.close()
        self._closed = True
        return [entry]

    def discard(self) -> None:
        """The attempt's unfinished file removed (a failed attempt)."""
        self._closed = True
        if self._file is not None:
            self._file.discard()

    def __del__(self) -> None:
        # a task that failed mid-part (`stage_rows` raised past it): best effort, its
        # temporary file goes when the writer does; a killed task's stays until the batch's
        # commit or `complete` drops the batch's every file
        if not self._closed:
            with contextlib.suppress(Exception):
                self.discard()
