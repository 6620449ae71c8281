"""The Kafka sink's record path without PostgreSQL (issue 32, task files).

The JSON values a task builds (`offsetflow.sinks.kafka.values.json_values`) are byte for
byte the ones PostgreSQL's `row_to_json` builds from the same rows staged as the tasks stage
them (binary COPY), read with the sink's own query under its `OUTPUT_SETTINGS`: the edge
cases of every type built in the task, checked against the stack's PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import random
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import psycopg2
import pyarrow as pa
import pytest
from psycopg2 import sql

from offsetflow.sinks.kafka.values import json_values
from tests.tooling.kafka_case import with_task_files
from tests.tooling.kafka_sink_shape import KafkaSinkShape
from tests.tooling.kafka_staging import stage_query_rows, task_file_reads

UTC = UTC
_rng = random.Random(32)
FLOATS = [0.0, -0.0, 1.0, -1.5, 100000.0, 1e15, 1e16, 1e20, 1e22, 1e100, 1e-4, 1e-5,
          1.5e-7, 0.1, 0.30000000000000004, 123456789012345.6, 1234567890123456.8,
          999999999999999.9, 2.2250738585072014e-308, 5e-324, 1.7976931348623157e308,
          float("nan"), float("inf"), float("-inf"), 0.001, 12.34, -0.00012, None,
          *(_rng.uniform(-1e6, 1e6) for _ in range(30)),
          *(10 ** _rng.uniform(-30, 30) for _ in range(30))]
REALS = [0.0, -0.0, 1.0, 100000.0, 1e6, 1234567.0, 1e-4, 1e-5, 0.1, 3.4e38, 1.4e-45,
         float("nan"), float("inf"), 123456.7, None,
         *(10 ** _rng.uniform(-20, 20) for _ in range(30))]
TEXTS = ["plain", "", "quote \" and backslash \\", "tab\tnew\nline\rcr\bbs\fff",
         "\x01\x1f ctl", "\x7f del", "unicode é ü 漢字 🎉", "\u2028\u2029", "/slash",
         "\\u0041 literal", None]
TIMES = [datetime(2026, 11, 27, 12, 0, tzinfo=UTC), datetime(2026, 1, 1, 0, 0, 0, 1, UTC),
         datetime(2026, 1, 1, 0, 0, 0, 100000, UTC), datetime(2026, 1, 1, 0, 0, 0, 123456, UTC),
         datetime(1970, 1, 1, tzinfo=UTC), datetime(1, 1, 1, tzinfo=UTC),
         datetime(9999, 12, 31, 23, 59, 59, 999999, UTC), datetime(1969, 12, 31, 23, 59, 59,
                                                                   500000, UTC), None]


def _column(values: list[Any], n: int) -> list[Any]:
    return [values[i % len(values)] for i in range(n)]


def _batch() -> tuple[pa.RecordBatch, dict[str, str]]:
    n = max(len(FLOATS), len(REALS), len(TEXTS), len(TIMES)) + 3
    cols: dict[str, tuple[pa.Array, str]] = {
        "topic": (pa.array(["src"] * n), "text"),
        "partition": (pa.array([0] * n, pa.int32()), "integer"),
        "offset": (pa.array(range(n), pa.int64()), "bigint"),
        "value": (pa.array([None if i == n - 1 else b"v" for i in range(n)], pa.binary()),
                  "bytea"),
        "d": (pa.array(_column(FLOATS, n), pa.float64()), "double precision"),
        "r": (pa.array(_column(REALS, n), pa.float32()), "real"),
        "t": (pa.array(_column(TEXTS, n), pa.string()), "text"),
        "ts": (pa.array(_column(TIMES, n), pa.timestamp("us", "UTC")), "timestamptz"),
        "ntz": (pa.array([None if t is None else t.replace(tzinfo=None)
                          for t in _column(TIMES, n)], pa.timestamp("us")), "timestamp"),
        "day": (pa.array(_column([date(2026, 2, 28), date(1, 1, 1), date(9999, 12, 31),
                                  None], n), pa.date32()), "date"),
        "i": (pa.array(_column([0, -1, 2**63 - 1, -2**63, None], n), pa.int64()), "bigint"),
        "small": (pa.array(_column([0, -32768, 32767, None], n), pa.int16()), "smallint"),
        "int": (pa.array(_column([7, -2**31, None], n), pa.int32()), "integer"),
        "b": (pa.array(_column([True, False, None], n), pa.bool_()), "boolean"),
        "weird \"name\" é": (pa.array(_column(["x"], n)), "text"),
    }
    batch = pa.RecordBatch.from_arrays([a for a, _ in cols.values()], names=list(cols))
    return batch, {c: t for c, (_, t) in cols.items()}


@pytest.mark.parametrize("float_digits", [None, "0"])
def test_task_built_json_values_are_row_to_json_byte_for_byte(
        pg_dsn: str, unique: str, float_digits: str | None) -> None:
    """Every built type's edge cases (shortest floats in both notations, NaN and the
    infinities, -0, float4, control characters and non-ASCII text, timestamps with and
    without fractions and time zone at years 1 and 9999, dates, integer limits, NULLs, a
    tombstone, a column name needing escapes), whatever the session's own settings."""
    batch, types = _batch()
    payload = [c for c in types if c not in ("topic", "partition", "offset", "value")]
    sink = KafkaSinkShape(headers="none")
    sink.value_columns = tuple(payload)
    want = [r[4] for r in stage_query_rows(
        pg_dsn, f"kv_{unique}", types, batch, sink,
        session=() if float_digits is None else (f"SET extra_float_digits = {float_digits}",))]
    built = json_values(batch, payload, types)
    assert built is not None
    got = [None if v is None else v.decode() for v in built.to_pylist()]
    diffs = [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    assert not diffs, diffs[:5]
    assert got[-1] is None  # the tombstone stays one
    assert any('"NaN"' in (v or "") for v in got)


def _raw_batch() -> tuple[pa.RecordBatch, dict[str, str]]:
    """Rows as a task stages them (before stage form): headers nested, timestamps with
    sub-millisecond fractions both sides of .5 ms and before 1970, a tombstone."""
    n = 12
    hdr = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    us = [1_700_000_000_000_000 + d for d in (0, 499, 500, 501, 999, 1500)] + \
         [-1_000_000 - d for d in (0, 499, 500, 501, 1500)] + [None]
    cols: dict[str, tuple[pa.Array, str]] = {
        "topic": (pa.array(["src"] * n), "text"),
        "partition": (pa.array([0] * n, pa.int32()), "integer"),
        "offset": (pa.array(range(n), pa.int64()), "bigint"),
        "timestamp": (pa.array(us, pa.int64()).cast(pa.timestamp("us", "UTC")),
                      "timestamptz"),
        "key": (pa.array([b"\x00\xffk", None] * 6, pa.binary()), "bytea"),
        "value": (pa.array([None if i == 3 else b"raw \xff" for i in range(n)], pa.binary()),
                  "bytea"),
        "headers": (pa.array([[{"key": "h", "value": b"\x01\x02"}, {"key": "n", "value": None}],
                              None, []] * 4, hdr), "jsonb"),
        "name": (pa.array(_column(TEXTS, n)), "text"),
        "amount": (pa.array(_column(FLOATS, n), pa.float64()), "double precision"),
        "at": (pa.array(_column(TIMES, n), pa.timestamp("us", "UTC")), "timestamptz"),
        "n": (pa.array(_column([5, None, -3], n), pa.int64()), "bigint"),
    }
    return (pa.RecordBatch.from_arrays([a for a, _ in cols.values()], names=list(cols)),
            {c: t for c, (_, t) in cols.items()})


@pytest.mark.parametrize("shape", ["json source key", "json key_column text",
                                   "json key_column bigint", "json key_column timestamptz",
                                   "json key_column double", "json value_columns",
                                   "raw bytea", "raw text", "no headers"])
def test_task_built_records_are_the_stage_querys(pg_dsn: str, unique: str,
                                                 shape: str) -> None:
    """Every field the produce loop takes (key bytes, value, headers, timestamp) built in
    the task equals what the sink's stage query gives for the same staged rows."""
    from offsetflow.sinks.kafka.form import record_key
    from offsetflow.sinks.kafka.values import finished_records
    from offsetflow.stage import stage_form

    raw, types = _raw_batch()
    cfg = KafkaSinkShape()
    cfg.key_column = {"json key_column text": "name", "json key_column bigint": "n",
                      "json key_column timestamptz": "at",
                      "json key_column double": "amount"}.get(shape)
    if shape == "json value_columns":
        cfg.value_columns = ("n", "name")
    if shape.startswith("raw"):
        cfg.value_format = "raw"
        cfg.value_column = "value" if shape == "raw bytea" else "name"
    if shape == "no headers":
        cfg.headers = "none"
    staged = stage_form(raw, hex_binary=False)
    want = [(t, p, o, record_key(k), None if v is None else
             v.encode() if isinstance(v, str) else bytes(v), h, ts)
            for t, p, o, k, v, h, ts in stage_query_rows(pg_dsn, f"kr_{unique}", types, staged,
                                                          cfg)]
    built = finished_records(cfg, types, staged)  # type: ignore[arg-type]
    assert built is not None
    got = [(r["topic"], r["partition"], r["offset"], r["key"], r["value"],
            None if r["headers"] is None else json.loads(r["headers"]), r["ts"])
           for r in built.to_pylist()]
    diffs = [(w, g) for w, g in zip(want, got, strict=True) if w != g]
    assert not diffs, diffs[:3]


# --- the sink path from task files (KafkaTopicSink.task_files_dir) on real services ------


def _ledger_id(dsn: str) -> str:
    from offsetflow.ledger import ledger_identity

    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            return ledger_identity(cur).installation_id
    finally:
        conn.close()


@pytest.fixture
def task_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The task files' directory, switched on for this test (driver and local executors
    share this machine)."""
    from offsetflow.sinks.kafka import KafkaTopicSink

    d = tmp_path / "task-files"
    d.mkdir()
    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", str(d))
    return d


def test_a_batch_from_task_files_is_produced_once_whatever_other_attempts_left(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path) -> None:
    """Files of other attempts of the batch's parts (a task killed after writing its file,
    before its marker committed; a zombie) lie beside the ones the markers name: the driver
    reads only those, the topic gets each record once, and the batch's files are gone
    after the commit."""
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka.taskfile import FILE_SCHEMA, PartFile
    from tests.tooling.kafka_case import make_case

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    others = []
    # another attempt's complete files (every record twice), and another ledger's batch of
    # the same id in the same directory (batch ids repeat across ledgers)
    for ledger in (_ledger_id(pg_dsn), "anotherledger"):
        for part in range(4):
            f = PartFile(str(task_dir), ledger, case.batch_id, part)
            n = 50
            f.write(pa.RecordBatch.from_pydict({
                "topic": [case.src] * n, "partition": [part % 2] * n,
                "offset": list(range(n)), "key": [b"zombie"] * n, "value": [b"{}"] * n,
                "headers": [None] * n, "ts": [None] * n}, schema=FILE_SCHEMA))
            others.append(Path(str(f.close()["path"])))
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v
    assert sorted(task_dir.iterdir()) == sorted(others[4:])  # the other ledger's stay


def test_a_task_file_lost_under_the_pipeline_fails_the_batch_clearly_and_the_rerun_restages(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part's file truncated after its marker committed, before the driver read it:
    the batch fails naming batch, part and file, nothing of it is visible to
    read_committed, the part is dropped with its marker; the next run writes it again and
    the topic gets each record once."""
    from offsetflow.errors import TaskFileLostError
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import taskfile
    from tests.tooling.kafka_case import make_case
    from tests.tooling.topic_checker import read_topic

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    real = taskfile.read_part_file
    damaged: list[str] = []

    def truncating(batch_id: int, part: int, entry: Any) -> Any:
        if not damaged:
            p = Path(str(entry["path"]))
            p.write_bytes(p.read_bytes()[:100])
            damaged.append(str(p))
        return real(batch_id, part, entry)

    monkeypatch.setattr(taskfile, "read_part_file", truncating)
    with pytest.raises(TaskFileLostError) as e:
        run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    msg = str(e.value)
    assert f"batch {case.batch_id}" in msg and damaged[0] in msg and "re-stages" in msg, msg
    assert read_topic(kafka_bootstrap, case.out) == []
    assert case.status() != "committed"
    monkeypatch.setattr(taskfile, "read_part_file", real)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v
    assert not list(task_dir.iterdir())


