"""Staging, run in Spark tasks: each task COPYs its rows into its part of the batch's stage
and, in the same PostgreSQL transaction, writes the part's `staged_parts` marker; a retried
or speculative attempt finds the marker (or blocks on it) and stages nothing twice.

Bad records never depend on chunk boundaries, which a retry may draw differently (another
chunk size, records compacted away meanwhile): on the fused path they are written in the
part's own transaction (`BadBuffer`), on the DataFrame path, where reading and staging are
separate tasks, they are keyed by their coordinates (`SubrangeBad`) and the sub-range's
marker is written once it is read to its end.

Safety net: a chunk whose COPY PostgreSQL refuses with a data error (a value the
deserializer's checks did not foresee, or one a transform produced) is rolled back to a
savepoint and bisected; each row PostgreSQL refuses becomes a bad record with its error as
the reason, the rest is staged, and its marker is written in the same transaction."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.extensions
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg2 import sql

from offsetflow import pgcopy
from offsetflow.errors import StaleStageError
from offsetflow.ledger import Ledger, connect, dead_letter_stage_table, stage_table
from offsetflow.metrics import TaskClock
from offsetflow.stage_form import stage_form


def _csv_bytes(batch: pa.RecordBatch | pa.Table) -> bytes:
    buf = io.BytesIO()
    pacsv.write_csv(batch, buf, pacsv.WriteOptions(include_header=False))
    return buf.getvalue()


def _copy(cur: psycopg2.extensions.cursor, table: sql.Composable, columns: Sequence[str],
          data: bytes, fmt: str = "csv") -> None:
    cur.copy_expert(sql.SQL("COPY {} ({}) FROM STDIN WITH (FORMAT {})").format(
        table, sql.SQL(", ").join(sql.Identifier(c) for c in columns),
        sql.SQL({"csv": "csv", "binary": "binary"}[fmt])), io.BytesIO(data))


Encoder = Callable[[pa.RecordBatch], tuple[str, bytes]]


def csv_encoder(batch: pa.RecordBatch) -> tuple[str, bytes]:
    """For batches already in stage form (binary as hex text, nested as JSON)."""
    return "csv", _csv_bytes(batch)


def binary_encoder(pg_types: Sequence[str]) -> Encoder:
    """For raw Arrow batches in stage-column order: binary COPY where every column type has
    a binary layout (the usual case), else hex/JSON text as CSV."""
    types = list(pg_types)
    use_binary = pgcopy.supported(types)

    def encode(batch: pa.RecordBatch) -> tuple[str, bytes]:
        if use_binary:
            data = pgcopy.encode(stage_form(batch, hex_binary=False), types)
            if data is not None:
                return "binary", data
        return "csv", _csv_bytes(stage_form(batch))
    return encode


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


@dataclass(frozen=True)
class BadRows:
    """Where rows PostgreSQL refuses go: always a marker naming them (so a `fail` pipeline
    fails naming the first), the rows too in the dead-letter stage under `dead_letter`."""

    pipeline: str
    write_rows: bool


# the bad-record marker chunk of rows refused at staging (a part's own chunks count from 0)
REFUSED_CHUNK = -1


def stage_rows(dsn: str, batch_id: int, part: int, batches: Iterable[pa.RecordBatch],
               clock: TaskClock | None = None, encode: Encoder = csv_encoder,
               table: sql.Composed | None = None, bad: BadRows | None = None,
               bad_in: BadBuffer | None = None, generation: int | None = None,
               subranges: Sequence[int] | None = None, files: Any = None) -> dict[str, Any]:
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
                        _copy_dead(cur, batch_id, bad.pipeline, rows_in)
                    tally.add(rows_in)
                if b is None:
                    break
                if b.num_rows == 0:
                    continue
                if files is not None:
                    with clock.stage("files"):
                        written, rest = files.write(b)
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
                        _copy(cur, into, b.schema.names, data, fmt)
                    staged = [b]
                else:
                    staged = _copy_or_bisect(cur, into, b, encode, clock, refused)
                for s in staged:
                    rows += s.num_rows
                    _count_coordinates(s, per_tp)
            clock.count("rows", rows)
            data_files = None if files is None else json.dumps(files.close())
            cur.execute("""UPDATE offsetflow.staged_parts
                              SET rows_staged = %s, per_partition = %s, data_files = %s
                            WHERE batch_id = %s AND kind = 'rows' AND part = %s AND chunk = 0""",
                        (rows, json.dumps(per_tp), data_files, batch_id, part))
            if refused:
                assert bad is not None
                if bad.write_rows:
                    _copy_dead(cur, batch_id, bad.pipeline, refused)
                tally.add(refused)
            if tally.count:
                _claim_part(cur, batch_id, "bad", part, REFUSED_CHUNK, generation)
                tally.mark(cur, batch_id, part, REFUSED_CHUNK)
        return {"part": part, "skipped": False, "rows": rows, "bad": tally.count,
                "per_partition": per_tp}
    finally:
        conn.close()


# failed COPYs of one chunk after which bisecting stops: where most rows are refused it
# would cost ~2n COPYs, each of the first ones copying half the chunk
BISECT_FAILURES = 4


def _copy_or_bisect(cur: psycopg2.extensions.cursor, into: sql.Composed, b: pa.RecordBatch,
                    encode: Encoder, clock: TaskClock, refused: list[dict[str, Any]],
                    failures: list[int] | None = None) -> list[pa.RecordBatch]:
    """COPY `b` under a savepoint. On a data error, roll back and bisect until the refused
    rows are single; returns the slices that were staged, appends the refused rows. Costs
    two statements per chunk when nothing is wrong, O(bad * log(rows)) COPYs when a few
    rows are refused; after BISECT_FAILURES failures the rest goes row by row
    (`_copy_row_by_row`), so a chunk of mostly refused rows costs about a COPY per row."""
    failures = [0] if failures is None else failures
    error = _try_copy(cur, into, b, encode, clock)
    if error is None:
        return [b]
    failures[0] += 1
    if b.num_rows == 1:
        refused.append(_refused_row(b, _pg_reason(error, b)))
        return []
    if failures[0] > BISECT_FAILURES:
        return _copy_row_by_row(cur, into, b, encode, clock, refused, error)
    mid = b.num_rows // 2
    return (_copy_or_bisect(cur, into, b.slice(0, mid), encode, clock, refused, failures)
            + _copy_or_bisect(cur, into, b.slice(mid), encode, clock, refused, failures))


def _try_copy(cur: psycopg2.extensions.cursor, into: sql.Composed, b: pa.RecordBatch,
              encode: Encoder, clock: TaskClock) -> psycopg2.DataError | None:
    """COPY `b` under a savepoint; PostgreSQL's data error (rolled back) or None. The
    error carries the payload's format in `offsetflow_fmt`."""
    with clock.stage("encode"):
        fmt, data = encode(b)
    with clock.stage("copy"):
        cur.execute("SAVEPOINT offsetflow_chunk")
        try:
            _copy(cur, into, b.schema.names, data, fmt)
        except psycopg2.DataError as e:
            cur.execute("ROLLBACK TO SAVEPOINT offsetflow_chunk")
            cur.execute("RELEASE SAVEPOINT offsetflow_chunk")
            e.offsetflow_fmt = fmt  # type: ignore[attr-defined]
            return e
        cur.execute("RELEASE SAVEPOINT offsetflow_chunk")
    return None


