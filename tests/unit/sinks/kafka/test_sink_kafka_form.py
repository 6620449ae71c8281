"""sink.type: kafka: config validation and the sink's pure rules (names, the record of a
commit, the replay rule, the SELECT that turns staged rows into records)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from psycopg2 import sql

from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError, KafkaSinkError
from offsetflow.ledger import Batch
from offsetflow.ranges import OffsetRange
from offsetflow.sinks.kafka import output_topic
from offsetflow.sinks.kafka.form import (
    check_columns,
    record_headers,
    record_key,
    record_limit,
    record_size,
    row_bytes_sql,
    rows_per_fetch,
    select_sql,
)
from offsetflow.sinks.kafka.mark import (
    BATCH_HEADER,
    SOURCE_HEADER,
    CommitMark,
    NotProduced,
    commit_batch_ids,
    committed_state,
    not_produced_in,
    records_in,
    refuse_group_ahead,
)
from tests.tooling.kafka_sink_config import ENV, batch, raw

MARK = CommitMark("orders", "a1b2", "out")
COLUMNS = {"topic": "text", "partition": "integer", "offset": "bigint",
           "timestamp": "timestamptz", "key": "bytea", "value": "bytea", "headers": "jsonb",
           "id": "text", "amount": "double precision"}


def test_kafka_sink_config_defaults_and_fields() -> None:
    cfg = parse_pipeline(raw(topic="orders.clean", key_column="id",
                             producer={"compression.type": "lz4"}), "orders.yaml", ENV)
    k = cfg.sink.kafka
    assert k is not None and cfg.sink.type == "kafka"
    assert (k.topic, k.key_column, k.value_format, k.headers, k.partitioning) == (
        "orders.clean", "id", "json", "carry", "key")
    assert cfg.sink.table == "kafka:orders.clean" and cfg.sink.mode == "append"
    assert dict(k.producer) == {"compression.type": "lz4"}
    plain = parse_pipeline(raw(topic="orders.clean"), "orders.yaml", ENV)
    assert plain.fingerprint() != cfg.fingerprint()  # the key decides the output
    # naming a side topic for replays is not a change of the live output
    side = parse_pipeline(raw(topic="orders.clean", replay_topic="orders.replay"),
                          "orders.yaml", ENV)
    assert side.fingerprint() == plain.fingerprint()


@pytest.mark.parametrize(("sink", "field", "words"), [
    ({}, "sink.topic", "is required"),
    ({"topic": "bad topic"}, "sink.topic", "not a valid Kafka topic"),
    ({"topic": "o", "replay_topic": "o"}, "sink.replay_topic", "must differ"),
    ({"topic": "o", "table": "t"}, "sink.table", "sink.type: postgres"),
    ({"topic": "o", "mode": "upsert"}, "sink.mode", "sink.type: postgres"),
    ({"topic": "o", "key_column": "nope"}, "sink.key_column", "not a column"),
    ({"topic": "o", "value_columns": ["id", "nope"]}, "sink.value_columns[1]", "not a column"),
    ({"topic": "o", "value_format": "protobuf"}, "sink.value_format", "not one of"),
    ({"topic": "o", "value_format": "avro"}, "sink.schema_registry", "schema registry"),
    ({"topic": "o", "value_format": "avro", "schema_registry": {"url": "ftp://x"}},
     "sink.schema_registry.url", "not an http(s) URL"),
    ({"topic": "o", "value_format": "avro", "schema_registry": {"url": "http://sr:8081"},
      "value_schema": "[1]"}, "sink.value_schema", "Avro record schema"),
    ({"topic": "o", "value_subject": "s"}, "sink.value_subject", "value_format: avro"),
    ({"topic": "o", "value_columns": ["id"], "value_format": "raw"}, "sink.value_columns",
     "value_format: json"),
    ({"topic": "o", "value_column": "value"}, "sink.value_column", "value_format: raw"),
    ({"topic": "o", "partitioning": "round_robin"}, "sink.partitioning", "not one of"),
    ({"topic": "o", "producer": {"transactional.id": "x"}}, "sink.producer.transactional.id",
     "set by OffsetFlow"),
    ({"topic": "o", "bogus": 1}, "sink.bogus", "unknown field"),
    ({"topic": "o", "task_files": "relative/dir"}, "sink.task_files", "not an absolute path"),
    ({"topic": "o", "task_files_mode": "0777"}, "sink.task_files_mode", "is not one of"),
    # group-writable: a group member could rewrite a file between its CRC check and its read
    ({"topic": "o", "task_files_mode": "0660"}, "sink.task_files_mode", "is not one of"),
    # an unquoted 0644 in YAML is the number 420: the quoted form named, not "got 420"
    ({"topic": "o", "task_files_mode": 420}, "sink.task_files_mode", "number 420): write '0644'"),
    ({"topic": "o", "task_files_mode": 640}, "sink.task_files_mode", "write '0640'"),
])
def test_kafka_sink_config_errors_name_the_field(sink: dict[str, Any], field: str,
                                                 words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_pipeline(raw(**sink), "orders.yaml", ENV)
    assert e.value.field == field and words in e.value.message


def test_kafka_sink_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ConfigError, match="on_failure: fail") as e:
        parse_pipeline({**raw(topic="o"), "quality": {"suite": "s", "on_failure": "dead_letter"}},
                       "orders.yaml", ENV)
    assert e.value.field == "quality.on_failure"
    with pytest.raises(ConfigError) as e:
        parse_pipeline({**raw(topic="o"), "tombstones": "dead_letter"}, "orders.yaml", ENV)
    assert e.value.field == "tombstones"
    raw_fmt = {**raw(topic="o"), "format": {"type": "raw"}}
    with pytest.raises(ConfigError) as e:  # raw format: no typed columns for a JSON value
        parse_pipeline(raw_fmt, "orders.yaml", ENV)
    assert e.value.field == "sink.value_columns"
    raw_fmt["sink"]["value_format"] = "raw"
    assert parse_pipeline(raw_fmt, "orders.yaml", ENV).sink.kafka is not None


def test_redacted_hides_producer_secrets() -> None:
    cfg = parse_pipeline(raw(topic="o", producer={"sasl.password": "pw"}), "o.yaml", ENV)
    assert cfg.redacted()["sink"]["kafka"]["producer"] == {"sasl.password": "***"}


def test_names_live_batches_share_replays_get_their_own() -> None:
    live, replay = batch(7), batch(8, "replay", moves=False)
    assert MARK.transactional_id(live) == MARK.transactional_id(batch(9))
    assert MARK.transactional_id(live) == "offsetflow-sink-orders.a1b2"
    assert MARK.transactional_id(replay) == "offsetflow-sink-orders.a1b2-replay-8"
    assert MARK.group(live) == "offsetflow-sink-orders.a1b2"  # not the lag group
    assert MARK.group(replay) != MARK.group(live)
    # another ledger's pipeline of the same name: other names (review M2)
    other = CommitMark("orders", "c3d4", "out")
    assert other.transactional_id(live) != MARK.transactional_id(live)
    assert other.group(live) != MARK.group(live)
    # the names before the ledger identity, looked up for batches planned before it
    legacy = CommitMark.legacy("orders")
    assert legacy.transactional_id(live) == legacy.group(live) == "offsetflow-sink-orders"
    assert legacy.group(replay) == "offsetflow-sink-orders-replay-8"


def test_committed_state_needs_this_batch_at_every_until_offset() -> None:
    b = batch(7)
    meta = MARK.metadata(7)
    assert meta == "offsetflow pipeline=orders batch=7 ledger=a1b2 topic=out"
    # the empty range [5, 5) of partition 1 says nothing either way
    assert committed_state(b, MARK, {("in", 0): (20, meta)})
    assert not committed_state(b, MARK, {})
    assert not committed_state(b, MARK, {("in", 0): (10, MARK.metadata(6))})
    # the same offset from another batch (a position reset re-planned the same range)
    assert not committed_state(b, MARK, {("in", 0): (20, MARK.metadata(3))})
    two = Batch(7, "orders", "scheduled", "running",
                (OffsetRange("in", 0, 10, 20), OffsetRange("in", 1, 0, 5)), "kafka:out")
    with pytest.raises(KafkaSinkError, match=r"not for \['in\[1\]'\]"):
        committed_state(two, MARK, {("in", 0): (20, meta), ("in", 1): (3, meta)})


def test_another_ledgers_or_the_older_format_commit_is_not_this_ledgers() -> None:
    """Review M2: the same pipeline and batch number in another ledger is not this batch;
    the format without a ledger matches only the legacy mark (batches planned before the
    ledger identity)."""
    b = batch(7)
    other = CommitMark("orders", "c3d4", "out").metadata(7)
    legacy = CommitMark.legacy("orders")
    assert legacy.metadata(7) == "offsetflow pipeline=orders batch=7"
    assert not committed_state(b, MARK, {("in", 0): (20, other)})
    assert not committed_state(b, MARK, {("in", 0): (20, legacy.metadata(7))})
    assert committed_state(b, legacy, {("in", 0): (20, legacy.metadata(7))})
    assert not committed_state(b, legacy, {("in", 0): (20, MARK.metadata(7))})
    # this ledger's commit of the batch to another topic: refused, naming both topics
    moved = CommitMark("orders", "a1b2", "out.v2")
    with pytest.raises(KafkaSinkError, match=r"to topic out, .* now writes it to out\.v2"):
        committed_state(b, moved, {("in", 0): (20, MARK.metadata(7))})
    # what is not an offsetflow mark at all is nobody's commit
    assert not committed_state(b, MARK, {("in", 0): (20, "some other tool")})


def test_replay_goes_to_the_side_topic_or_is_refused() -> None:
    cfg = parse_pipeline(raw(topic="o"), "orders.yaml", ENV)
    assert cfg.sink.kafka is not None
    assert output_topic(cfg.sink.kafka, batch(), "orders.yaml") == "o"
    for kind in ("replay", "backfill"):
        with pytest.raises(ConfigError, match="duplicate") as e:
            output_topic(cfg.sink.kafka, batch(8, kind, moves=False), "orders.yaml")
        assert e.value.field == "sink.replay_topic"
    side = parse_pipeline(raw(topic="o", replay_topic="o.replay"), "orders.yaml", ENV)
    assert side.sink.kafka is not None
    replay = batch(8, "replay", moves=False, target="kafka:o.replay")
    assert output_topic(side.sink.kafka, replay, "x") == "o.replay"
    # planned into another side topic than the config names now: refused, naming both
    # (whether the window is already there was checked against the planned one)
    with pytest.raises(ConfigError, match=r"o\.before.*o\.replay") as e:
        output_topic(side.sink.kafka, batch(8, "replay", moves=False, target="kafka:o.before"),
                     "x")
    assert e.value.field == "sink.replay_topic"


def test_record_headers_carry_the_source_ones_and_name_batch_and_source() -> None:
    carried = [{"key": "trace", "value": base64.b64encode(b"\x00t1").decode()},
               {"key": "empty", "value": None}]
    assert record_headers(7, "in", 1, 42, carried) == [
        ("trace", b"\x00t1"), ("empty", None), (BATCH_HEADER, b"7"),
        (SOURCE_HEADER, b"in/1/42")]
    assert record_headers(7, "in", 1, 42, None)[0][0] == BATCH_HEADER


def _render(q: sql.Composable) -> str:
    """SQL text of a composed query without a connection (identifiers double-quoted,
    literals single-quoted), enough to check what the query is made of."""
    if isinstance(q, sql.Composed):
        return "".join(_render(x) for x in q.seq)
    if isinstance(q, sql.SQL):
        return q.string
    if isinstance(q, sql.Identifier):
        return ".".join(f'"{s}"' for s in q.strings)
    if isinstance(q, sql.Literal):
        return f"'{q.wrapped}'"
    raise TypeError(q)


def _text(cfg_sink: dict[str, Any], columns: dict[str, str] | None = None) -> str:
    cfg = parse_pipeline(raw(**cfg_sink), "orders.yaml", ENV)
    assert cfg.sink.kafka is not None
    return _render(select_sql(cfg.sink.kafka, columns or COLUMNS, sql.SQL("stage")))


def test_select_builds_key_and_value_in_postgres_in_source_order() -> None:
    q = _text({"topic": "o", "key_column": "id"})
    assert 'convert_to(s."id", \'UTF8\')' in q
    assert "row_to_json(offsetflow_v.*)::text" in q
    assert 'LATERAL (SELECT s."id" AS "id", s."amount" AS "amount") offsetflow_v' in q
    assert "CASE WHEN s.value IS NULL THEN NULL" in q  # a tombstone stays one
    assert q.endswith('ORDER BY s.topic, s.partition, s."offset"')
    assert "LATERAL" not in _text({"topic": "o", "value_format": "raw"})
    raw_q = _text({"topic": "o", "value_format": "raw", "headers": "none"})
    assert 's."key"' in raw_q and 's."value"' in raw_q and "NULL::jsonb" in raw_q
    # a non-text key column is its JSON scalar text; many columns: one row all the same
    wide = {**COLUMNS, **{f"c{i}": "integer" for i in range(60)}}
    q = _text({"topic": "o", "key_column": "amount"}, wide)
    assert "to_json(s.\"amount\") #>> '{}'" in q
    assert 's."c59" AS "c59"' in q and q.count("row_to_json") == 1


def test_lineage_and_assets_name_the_output_topic() -> None:
    from offsetflow.orchestration.assets import target_uris
    from offsetflow.orchestration.lineage import pipeline_datasets

    cfg = parse_pipeline(raw(topic="orders.clean"), "orders.yaml", ENV)
    _, outputs = pipeline_datasets(cfg)
    assert [o.uri for o in outputs] == ["kafka://127.0.0.1:19092/orders.clean"]
    assert target_uris(cfg) == "kafka://127.0.0.1:19092/orders.clean"
    assert target_uris(cfg, "kafka:orders.replayed") == "kafka://127.0.0.1:19092/orders.replayed"


@pytest.mark.parametrize(("key_type", "encoded"), [
    ("bytea", 's."key", '),
    ("text", 'convert_to(s."key", \'UTF8\')'),
    ("bigint", 'convert_to(to_json(s."key") #>> \'{}\', \'UTF8\')'),
])
def test_a_transforms_key_is_encoded_by_its_type(key_type: str, encoded: str) -> None:
    """A transform may put any type in `key`: never handed to the driver as an int."""
    q = _text({"topic": "o", "value_format": "raw"}, {**COLUMNS, "key": key_type})
    assert encoded in q


def test_the_key_reaches_the_driver_as_hex_text_of_its_bytes() -> None:
    """psycopg2 makes a bytea a memoryview over a buffer of its own (about 0.3 us a row in
    the driver): the key comes as hex text and `record_key` makes it the same bytes."""
    assert 'encode(s."key", \'hex\')' in _text({"topic": "o", "value_format": "raw"})
    assert 'encode(convert_to(s."id", \'UTF8\'), \'hex\')' in _text(
        {"topic": "o", "key_column": "id"})
    assert "NULL::text" in _text({"topic": "o"}, {c: t for c, t in COLUMNS.items()
                                                  if c != "key"})
    assert record_key(None) is None
    assert record_key("") == b""
    assert record_key(b"\x00\xffk\xc3\xa9".hex()) == b"\x00\xffk\xc3\xa9"


@pytest.mark.parametrize(("sink", "columns", "field"), [
    ({"topic": "o"}, {**COLUMNS, "key": "jsonb"}, "transform"),
    ({"topic": "o", "key_column": "headers"}, COLUMNS, "sink.key_column"),
])
def test_a_nested_key_is_refused_naming_the_column_and_type(
        sink: dict[str, Any], columns: dict[str, str], field: str) -> None:
    cfg = parse_pipeline(raw(**sink), "orders.yaml", ENV)
    assert cfg.sink.kafka is not None
    with pytest.raises(ConfigError, match="is jsonb") as e:
        check_columns(cfg.sink.kafka, columns, "orders.yaml")
    assert e.value.field == field


def test_left_out_records_round_trip_through_the_offset_metadata() -> None:
    """The commit names, per partition, the records it left out; the run that finds the
    commit reads the same ones back, and the commit still counts as this batch's."""
    b = batch()
    left = [NotProduced("in", 0, 12, 1_020_345), NotProduced("in", 0, 15, None)]
    meta = MARK.metadata(7, left)
    assert meta == ("offsetflow pipeline=orders batch=7 ledger=a1b2 topic=out "
                    "not_produced=12:1020345,15:nullkey")
    found = {("in", 0): (20, meta), ("in", 1): (5, None)}
    assert committed_state(b, MARK, found) is True
    assert not_produced_in(b, MARK, found) == left
    plain = {("in", 0): (20, MARK.metadata(7))}
    assert committed_state(b, MARK, plain) and not_produced_in(b, MARK, plain) == []
    # another batch's mark with a list is still another batch's
    assert committed_state(b, MARK, {("in", 0): (20, MARK.metadata(70, left))}) is False
    # the older format's list reads back too
    legacy = CommitMark.legacy("orders")
    old = {("in", 0): (20, legacy.metadata(7, left))}
    assert committed_state(b, legacy, old) and not_produced_in(b, legacy, old) == left
    assert "1020345 bytes" in left[0].error("out", 1_000_000)
    assert "compact" in left[1].error("out", None)


