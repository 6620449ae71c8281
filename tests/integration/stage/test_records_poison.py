"""Poison pills on real Kafka, PostgreSQL and Spark: records that cannot be written must
become dead letters with their coordinates and a reason (or, under `bad_records: fail`, fail
the batch naming the first one), and never stop the pipeline.

Two layers: the deserializer's per-record checks (the fused path; JSON values pyarrow or
Python accept but PostgreSQL or the declared type cannot hold), and staging's safety net
(a COPY PostgreSQL refuses is bisected to the refused rows), shown through a transform that
produces values PostgreSQL refuses and through a chunk staged directly.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from offsetflow.commit import create_stage_tables
from offsetflow.config import parse_pipeline
from offsetflow.errors import BadRecordError
from offsetflow.job import run_batch
from offsetflow.job.tasks import stage_columns
from offsetflow.ledger import Ledger, stage_part_table
from offsetflow.ops import plan_only
from offsetflow.source import arrow_schema
from offsetflow.source.chunk import HEADER_TYPE
from tests.tooling.pipeline_data import query

SCHEMA = {"event_id": "string", "seq": "long", "small": "int", "ratio": "float",
          "price": "decimal(6,2)", "at": "timestamp", "note": "string"}
# a CreateTime the broker accepts once the topic allows future timestamps, but no
# microsecond timestamp can hold
FAR_FUTURE_MS = 2**62
FAR_US = 600_000_000_000_000_000  # microseconds: year ~20,983
DEEP = "[" * 50_000 + "]" * 50_000

# (event id, value, Kafka timestamp or None, what the dead letter's reason must name);
# reason None: the record is good
POISON: list[tuple[str, bytes, int | None, str | None]] = [
    ("nul", b'{"event_id":"nul","seq":1,"note":"a\\u0000b"}', None, "NUL"),
    ("surrogate", b'{"event_id":"surrogate","seq":2,"note":"\\ud800"}', None, "surrogate"),
    ("precision", b'{"event_id":"precision","seq":3,"price":123456.78}', None,
     "decimal(6,2)"),
    ("float", b'{"event_id":"float","seq":4,"ratio":1e39}', None, "overflows float"),
    ("long", b'{"event_id":"long","seq":9223372036854775808}', None, "does not fit in long"),
    ("int", b'{"event_id":"int","seq":5,"small":2147483648}', None, "does not fit in int"),
    ("utf8", b'{"event_id":"utf8","seq":6,"note":"\xff\xfe"}', None, "UTF-8"),
    ("nan", b'{"event_id":"nan","seq":7,"ratio":NaN}', None, "NaN"),
    ("ts", b'{"event_id":"ts","seq":8}', FAR_FUTURE_MS, "timestamp"),
    ("deep", ('{"event_id":"deep","seq":9,"nested":' + DEEP + "}").encode(), None, None),
    ("rounded", b'{"event_id":"rounded","seq":10,"price":"1.005"}', None, None),
]
PILLS = {eid: why for eid, _, _, why in POISON if why is not None}


def _produce(bootstrap: str, topic: str, partitions: int, good: int) -> None:
    """Good records g-0.. with the poison pills spread among them, in both partitions;
    every record's key is its event id."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                  "message.max.bytes": 2_000_000})
    pills = list(POISON)
    for i in range(good):
        part = i % partitions
        rec = {"event_id": f"g-{i}", "seq": i, "small": i, "ratio": i / 2,
               "price": f"{i}.25", "at": "2026-11-23T10:00:00Z", "note": f"n{i}"}
        p.produce(topic, json.dumps(rec).encode(), key=f"g-{i}".encode(), partition=part)
        if i % 5 == 2 and pills:
            eid, value, ts, _ = pills.pop(0)
            kw: dict[str, Any] = {"timestamp": ts} if ts is not None else {}
            p.produce(topic, value, key=eid.encode(), partition=part, **kw)
            p.flush(30)  # one per produce request: a refused one must not take others
    assert not pills
    assert p.flush(30) == 0


def _config(topic: str, dsn: str, bootstrap: str, table: str, policy: str,
            transform: str | None = None, schema: dict[str, str] | None = None) -> Any:
    raw: dict[str, Any] = {
        "name": table, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "starting": "earliest"},
        "format": {"type": "json", "schema": dict(schema or SCHEMA)},
        "sink": {"connection": dsn, "table": table},
        "bad_records": policy, "dead_letter_table": f"dl_{table}",
        "spark": {"master": "local[2]", "max_offsets_per_task": 40}}
    if transform:
        raw["transform"] = transform
    return parse_pipeline(raw, f"<test {table}>", {})


