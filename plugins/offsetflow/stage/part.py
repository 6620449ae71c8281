"""Staging, run in Spark tasks: each task COPYs its rows into its part of the batch's stage
and, in the same PostgreSQL transaction, writes the part's `staged_parts` marker; a retried
or speculative attempt finds the marker (or blocks on it) and stages nothing twice.

Bad records never depend on chunk boundaries, which a retry may draw differently (another
chunk size, records compacted away meanwhile): on the fused path they are written in the
part's own transaction (`BadBuffer`), on the DataFrame path, where reading and staging are
separate tasks, they are keyed by their coordinates (`SubrangeBad`) and the sub-range's
marker is written once it is read to its end.

Safety net (`offsetflow.stage.refused`): a chunk whose COPY PostgreSQL refuses with a data
error is bisected; each row PostgreSQL refuses becomes a bad record with its error as the
reason, the rest is staged, and its marker is written in the same transaction.

Beside this module: the COPY payloads (`offsetflow.stage.payload`), the bad records' way into
the dead-letter stage (`offsetflow.stage.bad_records`); the driver reads the markers with
`offsetflow.stage.markers`."""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg2.extensions
import pyarrow as pa
import pyarrow.compute as pc
from psycopg2 import sql

from offsetflow.errors import StaleStageError
from offsetflow.ledger import connect, stage_table
from offsetflow.stage.bad_records import (
    REFUSED_CHUNK,
    BadBuffer,
    BadRows,
    BadTally,
    copy_dead,
    ensure_coordinate_index,
)
from offsetflow.stage.metrics import TaskClock
from offsetflow.stage.payload import Encoder, copy_into, csv_encoder
from offsetflow.stage.refused import copy_or_bisect

log = logging.getLogger(__name__)

# test-only fault points of a task (tests/integration/sinks/kafka/
# test_sink_kafka_task_files_faults.py), looked up once per part: `kill-before-marker:<flag>`
# SIGKILLs the first attempt to get there (the one that creates <flag>) once its part's
# files are complete under their final names, before its marker commits;
# `kill-after-marker:<flag>` right after its marker committed, before the task returns.
# <flag> gets the attempt's pid, then its files' paths
TASK_FAULT_ENV = "OFFSETFLOW_TEST_STAGE_TASK_FAULT"


def _claim_part(cur: psycopg2.extensions.cursor, batch_id: int, kind: str, part: int,
                chunk: int, generation: int | None, subranges: Sequence[int] | None = None
                ) -> dict[str, Any] | None:
    """Insert the part's marker, of the stage generation the run stages under and naming
    the sub-ranges the part reads (fused path); return the earlier attempt's stats if it
    already exists (one of another layout is skipped too: the commit refuses it). A
    concurrent attempt blocks here on the primary key until the first one ends. A task of a
    run whose stage was rebuilt since (a zombie) stages nothing (`StaleStageError`); one
    that slips past this check just before the rebuild leaves a marker of the old
    generation, which the commit refuses."""
    generation = _check_generation(cur, batch_id, generation)
    cur.execute("""INSERT INTO offsetflow.staged_parts
                     (batch_id, kind, part, chunk, rows_staged, bad_records, generation,
                      subranges)
                   VALUES (%s, %s, %s, %s, 0, 0, %s, %s) ON CONFLICT DO NOTHING""",
                (batch_id, kind, part, chunk, generation,
                 None if subranges is None else [int(i) for i in subranges]))
    if cur.rowcount == 1:
        return None
    cur.execute("""SELECT rows_staged, bad_records, per_partition FROM offsetflow.staged_parts
                    WHERE batch_id=%s AND kind=%s AND part=%s AND chunk=%s""",
                (batch_id, kind, part, chunk))
    row = cur.fetchone()
    assert row is not None
    return {"rows": row[0], "bad": row[1], "per_partition": row[2]}


def _check_generation(cur: psycopg2.extensions.cursor, batch_id: int,
                      generation: int | None) -> int | None:
    """`generation` if it is the batch's current one (None: the current one)."""
    cur.execute("SELECT stage_generation FROM offsetflow.batches WHERE batch_id = %s",
                (batch_id,))
    row = cur.fetchone()
    if row is None:
        return generation
    if generation is not None and int(row[0]) != generation:
        raise StaleStageError(batch_id, generation, int(row[0]))
    return int(row[0])