def test_the_commit_records_each_partitions_staged_records_for_complete() -> None:
    """`offsetflow complete` takes the ledger's counts from the commit when the stage is
    gone (review s24-complete LOW): each partition's staged records, left-out ones included,
    read back with the left-out list; a commit made before the count has none to give."""
    b = batch()  # ranges in[0] [10, 20) and in[1] [5, 5) (empty: no offset committed)
    left = [NotProduced("in", 0, 12, 1_020_345)]
    meta = MARK.metadata(7, left, 9)
    assert meta == ("offsetflow pipeline=orders batch=7 ledger=a1b2 topic=out,records=9 "
                    "not_produced=12:1020345")
    found = {("in", 0): (20, meta), ("in", 1): (5, None)}
    assert committed_state(b, MARK, found) is True
    assert not_produced_in(b, MARK, found) == left
    assert records_in(b, MARK, found) == {"in/0": 9}
    assert records_in(b, MARK, {("in", 0): (20, MARK.metadata(7, left))}) is None
    assert records_in(b, MARK, {("in", 0): (20, MARK.metadata(8, (), 9))}) is None
    legacy = CommitMark.legacy("orders")  # never written any more: no count
    assert legacy.metadata(7, (), 0) == "offsetflow pipeline=orders batch=7"
    assert records_in(b, legacy, {("in", 0): (20, legacy.metadata(7, (), 0))}) is None