def _offsets(bootstrap: str, topic: str) -> dict[str, tuple[int, int]]:
    """event id -> (partition, offset), from the values as Kafka holds them."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "x", "enable.auto.commit": False})
    out: dict[str, tuple[int, int]] = {}
    try:
        for part in (0, 1):
            c.assign([TopicPartition(topic, part, 0)])
            while True:
                msgs = c.consume(500, timeout=3)
                if not msgs:
                    break
                for m in msgs:
                    if m.error() is None:
                        out[m.key().decode()] = (part, m.offset())
    finally:
        c.close()
    return out


@pytest.fixture
def poisoned(kafka_bootstrap: str, make_topic: Any) -> tuple[str, dict[str, tuple[int, int]]]:
    topic = make_topic("poison", 2, config={"message.timestamp.after.max.ms":
                                            str(2**63 - 1)})
    _produce(kafka_bootstrap, topic, 2, 80)
    return topic, _offsets(kafka_bootstrap, topic)


def test_poison_pills_become_dead_letters_and_the_batch_commits(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, poisoned: Any, unique: str) -> None:
    topic, coords = poisoned
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"poison_{unique}", "dead_letter")
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert report.result.status == "committed", report.result

    rows = query(pg_dsn, f"SELECT event_id, count(*) FROM {cfg.sink.table} GROUP BY 1")
    landed = dict(rows)
    expected_good = {f"g-{i}" for i in range(80)} | {"deep", "rounded"}
    assert set(landed) == expected_good and set(landed.values()) == {1}
    assert query(pg_dsn, f"SELECT price FROM {cfg.sink.table} WHERE event_id = 'rounded'"
                 )[0][0] == Decimal("1.01")  # rounded half away from zero, as numeric does

    dead = {(p, o): err for p, o, err in query(
        pg_dsn, f'SELECT partition, "offset", error FROM {cfg.dead_letter_table} '
                f"WHERE topic = %s", (topic,))}
    assert len(dead) == len(PILLS), dead
    for eid, why in PILLS.items():
        assert why in dead[coords[eid]], (eid, dead[coords[eid]])
    # the raw value is kept byte for byte, so the record can be replayed once fixed
    assert bytes(query(pg_dsn, f'SELECT value FROM {cfg.dead_letter_table} WHERE partition '
                               f'= %s AND "offset" = %s', coords["utf8"])[0][0]) == POISON[6][1]
    assert report.result.rows_written == len(expected_good)
    assert report.result.bad_records == len(PILLS)


def test_poison_pill_under_fail_policy_fails_naming_it(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, poisoned: Any, unique: str) -> None:
    topic, coords = poisoned
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"poisonf_{unique}", "fail")
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    with pytest.raises(BadRecordError) as e:
        run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    msg = str(e.value)
    first = min(coords[eid] for eid in PILLS)
    assert f"{topic}[{first[0]}]@{first[1]}" in msg
    assert "more bad records" in msg
    assert query(pg_dsn, "SELECT to_regclass(%s)", (cfg.sink.table,))[0][0] is None or \
        query(pg_dsn, f"SELECT count(*) FROM {cfg.sink.table}")[0][0] == 0
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(planned.batch.batch_id).status == "failed"


def nul_transform(df: DataFrame) -> DataFrame:
    """A transform whose output PostgreSQL refuses for some rows (NUL in text)."""
    return df.withColumn("note", F.when(F.col("seq") % 10 == 3,
                                        F.concat(F.col("note"), F.lit("\u0000")))
                         .otherwise(F.col("note")))


def test_rows_postgresql_refuses_at_staging_become_dead_letters(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The safety net on the DataFrame path: staging bisects the refused COPY."""
    topic = make_topic("refused", 2)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for i in range(100):
        p.produce(topic, json.dumps({"event_id": f"e-{i}", "seq": i, "note": "x"}).encode(),
                  partition=i % 2)
    assert p.flush(30) == 0
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"refused_{unique}", "dead_letter",
                  transform="tests.integration.stage.test_records_poison.nul_transform")
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert report.result.status == "committed", report.result
    seqs = [r[0] for r in query(pg_dsn, f"SELECT seq FROM {cfg.sink.table} ORDER BY seq")]
    assert seqs == [i for i in range(100) if i % 10 != 3]
    dead = query(pg_dsn, f'SELECT partition, "offset", value, error, stage FROM '
                         f"{cfg.dead_letter_table} ORDER BY partition, \"offset\"")
    assert len(dead) == 10
    for part, off, value, err, stage in dead:
        seq = json.loads(bytes(value))["seq"]
        assert seq % 10 == 3 and part == seq % 2 and off == seq // 2
        assert "0x00" in err and "column note" in err and stage == "stage"