_LINE_RE = re.compile(r"^COPY \S+, line (\d+)")


def _copy_row_by_row(cur: psycopg2.extensions.cursor, into: sql.Composed, b: pa.RecordBatch,
                     encode: Encoder, clock: TaskClock, refused: list[dict[str, Any]],
                     error: psycopg2.DataError) -> list[pa.RecordBatch]:
    """Stage `b`, whose COPY just failed with `error`, a refused row at a time. A binary
    COPY's error names the tuple it refused (its "line"): the rows before it go in one
    COPY, and the rest is tried again. Otherwise (CSV, whose "line" is not a row where a
    value holds a newline) each row is COPYed on its own."""
    staged: list[pa.RecordBatch] = []
    i, n = 0, b.num_rows
    err: psycopg2.DataError | None = error
    while i < n:
        rest = b.slice(i)
        if err is None:
            err = _try_copy(cur, into, rest, encode, clock)
            if err is None:
                staged.append(rest)
                return staged
        m = _LINE_RE.search(err.diag.context or "") \
            if getattr(err, "offsetflow_fmt", None) == "binary" else None
        line = int(m.group(1)) if m else 0
        if not 1 <= line <= rest.num_rows:  # not named: each row on its own
            for j in range(rest.num_rows):
                row = rest.slice(j, 1)
                row_err = _try_copy(cur, into, row, encode, clock)
                if row_err is None:
                    staged.append(row)
                else:
                    refused.append(_refused_row(row, _pg_reason(row_err, row)))
            return staged
        good = rest.slice(0, line - 1)
        if good.num_rows:
            # the named row's predecessors passed once; should they not (a wrong line),
            # they go row by row too
            good_err = _try_copy(cur, into, good, encode, clock)
            if good_err is None:
                staged.append(good)
            else:
                staged += _copy_row_by_row(cur, into, good, encode, clock, refused,
                                           _unnamed(good_err))
        row = rest.slice(line - 1, 1)
        refused.append(_refused_row(row, _pg_reason(err, row)))
        i, err = i + line, None
    return staged