def test_a_release_before_the_count_refuses_a_counted_commit_instead_of_producing_again(
        ) -> None:
    """After a downgrade, the previous release's parser (its regex, copied here) must not
    take a commit with the count for "not committed" (it would produce the batch again):
    it reads the count as part of the topic, and its topic check refuses the batch."""
    import re

    before = re.compile(r"offsetflow pipeline=(\S+) batch=(\d+)"
                        r"(?: ledger=(\S+) topic=(\S+))?(?: not_produced=(\S*))?")
    m = before.fullmatch(MARK.metadata(7, [NotProduced("in", 0, 12, 5)], 9))
    assert m is not None and (m[1], m[2], m[3]) == ("orders", "7", "a1b2")
    assert m[4] == "out,records=9" != MARK.topic


@pytest.mark.parametrize(("producer", "topic_max", "limit"), [
    ({}, None, 1_000_000),
    ({}, 1_048_588, 1_000_000),  # the producer's default is the lower
    ({}, 500_000, 500_000 - 61),  # the topic's, less the record batch header
    ({"message.max.bytes": "2000000"}, 1_048_588, 1_048_588 - 61),
    ({"message.max.bytes": 2_000_000, "compression.type": "lz4"}, 1_048_588, 2_000_000),
])
def test_record_limit(producer: dict[str, Any], topic_max: int | None, limit: int) -> None:
    assert record_limit(producer, topic_max) == limit