def test_staging_bisects_a_refused_binary_copy_and_keeps_the_marker_with_the_rows(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """The safety net on the fused path's binary COPY, driven directly: a chunk holding
    values no deserializer check caught is staged minus the refused rows, which are
    recorded in the same transaction as the part's marker."""
    from offsetflow.stage import BadRows, binary_encoder, stage_rows

    topic = make_topic("bisect", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(10):
        p.produce(topic, json.dumps({"event_id": f"e-{i}", "seq": i}).encode(), partition=0)
    assert p.flush(30) == 0
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"bisect_{unique}", "dead_letter")
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    batch_id = planned.batch.batch_id
    columns = stage_columns(cfg)
    create_stage_tables(pg_dsn, batch_id, columns, parts=1)
    names = [c for c, _ in columns]
    n = 1000
    bad_at = {3, 4, 500, 999}
    typed = arrow_schema(SCHEMA)
    cols: dict[str, pa.Array] = {
        "topic": pa.array([topic] * n), "partition": pa.array([0] * n, pa.int32()),
        "offset": pa.array(range(n), pa.int64()),
        # past Python's datetime (year 9999) but within PostgreSQL's range
        "timestamp": pa.array([FAR_US if i % 2 else 0 for i in range(n)], pa.int64())
        .cast(pa.timestamp("us", tz="UTC")),
        "timestamp_type": pa.array([1] * n, pa.int32()),
        "key": pa.nulls(n, pa.binary()),
        "value": pa.array([f"v{i}".encode() for i in range(n)], pa.binary()),
        "headers": pa.nulls(n, HEADER_TYPE),
        "note": pa.array([f"bad\x00{i}" if i in bad_at else f"ok{i}" for i in range(n)]),
    }
    arrays = [cols[c] if c in cols else pa.nulls(n, typed.field(c).type) for c in names]
    batch = pa.RecordBatch.from_arrays(arrays, names=names)
    stats = stage_rows(pg_dsn, batch_id, 0, [batch.slice(0, 600), batch.slice(600)],
                       encode=binary_encoder([t for _, t in columns]),
                       table=stage_part_table(batch_id, 0),
                       bad=BadRows(cfg.name, write_rows=True))
    assert stats["rows"] == n - len(bad_at) and stats["bad"] == len(bad_at)
    staged = query(pg_dsn, f"SELECT \"offset\" FROM offsetflow_stage.b{batch_id}_p0 "
                           f"ORDER BY 1")
    assert [r[0] for r in staged] == [i for i in range(n) if i not in bad_at]
    dead = query(pg_dsn, f"SELECT \"offset\", value, error, (extract(epoch FROM timestamp) * "
                         f"1e6)::bigint FROM offsetflow_stage.b{batch_id}_dead ORDER BY 1")
    assert [r[0] for r in dead] == sorted(bad_at)
    assert all(bytes(v) == f"v{o}".encode() and "column note" in e for o, v, e, _ in dead)
    assert [ts for *_, ts in dead] == [FAR_US if o % 2 else 0 for o in sorted(bad_at)]
    markers = query(pg_dsn, "SELECT kind, rows_staged, bad_records FROM "
                            "offsetflow.staged_parts WHERE batch_id = %s ORDER BY kind",
                    (batch_id,))
    assert markers == [("bad", 0, len(bad_at)), ("rows", n - len(bad_at), 0)]


def _produce_with_raw_header_name(bootstrap: str, topic: str, partition: int, name: bytes,
                                  value: bytes) -> None:
    """Produce through librdkafka's C API: Python clients cannot send a header name that is
    not UTF-8 (confluent-kafka str()s bytes), other clients can."""
    import ctypes
    import glob
    import os

    import confluent_kafka

    libdir = os.path.join(os.path.dirname(confluent_kafka.__file__), "..",
                          "confluent_kafka.libs")
    lib = ctypes.CDLL(glob.glob(os.path.join(libdir, "librdkafka*.so*"))[0])
    lib.rd_kafka_conf_new.restype = ctypes.c_void_p
    lib.rd_kafka_new.restype = ctypes.c_void_p
    lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_char_p, ctypes.c_size_t]
    lib.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_size_t]
    lib.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
    err = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    assert lib.rd_kafka_conf_set(conf, b"bootstrap.servers", bootstrap.encode(), err, 512) == 0
    rk = lib.rd_kafka_new(0, conf, err, 512)  # 0: producer
    assert rk, err.value
    # rd_kafka_producev(rk, TOPIC, PARTITION, VALUE, HEADER(name, value, size), END)
    rc = lib.rd_kafka_producev(
        ctypes.c_void_p(rk), ctypes.c_int(1), ctypes.c_char_p(topic.encode()),
        ctypes.c_int(3), ctypes.c_int32(partition),
        ctypes.c_int(4), ctypes.c_char_p(value), ctypes.c_size_t(len(value)),
        ctypes.c_int(9), ctypes.c_char_p(name), ctypes.c_char_p(b"hv"), ctypes.c_ssize_t(2),
        ctypes.c_int(0))
    assert rc == 0, rc
    assert lib.rd_kafka_flush(rk, 10000) == 0
    lib.rd_kafka_destroy(rk)