def _unnamed(e: psycopg2.DataError) -> psycopg2.DataError:
    e.offsetflow_fmt = None  # type: ignore[attr-defined]
    return e


_COLUMN_RE = re.compile(r"column (\S+?)(?::|$)")


def _pg_reason(e: psycopg2.Error, row: pa.RecordBatch) -> str:
    """PostgreSQL's message and the column: from COPY's context, or for encoding errors
    (found before COPY splits the line into columns) the text column holding NUL or
    invalid UTF-8."""
    msg = (e.diag.message_primary or str(e).strip().splitlines()[0]).strip()
    m = _COLUMN_RE.search(e.diag.context or "")
    column = m.group(1) if m else _bad_text_column(row)
    where = f" (column {column})" if column else ""
    return f"PostgreSQL refused the row at staging: {msg}{where}"


def _bad_text_column(row: pa.RecordBatch) -> str | None:
    for f, col in zip(row.schema, row.columns, strict=True):
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            v = col.cast(pa.binary())[0].as_py()
            if v is None:
                continue
            try:
                v.decode("utf-8")
            except UnicodeDecodeError:
                return f.name
            if b"\x00" in v:
                return f.name
    return None


def _refused_row(b: pa.RecordBatch, reason: str) -> dict[str, Any]:
    """One refused row's coordinates and raw key/value, from raw or stage-form columns."""
    def get(name: str) -> Any:
        if name not in b.schema.names:
            return None
        col = b.column(name)
        if name in ("key", "value") and (pa.types.is_string(col.type)
                                         or pa.types.is_large_string(col.type)):
            # stage form: hex text; other text (a transform's) as its bytes
            raw = col.cast(pa.binary())[0].as_py()
            return None if raw is None else (
                bytes.fromhex(raw[2:].decode()) if raw.startswith(b"\\x") else raw)
        if pa.types.is_timestamp(col.type):  # as microseconds: any year, no datetime
            return col.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())[0].as_py()
        return col[0].as_py()
    return {"topic": get("topic"), "partition": get("partition"), "offset": get("offset"),
            "timestamp": get("timestamp"), "key": get("key"), "value": get("value"),
            "error": reason, "stage": "stage"}


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


@dataclass
class BadTally:
    """How many bad records a marker counts, and a sample of each Kafka partition's first
    (so the driver can fail a `fail` batch naming the first one)."""

    count: int = 0
    sample: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)

    def add(self, rows: Sequence[dict[str, Any]]) -> None:
        self.count += len(rows)
        for r in rows:
            s = self.sample.setdefault((r["topic"], r["partition"]), [])
            if len(s) < 5:
                s.append({k: r[k] for k in ("topic", "partition", "offset", "error")})

    def mark(self, cur: psycopg2.extensions.cursor, batch_id: int, part: int,
             chunk: int) -> None:
        sample = [x for s in self.sample.values() for x in s]
        cur.execute("""UPDATE offsetflow.staged_parts SET bad_records = %s, per_partition = %s
                        WHERE batch_id=%s AND kind='bad' AND part=%s AND chunk=%s""",
                    (self.count, json.dumps({"sample": sample}), batch_id, part, chunk))