def test_record_size_counts_key_value_and_headers() -> None:
    hdrs = record_headers(7, "in", 0, 12, None)
    size = record_size(b"k", b"v" * 100, hdrs)
    assert size > 101 + sum(len(k) + len(v or b"") for k, v in hdrs)
    assert record_size(None, None, []) == 36


def test_rows_per_fetch_is_bounded_by_bytes() -> None:
    assert rows_per_fetch(300, 32 * 2**20, 5_000) == 5_000  # small rows: the row cap
    assert rows_per_fetch(1_000_000, 32 * 2**20, 5_000) == 11  # ~3 bytes held per byte
    assert rows_per_fetch(10**9, 32 * 2**20, 5_000) == 1  # never 0
    q = _render(row_bytes_sql(COLUMNS, sql.SQL("stage")))
    assert 'octet_length(s."value")' in q and 'pg_column_size(s."headers")' in q
    assert "partition" not in q  # fixed-width columns: an allowance, no per-row call


def test_a_group_ahead_of_the_batch_with_a_commit_the_ledger_does_not_know_is_refused() -> None:
    """Review H1: a restored (or copied) ledger reuses batch ids and positions under the same
    identity; the group then holds, above the batch's from_offset, a commit this ledger has
    no record of. Refused, naming the way out; known commits and offsets at or below
    from_offset are fine."""
    b = batch(7)  # in[0] [10, 20)
    ahead = {("in", 0): (25, MARK.metadata(9))}
    assert commit_batch_ids({**ahead, ("in", 1): (5, MARK.metadata(4)),
                             ("in", 2): (1, "foreign")}) == [4, 9]
    with pytest.raises(KafkaSinkError, match=r"pipeline orders batch 7: .* offset 25 for "
                                             r"in\[0\], committed by batch 9 .* from offset "
                                             r"10 .*restored.*reset-position orders --topic in "
                                             r"--partition 0 --offset 25"):
        refuse_group_ahead(b, MARK, ahead, set())
    # this batch's own id at another offset above from_offset: the rewound counter's twin
    with pytest.raises(KafkaSinkError, match="committed by batch 7"):
        refuse_group_ahead(b, MARK, {("in", 0): (15, MARK.metadata(7))}, set())
    # a commit this ledger knows (a position moved back on purpose): fine
    refuse_group_ahead(b, MARK, ahead, {(9, "in", 0, 25)})
    # at or below from_offset: the previous batch, a skip, a forward reset; any id
    for off in (10, 3):
        refuse_group_ahead(b, MARK, {("in", 0): (off, MARK.metadata(7))}, set())
        refuse_group_ahead(b, MARK, {("in", 0): (off, MARK.metadata(12))}, set())
    # another ledger's, a legacy or a foreign mark, an empty range: not this ledger's record
    refuse_group_ahead(b, MARK, {("in", 0): (25, CommitMark("orders", "c3d4", "out")
                                             .metadata(9))}, set())
    refuse_group_ahead(b, MARK, {("in", 0): (25, "x"), ("in", 1): (9, MARK.metadata(9))},
                       set())
    # a replay's group is its own: another id there is not refused, its own id is
    replay = batch(8, "replay", moves=False)
    refuse_group_ahead(replay, MARK, ahead, set())
    with pytest.raises(KafkaSinkError, match="committed by batch 8"):
        refuse_group_ahead(replay, MARK, {("in", 0): (25, MARK.metadata(8))}, set())