def test_header_name_that_is_not_utf8_is_a_dead_letter(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = _topic_with_unreadable_header(kafka_bootstrap, make_topic)
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"hdrname_{unique}", "dead_letter")
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    report = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert report.result.status == "committed", report.result
    assert [r[0] for r in query(pg_dsn, f"SELECT event_id FROM {cfg.sink.table} "
                                        f'ORDER BY "offset"')] == [f"e-{i}" for i in range(41)]
    dead = query(pg_dsn, f'SELECT "offset", value, error FROM {cfg.dead_letter_table} '
                         f'ORDER BY "offset"')
    assert [d[0] for d in dead] == [20, 42]
    assert bytes(dead[0][1]) == b'{"event_id":"hdr-20","seq":99}'
    assert all("header name is not UTF-8" in d[2] for d in dead)


def _topic_with_unreadable_header(bootstrap: str, make_topic: Any) -> str:
    """41 records with headers, and at offsets 20 and 42 one whose header name is not
    UTF-8 (late enough that the reader's call site is specialised by the interpreter)."""
    topic = make_topic("hdrname", 1)
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(41):
        if i == 20:
            assert p.flush(30) == 0
            _produce_with_raw_header_name(bootstrap, topic, 0, b"\xff\xfe-name",
                                          b'{"event_id":"hdr-20","seq":99}')
        p.produce(topic, json.dumps({"event_id": f"e-{i}", "seq": i}).encode(), partition=0,
                  headers=[("trace", b"t"), ("n", str(i).encode())])
    assert p.flush(30) == 0
    _produce_with_raw_header_name(bootstrap, topic, 0, b"\xc3-name",
                                  b'{"event_id":"hdr-42","seq":99}')
    return topic


def test_unreadable_header_name_never_crashes_the_reader(kafka_bootstrap: str,
                                                         make_topic: Any) -> None:
    """confluent-kafka hands such headers back with a NULL inside; reading them crashes
    the process once the interpreter has specialised the call (after a few reads), so read
    the range many times in this process."""
    from offsetflow.ranges import OffsetRange
    from offsetflow.source import read_range

    topic = _topic_with_unreadable_header(kafka_bootstrap, make_topic)
    conf = {"bootstrap.servers": kafka_bootstrap, "group.id": "hdr-test",
            "enable.auto.commit": "false", "auto.offset.reset": "error",
            "enable.partition.eof": "true"}
    for _ in range(30):
        chunks = list(read_range(conf, OffsetRange(topic, 0, 0, 43)))
        assert sum(len(c) for c in chunks) == 43
        refused = {c.offsets[i]: why for c in chunks for i, why in c.refused.items()}
        assert set(refused) == {20, 42}
        headers = [h for c in chunks for h in c.headers]
        assert headers[20] is None and headers[42] is None
        assert headers[21] == [{"key": "trace", "value": b"t"}, {"key": "n", "value": b"20"}]