def stage_rows(dsn: str, batch_id: int, part: int, batches: Iterable[pa.RecordBatch],
               clock: TaskClock | None = None, encode: Encoder = csv_encoder,
               table: sql.Composed | None = None, bad: BadRows | None = None,
               bad_in: BadBuffer | None = None, generation: int | None = None,
               subranges: Sequence[int] | None = None, files: Any = None,
               schema_ids: bool = False) -> dict[str, Any]:
    """Stage one Spark partition's rows in one transaction with its marker.

    `encode` turns a batch into a COPY payload: `csv_encoder` for batches already in stage
    form (binary as `\\x..` hex, nested as JSON), `binary_encoder` for raw Arrow batches.
    `table` is the part's own stage table (`stage_part_table`), else the stage table.
    With `bad`, rows PostgreSQL refuses are bad records (see the module docstring);
    without it a refused COPY fails the task. `bad_in` holds the bad records the reader of
    `batches` finds; they are written here, in the part's transaction, as they come.
    `generation`: the stage generation the run stages under (`stage_reset.stage_generation`;
    the job always passes it, None takes the batch's current one). `subranges`: the
    sub-ranges of the batch's split the part reads (fused path), recorded in its marker.
    `files`: the rows go to Iceberg data files instead (`sink_iceberg_tasks.PartFiles`;
    what it leaves, tombstones routed by policy, is staged), listed in the marker.
    `schema_ids` (the registry formats): the marker names the writer schema ids the reader
    noted in `bad_in` (`note_schema_ids`: of every record read, dead letters too) with the
    first offset of each, per topic/partition (`markers.staged_schema_ids`).
    Returns the per-part stats; a part staged by an earlier attempt is not written again.
    """
    into = table if table is not None else stage_table(batch_id)
    conn = connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            earlier = _claim_part(cur, batch_id, "rows", part, 0, generation, subranges)
            if earlier is not None:
                return {"part": part, "skipped": True, **earlier}
            rows = 0
            per_tp: dict[str, list[int]] = {}  # "topic/partition" -> [count, min, max]
            refused: list[dict[str, Any]] = []
            tally = BadTally()
            clock = clock or TaskClock()
            it = iter(batches)
            while True:
                with clock.stage("wait_upstream"):
                    b = next(it, None)
                if bad_in is not None and bad_in.rows:
                    assert bad is not None
                    rows_in = bad_in.take()
                    if bad.write_rows:
                        copy_dead(cur, batch_id, bad.pipeline, rows_in)
                    tally.add(rows_in)
                if b is None:
                    break
                if b.num_rows == 0:
                    continue
                if files is not None:
                    with clock.stage("files"):
                        written, rest = files.write(b)
                    unfit = files.take_unfit()  # values the table's types refuse
                    if unfit:
                        assert bad is not None
                        if bad.write_rows:
                            copy_dead(cur, batch_id, bad.pipeline, unfit)
                        tally.add(unfit)
                    if written.num_rows:
                        rows += written.num_rows
                        _count_coordinates(written, per_tp)
                    if rest is None or not rest.num_rows:
                        continue
                    b = rest
                if bad is None:
                    with clock.stage("encode"):
                        fmt, data = encode(b)
                    with clock.stage("copy"):
                        copy_into(cur, into, b.schema.names, data, fmt)
                    staged = [b]
                else:
                    staged = copy_or_bisect(cur, into, b, encode, clock, refused)
                for s in staged:
                    rows += s.num_rows
                    _count_coordinates(s, per_tp)
            clock.count("rows", rows)
            entries = None if files is None else files.close()
            data_files = None if entries is None else json.dumps(entries)
            _task_fault("kill-before-marker", entries)
            cur.execute("""UPDATE offsetflow.staged_parts
                              SET rows_staged = %s, per_partition = %s, data_files = %s,
                                  schema_ids = %s
                            WHERE batch_id = %s AND kind = 'rows' AND part = %s AND chunk = 0""",
                        (rows, json.dumps(per_tp), data_files,
                         json.dumps(bad_in.schema_ids) if schema_ids and bad_in is not None
                         else None, batch_id, part))
            if refused:
                assert bad is not None
                if bad.write_rows:
                    copy_dead(cur, batch_id, bad.pipeline, refused)
                tally.add(refused)
            if tally.count:
                _claim_part(cur, batch_id, "bad", part, REFUSED_CHUNK, generation)
                tally.mark(cur, batch_id, part, REFUSED_CHUNK)
        _task_fault("kill-after-marker", entries)
        return {"part": part, "skipped": False, "rows": rows, "bad": tally.count,
                "per_partition": per_tp}
    finally:
        conn.close()


def _task_fault(point: str, entries: Sequence[dict[str, Any]] | None) -> None:
    """Test-only (TASK_FAULT_ENV): this attempt killed at `point` if it is the first there."""
    want, _, flag = os.environ.get(TASK_FAULT_ENV, "").partition(":")
    if want != point or not flag:
        return
    try:
        fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # an earlier attempt died here: this one lives
    os.write(fd, "\n".join([str(os.getpid()), *(str(e["path"]) for e in entries or ())
                            ]).encode())
    os.close(fd)
    log.warning("%s: killing this task attempt (test fault)", point)
    os.kill(os.getpid(), signal.SIGKILL)