def test_kafka_sink_task_files_is_an_absolute_path_checked_at_load(tmp_path: Any) -> None:
    """`sink.task_files` (issue 32): only an absolute path at load (a host without the
    executors' mount loads the config: the driver checks the directory before the read);
    it does not change the fingerprint (the records produced are the same either way)."""
    cfg = parse_pipeline(raw(topic="o", task_files=str(tmp_path)), "orders.yaml", ENV)
    assert cfg.sink.kafka is not None and cfg.sink.kafka.task_files == str(tmp_path)
    assert cfg.fingerprint() == parse_pipeline(raw(topic="o"), "orders.yaml", ENV).fingerprint()
    missing = parse_pipeline(raw(topic="o", task_files="/nonexistent/offsetflow-task-files"),
                             "orders.yaml", ENV)
    assert missing.sink.kafka is not None
    assert missing.sink.kafka.task_files == "/nonexistent/offsetflow-task-files"


def test_kafka_sink_task_files_mode_is_who_may_read_the_files(tmp_path: Any) -> None:
    """`sink.task_files_mode`: 0640 by default (the writer's group reads), 0644 where the
    driver shares no group with the executors; an octal string (YAML would read 0644
    unquoted as the integer 420); not in the fingerprint (the records are the same)."""
    cfg = parse_pipeline(raw(topic="o", task_files=str(tmp_path), task_files_mode="0644"),
                         "orders.yaml", ENV)
    assert cfg.sink.kafka is not None and cfg.sink.kafka.task_files_mode == 0o644
    default = parse_pipeline(raw(topic="o"), "orders.yaml", ENV)
    assert default.sink.kafka is not None and default.sink.kafka.task_files_mode == 0o640
    assert cfg.fingerprint() == default.fingerprint()