def test_rows_refused_at_staging_fail_the_batch_under_fail_policy(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    topic = make_topic("refusedf", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for i in range(20):
        p.produce(topic, json.dumps({"event_id": f"e-{i}", "seq": i, "note": "x"}).encode(),
                  partition=0)
    assert p.flush(30) == 0
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"refusedf_{unique}", "fail",
                  transform="tests.integration.stage.test_records_poison.nul_transform")
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    with pytest.raises(BadRecordError) as e:
        run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert f"{topic}[0]@3" in str(e.value) and "(and 1 more bad records" in str(e.value)
    assert "PostgreSQL refused the row at staging" in e.value.reason
    assert "column note" in e.value.reason
    assert query(pg_dsn, f"SELECT count(*) FROM {cfg.sink.table}")[0][0] == 0


@pytest.mark.parametrize("fmt", ["binary", "csv"])
@pytest.mark.parametrize("every", [1, 3], ids=["all_refused", "every_third_refused"])
def test_a_chunk_of_mostly_refused_rows_costs_about_one_copy_per_row(
        monkeypatch: pytest.MonkeyPatch, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
        unique: str, fmt: str, every: int) -> None:
    """Bisecting a chunk where most rows are refused costs ~2n COPYs (and each of the first
    ones copies half the chunk): after a few failures staging goes row by row instead (the
    binary COPY's error names the refused row, so good runs go in one COPY)."""
    from offsetflow.stage import BadRows, binary_encoder, stage_form, stage_rows
    from offsetflow.stage import bad_records as stage_bad_records
    from offsetflow.stage import part as staging
    from offsetflow.stage import payload as stage_copy
    from offsetflow.stage import refused as stage_refused
    from offsetflow.stage.payload import csv_encoder

    topic = make_topic("mostlybad", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, b'{"event_id":"e"}', partition=0)
    assert p.flush(30) == 0
    # types with a binary COPY layout (numeric has none), so the binary COPY is used
    small = {"event_id": "string", "seq": "long", "note": "string"}
    cfg = _config(topic, pg_dsn, kafka_bootstrap, f"mostlybad_{unique}", "dead_letter",
                  schema=small)
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    batch_id = planned.batch.batch_id
    columns = stage_columns(cfg)
    create_stage_tables(pg_dsn, batch_id, columns, parts=1)
    names = [c for c, _ in columns]
    n = 240
    bad_at = set(range(0, n, every))
    typed = arrow_schema(small)
    cols: dict[str, pa.Array] = {
        "topic": pa.array([topic] * n), "partition": pa.array([0] * n, pa.int32()),
        "offset": pa.array(range(n), pa.int64()),
        "timestamp": pa.array([0] * n, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        "timestamp_type": pa.array([1] * n, pa.int32()), "key": pa.nulls(n, pa.binary()),
        "value": pa.array([f"v{i}".encode() for i in range(n)], pa.binary()),
        "headers": pa.nulls(n, HEADER_TYPE),
        "note": pa.array([f"bad\x00{i}" if i in bad_at else f"ok{i}" for i in range(n)]),
    }
    arrays = [cols[c] if c in cols else pa.nulls(n, typed.field(c).type) for c in names]
    batch = pa.RecordBatch.from_arrays(arrays, names=names)
    copies = []
    orig = stage_copy.copy_into

    def counting(*a: Any, **kw: Any) -> None:
        copies.append(1)
        orig(*a, **kw)
    # every module that looks `copy_into` up: the rows' COPYs are stage_refused's (bad=...),
    # the dead-letter COPY stage_bad_records'
    for module in (staging, stage_refused, stage_bad_records):
        monkeypatch.setattr(module, "copy_into", counting)
    if fmt == "binary":
        encode = binary_encoder([t for _, t in columns])
        assert encode(batch.slice(0, 1))[0] == "binary"
    else:
        def encode(b: pa.RecordBatch) -> tuple[str, bytes]:
            return csv_encoder(stage_form(b))
    stats = stage_rows(pg_dsn, batch_id, 0, [batch], encode=encode,
                       table=stage_part_table(batch_id, 0),
                       bad=BadRows(cfg.name, write_rows=True))
    assert stats["rows"] == n - len(bad_at) and stats["bad"] == len(bad_at)
    staged = query(pg_dsn, f'SELECT "offset" FROM offsetflow_stage.b{batch_id}_p0 ORDER BY 1')
    assert [r[0] for r in staged] == [i for i in range(n) if i not in bad_at]
    dead = query(pg_dsn, f'SELECT "offset", error FROM offsetflow_stage.b{batch_id}_dead '
                         f"ORDER BY 1")
    assert [r[0] for r in dead] == sorted(bad_at) and all("column note" in e for _, e in dead)
    # COPYs of rows (the dead-letter COPY is one more): the binary COPY names the refused
    # row, so good runs go in one COPY; CSV goes row by row
    bound = min(n, 2 * len(bad_at)) + 10 if fmt == "binary" else n + 10
    # at least one failed COPY per refused row: fewer means the count missed COPYs
    assert len(bad_at) <= len(copies) - 1 <= bound, len(copies)