@dataclass
class BadBuffer:
    """The fused path's bad records on their way from the reader into the part's own
    transaction (`stage_rows(bad_in=...)`): one chunk's at a time."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, rows: Sequence[dict[str, Any]]) -> None:
        self.rows.extend(rows)

    def take(self) -> list[dict[str, Any]]:
        out, self.rows = self.rows, []
        return out


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
                    _ensure_coordinate_index(cur, self.batch_id)
                    self._indexed = True
                _copy_dead(cur, self.batch_id, self.bad.pipeline, rows, keyed=True)
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


def _ensure_coordinate_index(cur: psycopg2.extensions.cursor, batch_id: int) -> None:
    """Read-side dead letters are unique by coordinates (rows refused at staging are not: a
    transform may turn one record into several rows). Created by the first task that needs
    it; the lock keeps concurrent tasks from racing on the catalog."""
    cur.execute("SELECT pg_advisory_xact_lock(hashtext('offsetflow_dead_index'), %s)",
                (int(batch_id),))
    cur.execute(sql.SQL("""CREATE UNIQUE INDEX IF NOT EXISTS {} ON {}
                           (topic, partition, "offset") WHERE stage = 'deserialize'""").format(
        sql.Identifier(f"b{int(batch_id)}_dead_coordinates"), dead_letter_stage_table(batch_id)))


def _copy_dead(cur: psycopg2.extensions.cursor, batch_id: int, pipeline: str,
               rows: Sequence[dict[str, Any]], keyed: bool = False) -> None:
    """Bad records into the dead-letter stage; `keyed`: skip those already there."""
    t = pa.table({
        "pipeline": [pipeline] * len(rows),
        "topic": [r["topic"] for r in rows],
        "partition": pa.array([r["partition"] for r in rows], pa.int32()),
        "offset": pa.array([r["offset"] for r in rows], pa.int64()),
        "timestamp": pa.array([r["timestamp"] for r in rows], pa.timestamp("us", tz="UTC")),
        "key": [_hex(r["key"]) for r in rows],
        "value": [_hex(r["value"]) for r in rows],
        "error": [r["error"] for r in rows],
        "stage": [r.get("stage", "deserialize") for r in rows],
    })
    dead = dead_letter_stage_table(batch_id)
    if not keyed:
        _copy(cur, dead, t.schema.names, _csv_bytes(t))
        return
    cur.execute(sql.SQL("CREATE TEMP TABLE offsetflow_dead_in (LIKE {}) ON COMMIT DROP")
                .format(dead))
    _copy(cur, sql.SQL("offsetflow_dead_in"), t.schema.names, _csv_bytes(t))
    cur.execute(sql.SQL("""INSERT INTO {} SELECT * FROM offsetflow_dead_in
                           ON CONFLICT (topic, partition, "offset") WHERE stage = 'deserialize'
                           DO NOTHING""").format(dead))


def _hex(b: bytes | None) -> str | None:
    return None if b is None else "\\x" + b.hex()


def bad_record_summary(ledger: Ledger, batch_id: int) -> tuple[int, list[dict[str, Any]]]:
    with ledger.transaction() as cur:
        cur.execute("""SELECT COALESCE(sum(bad_records), 0), array_agg(per_partition)
                         FROM offsetflow.staged_parts WHERE batch_id = %s AND kind = 'bad'""",
                    (batch_id,))
        row = cur.fetchone()
    assert row is not None
    samples = [s for pp in (row[1] or []) if pp for s in pp.get("sample", [])]
    samples.sort(key=lambda s: (s["topic"], s["partition"], s["offset"]))
    return int(row[0]), samples

