"""The output topic's settings as the Kafka sink derives producer settings and record checks
from them, and the failure path's verdict on what the broker refused (pure)."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError

from offsetflow.errors import RequestError
from offsetflow.plan import parse_request
from offsetflow.sinks.kafka.limits import LONG_MAX, TopicSettings
from offsetflow.sinks.kafka.mark import CommitMark, NotProduced, not_produced_in
from offsetflow.sinks.kafka.refusals import judge, primary, refusal_error
from offsetflow.sinks.kafka.txn import Failed
from tests.tooling.kafka_sink_config import batch

DAY = 86_400_000


def settings(**entries: str) -> TopicSettings:
    base = {"max.message.bytes": "1048588", "segment.bytes": "1073741824",
            "cleanup.policy": "delete", "compression.type": "producer",
            "message.timestamp.type": "CreateTime",
            "message.timestamp.before.max.ms": str(LONG_MAX),
            "message.timestamp.after.max.ms": "3600000", "min.insync.replicas": "1"}
    return TopicSettings.parse("out", {**base, **{k.replace("_", "."): v
                                                  for k, v in entries.items()}})


def test_kafkas_defaults_ask_nothing_of_the_producer() -> None:
    s = settings()
    assert s.producer_settings({}) == {}
    assert s.record_limit({}) == 1_000_000  # the producer's own limit is the lower
    assert (s.before_max_ms, s.after_max_ms, s.min_insync) == (None, 3_600_000, 1)


def test_a_small_max_message_bytes_caps_the_record_batches() -> None:
    s = settings(max_message_bytes="2000")
    assert s.producer_settings({}) == {"batch.size": 2000 - 61}
    assert s.producer_settings({"batch.size": "1000"}) == {}  # already below
    assert s.record_limit({}) == 2000 - 61
    # compressed by the producer: the broker judges the compressed batch, librdkafka never
    # sends one larger than uncompressed; single records are judged by the broker
    assert s.producer_settings({"compression.type": "lz4"}) == {"batch.size": 2000 - 61}
    assert s.record_limit({"compression.type": "lz4"}) == 1_000_000


def test_segment_bytes_below_max_message_bytes_is_the_limit() -> None:
    s = settings(max_message_bytes="10485760", segment_bytes="1048576")
    assert s.batch_limit == 1_048_576
    assert s.producer_settings({"batch.size": "8000000"}) == {"batch.size": 1_048_576 - 61}


def test_a_topic_codec_is_the_producers_and_leaves_room_to_recompress() -> None:
    s = settings(max_message_bytes="100000", compression_type="lz4")
    got = s.producer_settings({"compression.type": "gzip"})
    assert got["compression.type"] == "lz4"
    assert got["batch.size"] == int((100_000 - 61 - 64) / (1 + 1 / 255))
    plain = settings(compression_type="uncompressed")
    assert plain.producer_settings({"compression.type": "lz4"}) == {"compression.type": "none"}
    assert plain.record_limit({"compression.type": "lz4"}) == 1_000_000  # producer's lower


@pytest.mark.parametrize(("entries", "bounds"), [
    ({}, (-LONG_MAX, 10 * DAY + 3_600_000 - 5_000)),
    ({"message.timestamp.before.max.ms": str(DAY)}, (9 * DAY + 5_000, 10 * DAY + 3_595_000)),
    ({"message.timestamp.after.max.ms": str(LONG_MAX)}, (-LONG_MAX, LONG_MAX)),
    # before Kafka 4: one bound both ways
    ({"message.timestamp.difference.max.ms": str(DAY),
      "message.timestamp.after.max.ms": str(LONG_MAX)}, (9 * DAY + 5_000, 11 * DAY - 5_000)),
    ({"message.timestamp.type": "LogAppendTime", "message.timestamp.before.max.ms": "1"},
     (-LONG_MAX, LONG_MAX)),
])
def test_timestamp_bounds(entries: dict[str, str], bounds: tuple[int, int]) -> None:
    s = TopicSettings.parse("out", {"message.timestamp.type": "CreateTime",
                                    "message.timestamp.after.max.ms": "3600000", **entries})
    assert s.timestamp_bounds(10 * DAY) == bounds


def test_unreadable_configs_derive_nothing() -> None:
    s = TopicSettings("out")
    assert s.producer_settings({}) == {} and s.record_limit({}) == 1_000_000
    assert s.timestamp_bounds(0) == (-LONG_MAX, LONG_MAX)


def test_a_timestamp_left_out_is_recorded_in_the_commit_and_read_back() -> None:
    mark = CommitMark("orders", "a1b2", "out")
    b = batch()
    left = [NotProduced("in", 0, 12, 30, 1_700_000_000_000), NotProduced("in", 0, 13, None)]
    meta = mark.metadata(7, left, 9)
    assert meta.endswith("not_produced=12:ts1700000000000,13:nullkey")
    found = {("in", 0): (20, meta)}
    assert not_produced_in(b, mark, found) == [NotProduced("in", 0, 12, None, 1_700_000_000_000),
                                               left[1]]
    err = not_produced_in(b, mark, found)[0].error("out", None)
    assert "message.timestamp.before.max.ms" in err and "2023-11-14T22:13:20.000+00:00" in err


def failed(code: int, key: bytes | None = b"k", ts: int = 0) -> Failed:
    return Failed(code, KafkaError(code).str(), 0, key, b"d", ts)


def test_judge_names_only_records_refused_for_themselves() -> None:
    s = settings(max_message_bytes="2000", cleanup_policy="compact")
    big = failed(KafkaError.MSG_SIZE_TOO_LARGE, b"big")
    co = failed(KafkaError.MSG_SIZE_TOO_LARGE, b"co")
    old = failed(KafkaError.INVALID_TIMESTAMP, ts=1)
    keyless = failed(KafkaError.INVALID_RECORD, None)
    found = {big: [(("in", 0, 5), 2500, None, False)],
             co: [(("in", 0, 6), 300, None, False)],  # batched with a refused one
             old: [(("in", 1, 7), 40, 1, False), (("in", 1, 8), 40, 2, False)],
             keyless: [(("in", 1, 9), 40, None, True)]}
    got = judge(found, s, 1939, (2, 10))
    assert got == [NotProduced("in", 0, 5, 2500), NotProduced("in", 1, 7, None, 1),
                   NotProduced("in", 1, 9, None)]
    assert got[0].limit == 2000 and "limit of 2000 bytes" in got[0].error("out", 1939)
    assert judge({co: found[co]}, s, 1939, (0, 10)) == []


def test_a_refusal_no_record_explains_names_the_record_and_the_setting() -> None:
    s = settings(min_insync_replicas="2")
    f = failed(KafkaError.NOT_ENOUGH_REPLICAS)
    purged = failed(KafkaError._PURGE_QUEUE)
    assert primary([purged, f]) == [f]
    msg = refusal_error(batch(), "out", [f], {f: [(("in", 0, 5), 30, None, False)]}, s, 1000)
    assert "in/0/5" in msg and "min.insync.replicas (2)" in msg
    msg = refusal_error(batch(), "out", [f], {}, s, 1000)
    assert "not found in the stage" in msg


def test_allow_duplicates_is_a_flag_of_the_request() -> None:
    base = {"pipeline": "orders", "from_offset": 0, "until_offset": 5}
    assert not parse_request("replay", base).allow_duplicates
    assert parse_request("replay", {**base, "allow_duplicates": "true"}).allow_duplicates
    assert parse_request("backfill", {**base, "allow_duplicates": True}).allow_duplicates
    with pytest.raises(RequestError, match="allow_duplicates"):
        parse_request("replay", {**base, "allow_duplicates": "maybe"})