def _count_coordinates(b: pa.RecordBatch, acc: dict[str, list[int]]) -> None:
    t = pa.Table.from_batches([b]).select(["topic", "partition", "offset"])
    g = t.group_by(["topic", "partition"]).aggregate(
        [("offset", "count"), ("offset", "min"), ("offset", "max")])
    for topic, p, n, lo, hi in zip(*(g.column(i).to_pylist() for i in range(5)), strict=True):
        k = f"{topic}/{p}"
        if k in acc:
            c = acc[k]
            acc[k] = [c[0] + n, min(c[1], lo), max(c[2], hi)]
        else:
            acc[k] = [n, lo, hi]


def note_schema_ids(acc: dict[str, dict[str, int]], values: Sequence[bytes | None],
                    offsets: Sequence[int], topic: str, partition: int,
                    topics: Sequence[str] | None = None,
                    partitions: Sequence[int] | None = None) -> None:
    """Into `acc` ("topic/partition" -> schema id -> first offset): the writer schema id of
    each record whose value is in the Confluent wire format (magic byte 0, a 4-byte id).
    A chunk of one range (`topics` None: all of `topic`[`partition`], offsets ascending):
    its 5-byte headers in one Python pass (measured 2x faster than through Arrow, which
    copies the values first); a packed chunk of several ranges: grouped in Arrow."""
    if topics is None and partitions is None:
        heads = [v[:5] if v is not None else b"" for v in values]
        mine = acc.setdefault(f"{topic}/{partition}", {})
        for h in set(heads):
            if len(h) == 5 and h[0] == 0:
                sid = str(int.from_bytes(h[1:], "big"))
                first = int(offsets[heads.index(h)])
                mine[sid] = min(mine.get(sid, first), first)
        if not mine:
            del acc[f"{topic}/{partition}"]
        return
    n = len(values)
    head = pc.binary_slice(pa.array(values, pa.binary()), 0, 5)
    keep = pc.and_(pc.equal(pc.binary_length(head), 5),
                   pc.equal(pc.binary_slice(head, 0, 1), b"\x00"))
    t = pa.table({
        "topic": pa.array([topic] * n if topics is None else topics, pa.string()),
        "partition": pa.array([partition] * n if partitions is None else partitions,
                              pa.int32()),
        "offset": pa.array(offsets, pa.int64()),
        "value": pc.binary_slice(head, 1, 5)}).filter(pc.fill_null(keep, False))
    if not t.num_rows:
        return
    g = t.group_by(["topic", "partition", "value"]).aggregate([("offset", "min")])
    for tp_topic, p, header, first in zip(*(g.column(c).to_pylist() for c in (
            "topic", "partition", "value", "offset_min")), strict=True):
        sid = str(int.from_bytes(header, "big"))
        mine = acc.setdefault(f"{tp_topic}/{p}", {})
        mine[sid] = min(mine.get(sid, first), first)


class SubrangeBad:
    """The DataFrame path's bad records of one sub-range, read by a task that stages no
    rows. Dead letters are written chunk by chunk keyed by their coordinates (a unique index
    on the dead-letter stage; a retry's or a concurrent attempt's copy is dropped), and the
    sub-range's marker, counting them all, once it is read to its end (`close`)."""

    # a sub-range's marker; rows refused at staging use REFUSED_CHUNK, rows use 0 of kind rows
    CHUNK = 0

    def __init__(self, dsn: str, batch_id: int, idx: int, bad: BadRows,
                 generation: int | None = None) -> None:
        self.dsn, self.batch_id, self.idx, self.bad = dsn, batch_id, idx, bad
        self.generation = generation
        self.tally = BadTally()
        self._indexed = False

    def add(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        self.tally.add(rows)
        if not self.bad.write_rows:
            return
        conn = connect(self.dsn)
        try:
            with conn, conn.cursor() as cur:
                if not self._indexed:
                    ensure_coordinate_index(cur, self.batch_id)
                    self._indexed = True
                copy_dead(cur, self.batch_id, self.bad.pipeline, rows, keyed=True)
        finally:
            conn.close()

    def close(self) -> None:
        if not self.tally.count:
            return
        conn = connect(self.dsn)
        try:
            with conn, conn.cursor() as cur:
                if _claim_part(cur, self.batch_id, "bad", self.idx, self.CHUNK,
                               self.generation) is None:
                    self.tally.mark(cur, self.batch_id, self.idx, self.CHUNK)
        finally:
            conn.close()