@pytest.fixture
def process_case(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
                 tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A batch of several parts per partition whose job, run as a process, writes task
    files (the switch through its environment)."""
    from tests.tooling.kafka_case import make_case

    monkeypatch.setenv("OFFSETFLOW_TEST_KAFKA_TASK_FILES", str(task_dir))
    return make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"max_offsets_per_task": 100})


def test_driver_killed_mid_overlap_from_task_files_the_retry_commits_once(
        spark: Any, process_case: Any, task_dir: Path) -> None:
    """The driver killed with parts of task files produced into its open transaction: the
    retry (its tasks find the parts' markers: no file written again) produces the batch
    once from the files the markers name."""
    from offsetflow.job import run_batch
    from tests.tooling import chaos
    from tests.tooling.kafka_case import killed_at_end
    from tests.tooling.topic_checker import read_topic

    case = process_case
    proc = case.start("pause_in_overlap")
    with killed_at_end(proc):
        case.wait_paused(proc)
        chaos.wait_for(lambda: len(read_topic(case.bootstrap, case.out,
                                              "read_uncommitted")) > 0,
                       60, "the first part's records in the log")
        assert read_topic(case.bootstrap, case.out, "read_committed") == []
        assert list(task_dir.glob(f"*_b{case.batch_id}_p*.arrow"))
        chaos.kill(proc)
    assert case.status() != "committed"
    assert run_batch(spark, case.cfg, case.batch_id, case.dsn).result.status == "committed"
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.aborted_in_log > 0
    assert not list(task_dir.glob(f"*_b{case.batch_id}_p*.arrow"))


def test_two_runs_of_a_task_file_batch_at_once_the_later_fences_the_earlier(
        spark: Any, process_case: Any) -> None:
    """The older run holds its transaction open mid-read, loses its ledger connection; a
    newer run commits the batch from the task files; the older, resumed, is fenced and
    commits nothing."""
    from offsetflow.job import run_batch
    from tests.tooling import chaos
    from tests.tooling.kafka_case import RECORDS, cut_idle_ledger_transactions, killed_at_end
    from tests.tooling.topic_checker import read_topic

    case = process_case
    older = case.start("pause_in_overlap")
    with killed_at_end(older):
        case.wait_paused(older)
        chaos.wait_for(lambda: len(read_topic(case.bootstrap, case.out,
                                              "read_uncommitted")) > 0,
                       60, "the older run's first part in the log")
        assert cut_idle_ledger_transactions(case.dsn) >= 1
        newer = run_batch(spark, case.cfg, case.batch_id, case.dsn)
        assert newer.result.status == "committed"
        case.resume()
        older.wait(timeout=300)
    out = case.output()
    assert "committed by another run while this one was working" in out, out[-3000:]
    assert case.status() == "committed"
    v = case.verdict()
    assert v.aborted_in_log > 0
    assert v.in_log - v.aborted_in_log == RECORDS


def test_a_record_postgresql_would_refuse_is_a_bad_record_with_task_files_too(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path) -> None:
    """A text field holding a NUL: PostgreSQL refuses it at the stage's COPY, so on the
    stage path the record is a bad record (a dead letter). From task files it must be one
    too, not a record with `\\u0000` in its value."""
    from confluent_kafka import Producer

    from offsetflow.job import run_batch
    from tests.tooling.kafka_case import make_case
    from tests.tooling.topic_checker import read_topic

    at: list[int] = []

    def nul_record(src: str) -> None:
        p = Producer({"bootstrap.servers": kafka_bootstrap})
        p.produce(src, b'{"event_id":"nul\\u0000here","seq":1,"amount":1.5,"checksum":"c"}',
                  partition=0, on_delivery=lambda err, msg: at.append(msg.offset()))
        assert p.flush(30) == 0

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path, dead_letter=True,
                     before_plan=nul_record)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert not [r for r in read_topic(kafka_bootstrap, case.out) if b"nul" in (r.value or b"")]
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT partition, \"offset\" FROM {}").format(
                sql.Identifier(f"{case.name}_dead")))
            assert (0, at[0]) in cur.fetchall()
    finally:
        conn.close()
    case.verdict()  # the workload's records: once each


_BIG = "x" * 30_000


def _too_large_case(pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
                    tmp_path: Path) -> tuple[Any, list[int]]:
    """A batch with one record over its output topic's max.message.bytes (partition 1 at
    the offset returned), dead letters on."""
    from confluent_kafka import Producer

    from tests.tooling.kafka_case import make_case

    at: list[int] = []

    def large_record(src: str) -> None:
        p = Producer({"bootstrap.servers": kafka_bootstrap})
        p.produce(src, json.dumps({"event_id": "big", "seq": 1, "amount": 1.5,
                                   "checksum": _BIG}).encode(),
                  partition=1, on_delivery=lambda err, msg: at.append(msg.offset()))
        assert p.flush(30) == 0

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path, dead_letter=True,
                     out_config={"max.message.bytes": "20000"}, before_plan=large_record)
    return case, at


def _check_too_large_dead_letter(case: Any, pg_dsn: str, kafka_bootstrap: str,
                                 at: list[int], task_dir: Path) -> None:
    from tests.tooling.topic_checker import read_topic

    assert not [r for r in read_topic(kafka_bootstrap, case.out) if r.key == b"big"]
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT partition, \"offset\", key, value, error FROM {}"
                                ).format(sql.Identifier(f"{case.name}_dead")))
            dead = {(p, o): (bytes(k), bytes(v), e) for p, o, k, v, e in cur.fetchall()}
    finally:
        conn.close()
    assert list(dead) == [(1, at[0])], dead
    key, value, error = dead[(1, at[0])]
    assert key == b"big" and _BIG.encode() in value, (key, value[:80])
    assert "max.message.bytes" in error, error
    assert not list(task_dir.iterdir())
    case.verdict()  # the workload's records: once each


def test_a_record_the_topic_refuses_from_task_files_is_a_dead_letter_the_rest_once(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path) -> None:
    """A record over the output topic's max.message.bytes, from task files: the sink reads
    its size (and the batch's timestamps) from the files as it would from the stage, leaves
    it out and routes it to the dead-letter table with its key and value read from its part's
    file; the rest is produced once and the batch's files are gone."""
    from offsetflow.job import run_batch

    case, at = _too_large_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    _check_too_large_dead_letter(case, pg_dsn, kafka_bootstrap, at, task_dir)


def test_many_records_the_topic_refuses_from_task_files_go_to_dead_letters_in_bounded_statements(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records the topic refuses, from task files: their dead letters go to PostgreSQL in
    statements bounded by `DEAD_LETTER_CHUNK_BYTES` (here 64 KB for six 30 KB records), not
    one literal of every left-out key and value (hundreds of MB of them would be refused
    after the Kafka commit, on every rerun: a wedge)."""
    from confluent_kafka import Producer

    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import limits
    from tests.tooling.kafka_case import make_case

    at: list[int] = []

    def large_records(src: str) -> None:
        p = Producer({"bootstrap.servers": kafka_bootstrap})
        for i in range(6):
            p.produce(src, json.dumps({"event_id": f"big{i}", "seq": i, "amount": 1.5,
                                       "checksum": _BIG}).encode(), key=b"big",
                      partition=1, on_delivery=lambda err, msg: at.append(msg.offset()))
        assert p.flush(30) == 0

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path, dead_letter=True,
                     out_config={"max.message.bytes": "20000"}, before_plan=large_records)
    sizes: list[int] = []
    real = limits.dead_letters_from

    def measured(cur: Any, batch: Any, table: str, source: Any, *a: Any) -> int:
        sizes.append(len(source.as_string(cur)))
        return real(cur, batch, table, source, *a)

    monkeypatch.setattr(limits, "DEAD_LETTER_CHUNK_BYTES", 64_000, raising=False)
    monkeypatch.setattr(limits, "dead_letters_from", measured)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert sizes and max(sizes) < 4 * 64_000, sizes
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT partition, \"offset\", value FROM {}"
                                ).format(sql.Identifier(f"{case.name}_dead")))
            dead = {(p, o): bytes(v) for p, o, v in cur.fetchall()}
    finally:
        conn.close()
    assert sorted(dead) == [(1, o) for o in sorted(at)], dead.keys()
    assert all(_BIG.encode() in v for v in dead.values())
    assert not list(task_dir.iterdir())
    case.verdict()


def test_killed_after_the_kafka_commit_the_rerun_routes_the_left_out_record_from_the_files(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job killed after its Kafka transaction committed, before the ledger's: the
    re-run finds the batch in the topic and routes the record it left out to the dead-letter
    table from the task files, which stay until the ledger commits (then dropped)."""
    from offsetflow.job import run_batch
    from tests.tooling.kafka_case import killed_at_end

    monkeypatch.setenv("OFFSETFLOW_TEST_KAFKA_TASK_FILES", str(task_dir))
    case, at = _too_large_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    proc = case.start("kill_after_commit")
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    assert case.status() != "committed"
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    _check_too_large_dead_letter(case, pg_dsn, kafka_bootstrap, at, task_dir)


def _fail_before_producing(spark: Any, case: Any, pg_dsn: str,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of the case's batch whose tasks write their files and whose driver fails before
    it reads any of them (the batch stays open, its files and markers in place)."""
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import taskfile

    def failing(batch_id: int, part: int, entry: Any, mapped: bool = False) -> Any:
        raise RuntimeError("injected: the driver fails before producing")

    with monkeypatch.context() as m:
        m.setattr(taskfile, "read_part_file", failing)
        with pytest.raises(RuntimeError, match="injected"):
            run_batch(spark, case.cfg, case.batch_id, pg_dsn)


def _two_pipelines_failed_before_producing(spark: Any, pg_dsn: str, kafka_bootstrap: str,
                                           make_topic: Any, unique: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """Two pipelines sharing the task files' directory, each with a batch whose tasks wrote
    their files and whose driver failed before producing anything (the batches open)."""
    from tests.tooling.kafka_case import make_case

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_case(pg_dsn, kafka_bootstrap, make_topic, f"{unique}a", tmp_path / "a")
    b = make_case(pg_dsn, kafka_bootstrap, make_topic, f"{unique}b", tmp_path / "b")
    for case in (a, b):
        _fail_before_producing(spark, case, pg_dsn, monkeypatch)
    return a, b


def test_two_pipelines_sharing_a_directory_abandon_drops_only_its_own_files(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pipelines write task files to one directory and fail before their commit (the
    files and markers stay): abandoning one drops its batch's files with its stage, never
    the other's; a part dropped for re-staging drops its attempts' files; the other's
    re-run produces from its own files, once, and leaves none."""
    from offsetflow.cli import main as cli
    from offsetflow.job import run_batch
    from offsetflow.stage import forget_parts

    a, b = _two_pipelines_failed_before_producing(spark, pg_dsn, kafka_bootstrap, make_topic,
                                                  unique, tmp_path, monkeypatch)

    def files(batch_id: int) -> list[Path]:
        return sorted(task_dir.glob(f"*_b{batch_id}_p*"))

    a_files, b_files = files(a.batch_id), files(b.batch_id)
    assert a_files and b_files
    assert cli(["--dsn", pg_dsn, "abandon", "--pipeline-file", str(a.file),
                "--batch-id", str(a.batch_id), "--reason", "test"]) == 0
    assert files(a.batch_id) == [] and files(b.batch_id) == b_files
    # a part of b dropped for re-staging (a refused commit's way): its file goes with it
    part = int(b_files[0].name.split("_p")[1].split("_")[0])
    forget_parts(pg_dsn, b.batch_id, [part])
    assert [f for f in files(b.batch_id) if f"_p{part}_" in f.name] == []
    assert len(files(b.batch_id)) == len(b_files) - 1
    rep = run_batch(spark, b.cfg, b.batch_id, pg_dsn)  # re-stages that part, the rest read
    assert rep.result.status == "committed", rep.result
    v = b.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v
    assert list(task_dir.iterdir()) == []


def test_a_ledger_transaction_dropping_the_stage_that_rolls_back_leaves_the_task_files(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's files stay until the ledger transaction that drops their markers commits:
    an abandon (planning's, the commit's stage drop, a config change: `drop_staging`) that
    rolls back leaves markers and files as they were, so the re-run produces from them, once,
    and leaves none."""
    from offsetflow.job import run_batch
    from offsetflow.ledger import Ledger
    from tests.tooling.kafka_case import make_case

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    _fail_before_producing(spark, case, pg_dsn, monkeypatch)
    before = sorted(task_dir.iterdir())
    assert before
    with (Ledger(pg_dsn) as ledger, pytest.raises(RuntimeError, match="rolled back"),
          ledger.transaction() as cur):
        ledger.abandon(case.batch_id, "test", cur)
        raise RuntimeError("rolled back")
    assert sorted(task_dir.iterdir()) == before
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    case.verdict()
    assert not list(task_dir.iterdir())


def test_cleanup_sweeps_the_task_files_no_open_batch_can_read(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files no marker names (a killed task's attempt, a temporary file) of a batch that is
    no longer open stay after its abandon (abandon drops only the named ones): `offsetflow
    cleanup --task-files DIR` removes them, and never an open batch's files (another
    pipeline's batch in the same directory, produced from them afterwards, once)."""
    from offsetflow.cli import main as cli
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import taskfile

    a, b = _two_pipelines_failed_before_producing(spark, pg_dsn, kafka_bootstrap, make_topic,
                                                  unique, tmp_path, monkeypatch)
    ledger = _ledger_id(pg_dsn)
    killed = [task_dir / taskfile.file_name(ledger, c.batch_id, 7, "0badc0de0000")
              for c in (a, b)]
    for f in killed:  # a killed attempt's temporary file: no marker names it
        Path(f"{f}.tmp").write_bytes(b"partial")
    b_files = sorted(task_dir.glob(f"*_b{b.batch_id}_*"))
    assert cli(["--dsn", pg_dsn, "abandon", "--pipeline-file", str(a.file),
                "--batch-id", str(a.batch_id), "--reason", "test"]) == 0
    assert [f.name for f in task_dir.glob(f"*_b{a.batch_id}_*")] == [f"{killed[0].name}.tmp"]
    assert cli(["--dsn", pg_dsn, "cleanup", "--task-files", str(task_dir)]) == 0
    assert not list(task_dir.glob(f"*_b{a.batch_id}_*"))
    assert sorted(task_dir.glob(f"*_b{b.batch_id}_*")) == b_files
    rep = run_batch(spark, b.cfg, b.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    b.verdict()
    assert list(task_dir.iterdir()) == []


def test_task_files_are_not_readable_by_other_users_of_the_host(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A task file holds the batch's records: owner read/write, its group read (a cluster's
    driver and executors may share a group), nothing for other users whatever the umask."""
    import os
    import stat

    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import taskfile
    from tests.tooling.kafka_case import make_case

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)

    def failing(batch_id: int, part: int, entry: Any) -> Any:
        raise RuntimeError("injected: the driver fails before producing")

    monkeypatch.setattr(taskfile, "read_part_file", failing)
    old = os.umask(0o002)  # the local executors inherit it: a permissive one
    try:
        with pytest.raises(RuntimeError, match="injected"):
            run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in task_dir.iterdir()}
    assert modes and all(m & 0o027 == 0 for m in modes.values()), \
        {n: oct(m) for n, m in modes.items()}


def test_a_timestamp_the_topic_refuses_from_task_files_is_a_dead_letter_the_rest_once(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path) -> None:
    """A source record from 1970 for an output topic that refuses timestamps older than an
    hour: the pass after the read takes the batch's timestamps from the task files (as from
    the stage) and leaves it out before producing, a dead letter; the rest once."""
    from confluent_kafka import Producer

    from offsetflow.job import run_batch
    from tests.tooling.kafka_case import make_case
    from tests.tooling.topic_checker import read_topic

    at: list[int] = []

    def old_record(src: str) -> None:
        p = Producer({"bootstrap.servers": kafka_bootstrap})
        p.produce(src, b'{"event_id":"old","seq":1,"amount":1.5,"checksum":"c"}',
                  partition=0, timestamp=1_000,
                  on_delivery=lambda err, msg: at.append(msg.offset()))
        assert p.flush(30) == 0

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path, dead_letter=True,
                     out_config={"message.timestamp.before.max.ms": "3600000"},
                     before_plan=old_record)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert not [r for r in read_topic(kafka_bootstrap, case.out) if r.key == b"old"]
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT partition, \"offset\", key, error FROM {}").format(
                sql.Identifier(f"{case.name}_dead")))
            dead = {(p, o): (bytes(k), e) for p, o, k, e in cur.fetchall()}
    finally:
        conn.close()
    assert list(dead) == [(0, at[0])], dead
    assert dead[(0, at[0])][0] == b"old" and "timestamp" in dead[(0, at[0])][1], dead
    assert not list(task_dir.iterdir())
    case.verdict()


def test_the_sink_task_files_setting_switches_the_batch_to_task_files(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sink.task_files` alone (no class switch): the batch is produced from task files in
    that directory, once, and none is left."""
    import dataclasses

    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", None)
    d = tmp_path / "setting"
    d.mkdir()
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    kafka = case.cfg.sink.kafka
    assert kafka is not None
    cfg = dataclasses.replace(case.cfg, sink=dataclasses.replace(
        case.cfg.sink, kafka=dataclasses.replace(kafka, task_files=str(d))))
    read = task_file_reads(monkeypatch)
    rep = run_batch(spark, cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert read and all(p.startswith(str(d)) for _, p in read), read
    v = case.verdict()
    assert v.visible == v.committed.found, v
    assert not list(d.iterdir())


def test_a_task_files_directory_missing_where_the_config_loads_fails_only_the_run(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sink.task_files` naming a directory this host lacks (a DAG processor or an
    operator's CLI host without the executors' mount): the config loads (only an absolute
    path is checked then); the run fails before the read naming the setting, nothing
    visible; once the directory is there the batch commits once from files."""
    import yaml

    from offsetflow.config import parse_pipeline
    from offsetflow.errors import KafkaSinkError
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from tests.tooling.kafka_case import make_case
    from tests.tooling.topic_checker import read_topic

    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", None)
    d = tmp_path / "mount" / "task-files"
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    path = tmp_path / f"{case.name}.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["sink"]["task_files"] = str(d)
    cfg = parse_pipeline(raw, str(path), {})
    with pytest.raises(KafkaSinkError, match="sink.task_files") as e:
        run_batch(spark, cfg, case.batch_id, pg_dsn)
    assert str(d) in str(e.value), e.value
    assert not read_topic(kafka_bootstrap, case.out)
    d.mkdir(parents=True)
    rep = run_batch(spark, cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    case.verdict()
    assert not list(d.iterdir())


def test_complete_of_a_task_file_batch_whose_stage_and_records_are_gone(
        spark: Any, process_case: Any, task_dir: Path) -> None:
    """`offsetflow complete` of a batch produced from task files: killed after the Kafka
    commit, PostgreSQL crashed (the markers naming the files are gone), the source records
    deleted: complete takes the counts from the commit's record (no record read), and the
    batch's files go with its stage."""
    from offsetflow.cli import main as cli
    from offsetflow.job import run_batch
    from tests.tooling import chaos
    from tests.tooling.kafka_case import RECORDS, delete_batch_records, killed_at_end

    case = process_case
    proc = case.start("kill_after_commit")
    with killed_at_end(proc):
        assert proc.wait(timeout=600) == -9, case.output()[-3000:]
    assert list(task_dir.glob(f"*_b{case.batch_id}_p*.arrow"))
    chaos.crash_postgres()  # empties the unlogged stage and its markers
    delete_batch_records(case.bootstrap, case.dsn, case.batch_id)
    with pytest.raises(Exception, match=r"data loss on "):
        run_batch(spark, case.cfg, case.batch_id, case.dsn)
    assert cli(["--dsn", case.dsn, "complete", "--pipeline-file", str(case.file),
                "--batch-id", str(case.batch_id), "--reason", "gone"]) == 0
    assert case.status() == "committed"
    assert case.verdict().in_log == RECORDS  # nothing produced a second time
    assert not list(task_dir.iterdir())


def test_the_setting_turned_on_for_a_partly_staged_batch_converges(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch partly staged in PostgreSQL with `sink.task_files` off (a run that failed
    mid-read), run again with it on: its later parts go to task files, its earlier ones
    are in the stage. Read part by part (the overlap) each part comes from where it is; read
    whole, the run refuses the mix as lost parts (a `StagedRowsLostError`
    naming the stage parts and the setting): those parts are dropped with their markers,
    the next run writes them to task files and the topic gets each record once."""
    from offsetflow.errors import StagedRowsLostError
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from offsetflow.stage.reset import forget_parts
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", None)
    d = tmp_path / "turned-on"
    d.mkdir()
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"max_offsets_per_task": 100})

    class _Stop(Exception):
        pass

    def failing(*_a: Any, **_k: Any) -> Any:
        raise _Stop("the run fails before producing")

    with monkeypatch.context() as m:  # setting off: every part staged, nothing produced
        m.setattr(KafkaTopicSink, "begin_parts", failing)
        m.setattr(KafkaTopicSink, "write", failing)
        with pytest.raises(_Stop):
            run_batch(spark, with_task_files(case.cfg, "off"), case.batch_id, pg_dsn)
    with contextlib.closing(psycopg2.connect(pg_dsn)) as conn, conn.cursor() as cur:
        cur.execute("SELECT array_agg(part ORDER BY part) FROM offsetflow.staged_parts "
                    "WHERE batch_id = %s AND kind = 'rows'", (case.batch_id,))
        parts = list((cur.fetchone() or [[]])[0] or [])
    assert len(parts) >= 2, parts
    # a run killed mid-read: only the first half of the parts staged
    forget_parts(pg_dsn, case.batch_id, parts[len(parts) // 2:], None)
    cfg = with_task_files(case.cfg, d)
    # the batch read whole (as after an overlap given up, or a failed pass): not per part
    monkeypatch.setattr(KafkaTopicSink, "overlap", False)
    with pytest.raises(StagedRowsLostError) as e:
        run_batch(spark, cfg, case.batch_id, pg_dsn)
    msg = str(e.value)
    assert "sink.task_files" in msg and str(parts[:len(parts) // 2]) in msg, msg
    rep = run_batch(spark, cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v
    assert not list(d.iterdir())


def test_a_batch_the_setting_stages_in_postgresql_has_its_stage_counted(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sink.task_files` set, but the batch staged in PostgreSQL (a column of a type the
    tasks do not build): the commit counts the stage against its markers, as without the
    setting, so a row lost from the stage is refused by partition before any Kafka
    transaction (not found only by the produce pass's total, after the whole stage was
    produced and its transaction aborted)."""
    from offsetflow.commit.protocol import WholeStage
    from offsetflow.errors import StagedRowsLostError
    from offsetflow.job import run_batch
    from offsetflow.ledger import stage_part_table
    from offsetflow.sinks.kafka import KafkaTopicSink
    from offsetflow.sinks.kafka import pipeline as kafka_pipeline
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "task_files_dir", None)
    monkeypatch.setattr(KafkaTopicSink, "overlap", False)  # the stage read after the tasks
    monkeypatch.setattr(kafka_pipeline, "BUILT_TYPES", frozenset())  # none built: the stage
    d = tmp_path / "fallback"
    d.mkdir()
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    real = WholeStage.before_checks

    def losing_a_row(self: Any, cur: Any, batch: Any) -> None:
        with contextlib.closing(psycopg2.connect(pg_dsn)) as conn, conn, conn.cursor() as c:
            c.execute(sql.SQL("DELETE FROM {} WHERE ctid IN (SELECT ctid FROM {} LIMIT 1)")
                      .format(stage_part_table(batch.batch_id, 0),
                              stage_part_table(batch.batch_id, 0)))
            assert c.rowcount == 1
        real(self, cur, batch)

    monkeypatch.setattr(WholeStage, "before_checks", losing_a_row)
    with pytest.raises(StagedRowsLostError) as e:
        run_batch(spark, with_task_files(case.cfg, d), case.batch_id, pg_dsn)
    assert f"rows of {case.src}/" in str(e.value), str(e.value)
    assert not list(d.iterdir())


def test_task_files_lost_of_several_parts_are_named_at_once_with_the_way_out(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two parts' files gone before the driver reads (a directory wiped, or one the driver
    does not share with the executors): one run names both parts and `sink.task_files`
    with the way out, drops both, and the next run commits (not one run per lost part)."""
    from offsetflow.commit.protocol import WholeStage
    from offsetflow.errors import TaskFileLostError
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "overlap", False)  # the files read after the tasks
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"max_offsets_per_task": 100})
    real = WholeStage.before_checks
    gone: list[Path] = []

    def wiping(self: Any, cur: Any, batch: Any) -> None:
        if not gone:
            gone.extend(sorted(task_dir.glob(f"*_b{batch.batch_id}_p*.arrow"))[:2])
            for f in gone:
                f.unlink()
        real(self, cur, batch)

    monkeypatch.setattr(WholeStage, "before_checks", wiping)
    with pytest.raises(TaskFileLostError) as e:
        run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    msg = str(e.value)
    assert len(gone) == 2 and all(str(f) in msg for f in gone), msg
    assert "sink.task_files" in msg, msg
    monkeypatch.setattr(WholeStage, "before_checks", real)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    v = case.verdict()
    assert v.visible == v.committed.found, v
    assert not list(task_dir.iterdir())


def test_a_batch_read_sorted_from_task_files_is_produced_once(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sorted read from files (as after `_OutOfOrder`, or a layout no unsorted read
    follows): the parts' records sorted by key and taken a chunk at a time from their
    record batches (the memory and allocation bounds, with many record batches a part:
    tests/unit/sinks/kafka/test_sink_kafka_sorted_files.py), the topic gets each record
    once."""
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from offsetflow.sinks.kafka.sink import FileParts
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "overlap", False)
    monkeypatch.setattr(KafkaTopicSink, "read_parts", False)  # always the sorted read
    merged: list[int] = []
    real = FileParts._sorted_chunks

    def spy(self: Any) -> Any:
        merged.extend(p for p, _r in self.parts)
        return real(self)

    monkeypatch.setattr(FileParts, "_sorted_chunks", spy)
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path,
                     spark={"max_offsets_per_task": 100})
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert len(merged) >= 2, merged
    v = case.verdict()
    assert v.visible == v.committed.found, v


def test_a_paused_drop_unlinks_only_the_files_its_markers_named_not_a_newer_runs(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run dropping a refused part (`forget_parts`) is paused between its ledger COMMIT
    and the unlink (a GC pause, SIGSTOP, a VM stall): a newer run takes the batch, writes
    that part's file again under a new attempt and reads it. The paused drop, resumed,
    unlinks only the file its deleted marker named, never the newer attempt's, so the newer
    run commits once (no TaskFileLostError)."""
    import threading

    from offsetflow.commit.protocol import WholeStage
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import KafkaTopicSink
    from offsetflow.stage import reset
    from tests.tooling import chaos
    from tests.tooling.kafka_case import make_case

    monkeypatch.setattr(KafkaTopicSink, "overlap", False)  # the files read after the tasks
    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)
    _fail_before_producing(spark, case, pg_dsn, monkeypatch)
    first = sorted(task_dir.glob(f"*_b{case.batch_id}_p0_*.arrow"))
    assert len(first) == 1, first

    committed, resume = threading.Event(), threading.Event()
    real_drop = reset.drop_committed_task_files

    def paused_drop(conn: Any) -> int:
        committed.set()  # the markers' deletion committed: paused before the unlink
        assert resume.wait(120)
        return real_drop(conn)

    monkeypatch.setattr(reset, "drop_committed_task_files", paused_drop)
    dropper = threading.Thread(target=reset.forget_parts, args=(pg_dsn, case.batch_id, [0]))
    dropper.start()
    try:
        chaos.wait_for(committed.is_set, 60, "the drop's ledger COMMIT")
        monkeypatch.setattr(reset, "drop_committed_task_files", real_drop)
        real_checks = WholeStage.before_checks
        newer: list[Path] = []

        def resumed_drop(self: Any, cur: Any, batch: Any) -> None:
            # the newer run re-staged part 0 under a new attempt: the old drop resumes now
            newer.extend(f for f in task_dir.glob(f"*_b{batch.batch_id}_p0_*.arrow")
                         if f not in first)
            resume.set()
            dropper.join(60)
            real_checks(self, cur, batch)

        monkeypatch.setattr(WholeStage, "before_checks", resumed_drop)
        rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    finally:
        resume.set()
        dropper.join(60)
    assert len(newer) == 1, newer
    assert rep.result.status == "committed", rep.result
    v = case.verdict()  # read_committed: 0 lost, 0 duplicated, the one batch
    assert v.visible == v.committed.found, v
    assert not list(task_dir.iterdir())


def test_task_files_the_driver_may_not_read_fail_the_run_clearly_and_are_kept(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver runs as a user the files' mode does not let read (executors as one uid,
    the driver as another without a shared group): the run fails with a
    `TaskFileAccessError` naming the file, its mode and the way out, nothing visible, and
    the parts are NOT dropped (re-staged they would be unreadable again, every run). Once
    the driver may read them, the next run produces the same files once.

    The test runs as root, whom no mode stops: the driver's reads of task files (the
    module's `open`, its one way to read them) raise PermissionError as for another user
    (the real EACCES as another uid: tests/unit/sinks/kafka/test_sink_kafka_taskfile.py)."""
    import builtins
    import errno

    from offsetflow.errors import TaskFileAccessError
    from offsetflow.job import run_batch
    from offsetflow.sinks.kafka import taskfile
    from tests.tooling.kafka_case import make_case
    from tests.tooling.topic_checker import read_topic

    case = make_case(pg_dsn, kafka_bootstrap, make_topic, unique, tmp_path)

    def denied(file: Any, *a: Any, **k: Any) -> Any:
        if str(file).startswith(str(task_dir)):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return builtins.open(file, *a, **k)

    monkeypatch.setattr(taskfile, "open", denied, raising=False)
    with pytest.raises(TaskFileAccessError) as e:
        run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    msg = str(e.value)
    assert str(task_dir) in msg and "sink.task_files_mode" in msg, msg
    assert read_topic(kafka_bootstrap, case.out) == []
    kept = sorted(task_dir.glob(f"*_b{case.batch_id}_p*.arrow"))
    assert kept
    monkeypatch.setattr(taskfile, "open", builtins.open)
    read = task_file_reads(monkeypatch)
    rep = run_batch(spark, case.cfg, case.batch_id, pg_dsn)
    assert rep.result.status == "committed", rep.result
    assert sorted({p for _, p in read}) == [str(f) for f in kept]  # the same files, not re-staged
    v = case.verdict()
    assert v.visible == v.committed.found, v
    assert not list(task_dir.iterdir())


def test_files_left_by_a_drop_lost_after_the_commit_are_swept_by_the_next_run(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path, task_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The driver dies between the ledger's COMMIT and the unlink of the batch's files (or
    the COMMIT's outcome is lost, and its pending drops with it): the files stay though no
    marker names them. The next run with task files (any batch of the ledger) removes
    every file of this ledger's batches that are committed or abandoned, and nothing of a
    batch still open (another pipeline's failed run, whose rerun reads its own files)."""
    import logging

    from offsetflow.job import run_batch
    from offsetflow.ledger import store
    from offsetflow.sinks.kafka import KafkaPipelineSink, taskfile
    from tests.tooling.kafka_case import make_case

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_case(pg_dsn, kafka_bootstrap, make_topic, f"{unique}a", tmp_path / "a")
    b = make_case(pg_dsn, kafka_bootstrap, make_topic, f"{unique}b", tmp_path / "b")
    real_read = taskfile.read_part_file

    def failing(batch_id: int, part: int, entry: Any) -> Any:
        raise RuntimeError("injected: the driver fails before producing")

    with monkeypatch.context() as m:  # a: failed, open, its files and markers kept
        m.setattr(taskfile, "read_part_file", failing)
        with pytest.raises(RuntimeError, match="injected"):
            run_batch(spark, a.cfg, a.batch_id, pg_dsn)
    a_files = sorted(task_dir.glob(f"*_b{a.batch_id}_*"))
    assert a_files
    with monkeypatch.context() as m:  # b: committed, its unlinks lost with the driver
        m.setattr(store, "drop_committed_task_files", lambda conn: 0)
        m.setattr(KafkaPipelineSink, "after_commit", lambda *_a, **_k: None)
        rep = run_batch(spark, b.cfg, b.batch_id, pg_dsn)
        assert rep.result.status == "committed", rep.result
    assert taskfile.read_part_file is real_read
    b_left = sorted(task_dir.glob(f"*_b{b.batch_id}_*"))
    assert b_left  # what a driver killed right after the COMMIT leaves
    read = task_file_reads(monkeypatch)
    with caplog.at_level(logging.INFO):
        rep = run_batch(spark, a.cfg, a.batch_id, pg_dsn)  # the next run: a's rerun
    assert rep.result.status == "committed", rep.result
    assert not list(task_dir.glob(f"*_b{b.batch_id}_*"))
    assert sorted({p for _, p in read}) == [str(f) for f in a_files if f.suffix == ".arrow"]
    assert f"{len(b_left)} task file(s) of committed or abandoned batches" in caplog.text, \
        caplog.text[-2000:]
    a.verdict()
    b.verdict()
    assert list(task_dir.iterdir()) == []


def test_the_sweep_refuses_where_another_ledger_shares_the_identity(
        pg_dsn: str, tmp_path: Path, capsys: Any) -> None:
    """A copy of the ledger given its identity (`db adopt-identity` while the original
    still runs) sharing the task-file directory: its files carry the same installation id,
    and its open batches may be closed here. Seen cheaply where a file names a batch id
    this ledger never had (batches are never deleted): `offsetflow cleanup --task-files`
    and the driver's sweep remove nothing and say why, with the way out."""
    from offsetflow.cli import main as cli
    from offsetflow.sinks.kafka.pipeline import sweep_closed
    from offsetflow.sinks.kafka.taskfile import file_name

    d = tmp_path / "shared"
    d.mkdir()
    with contextlib.closing(psycopg2.connect(pg_dsn)) as conn, conn.cursor() as cur:
        cur.execute("SELECT coalesce(max(batch_id), 0) FROM offsetflow.batches")
        ahead = int((cur.fetchone() or [0])[0]) + 1000
    foreign = d / file_name(_ledger_id(pg_dsn), ahead, 0, "c10nec10ne00")
    foreign.write_bytes(b"the copy's open batch")
    assert cli(["--dsn", pg_dsn, "cleanup", "--task-files", str(d)]) == 2
    err = capsys.readouterr().err
    assert str(ahead) in err and "new-identity" in err and "no task file" in err, err
    assert foreign.exists()
    assert sweep_closed(pg_dsn, str(d), 0) == 0
    assert foreign.exists()