def test_kafka_sink_task_files_takes_auto_off_or_an_absolute_path() -> None:
    """`sink.task_files`: `auto` by default, `off`, or an absolute path; another word is
    refused as a relative path, naming the two words."""
    from offsetflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'of' is not an absolute path.*auto.*off"):
        parse_pipeline(raw(topic="o", task_files="of"), "orders.yaml", ENV)


def test_kafka_sink_task_files_off_unquoted_in_yaml_is_off() -> None:
    """`task_files: off` as the docs write it: YAML 1.1 reads the bare word as the boolean
    false, which is `off` (the stage), not "must be a string"; a bare `on` names no choice
    and is refused naming the three."""
    import yaml

    from offsetflow.errors import ConfigError

    for word in ("off", "no", "false"):
        sink = yaml.safe_load(f"task_files: {word}")
        assert sink == {"task_files": False}
        cfg = parse_pipeline(raw(topic="o", **sink), "orders.yaml", ENV)
        assert cfg.sink.kafka is not None
        assert cfg.sink.kafka.task_files is None and not cfg.sink.kafka.task_files_auto
    with pytest.raises(ConfigError, match=r"sink.task_files.*true.*auto.*off"):
        parse_pipeline(raw(topic="o", **yaml.safe_load("task_files: on")), "orders.yaml",
                       ENV)
