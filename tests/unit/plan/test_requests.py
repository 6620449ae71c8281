import pytest

from offsetflow.errors import RequestError
from offsetflow.plan import check_replay_window, gone_from_kafka, parse_request, resolve_window
from offsetflow.ranges import PartitionOffsets

TPS = [("t", 0), ("t", 1), ("t", 2)]


def test_offsets_per_partition_and_for_all() -> None:
    req = parse_request("backfill", {"pipeline": "orders", "from_offsets": {"0": 5, "1": 0},
                                     "until_offsets": {"0": 10, "1": 3}})
    assert resolve_window(req, TPS) == {("t", 0): (5, 10), ("t", 1): (0, 3)}
    every = parse_request("replay", {"pipeline": "orders", "from_offset": 2, "until_offset": 4,
                                     "partitions": "0, 2"})
    assert resolve_window(every, TPS) == {("t", 0): (2, 4), ("t", 2): (2, 4)}


@pytest.mark.parametrize(
    ("conf", "words"),
    [
        ({}, "pipeline is required"),
        ({"pipeline": "p"}, "give from_offset and until_offset"),
        ({"pipeline": "p", "from_offset": 9, "until_offset": 3}, "until_offset 3 < from_offset 9"),
        ({"pipeline": "p", "from_offset": "x", "until_offset": 3}, "must be an integer"),
        ({"pipeline": "p", "from_offset": -1, "until_offset": 3}, "must be >= 0"),
        ({"pipeline": "p", "from_timestamp": "2026-01-02T00:00:00Z",
          "until_timestamp": "2026-01-01T00:00:00Z"}, "must be after"),
        ({"pipeline": "p", "from_timestamp": "2026-01-01T00:00:00"}, "needs a time zone"),
        ({"pipeline": "p", "from_offset": 1, "until_offset": 3,
          "from_timestamp": 5, "until_timestamp": 9}, "not both"),
        ({"pipeline": "p", "from_offset": 1, "until_offset": 3, "target_table": "x;drop"},
         "not a valid table name"),
        ({"pipeline": "p", "topic": "bad topic!", "from_offset": 1, "until_offset": 3},
         "not a valid Kafka topic"),
    ],
)
def test_bad_requests_are_refused_with_a_message(conf: dict, words: str) -> None:
    with pytest.raises(RequestError, match=words):
        parse_request("backfill", conf)


def test_unknown_partition_is_refused() -> None:
    req = parse_request("backfill", {"pipeline": "p", "from_offset": 0, "until_offset": 5,
                                     "partitions": [0, 7]})
    with pytest.raises(RequestError, match=r"partition\(s\) \[7\] do not exist"):
        resolve_window(req, TPS)


def test_replay_only_of_committed_offsets() -> None:
    window = {("t", 0): (0, 10), ("t", 1): (5, 8)}
    check_replay_window(window, {("t", 0): 10, ("t", 1): 8})
    with pytest.raises(RequestError, match=r"t\[0\] \[0, 12\).*never committed"):
        check_replay_window({("t", 0): (0, 12)}, {("t", 0): 10})
    with pytest.raises(RequestError, match="never committed"):
        check_replay_window({("t", 2): (0, 1)}, {("t", 0): 10})


def test_gone_from_kafka_names_missing_parts() -> None:
    window = {("t", 0): (0, 10), ("t", 1): (5, 30)}
    offs = {("t", 0): PartitionOffsets(4, 50), ("t", 1): PartitionOffsets(0, 20)}
    assert gone_from_kafka(window, offs) == [(("t", 0), 0, 4), (("t", 1), 20, 30)]


def test_backfill_into_own_table_only_below_the_live_position() -> None:
    from offsetflow.plan import check_backfill_window

    check_backfill_window({("t", 0): (0, 50), ("t", 1): (5, 10)}, {("t", 0): 50, ("t", 1): 60},
                          "orders")
    with pytest.raises(RequestError, match=r"t\[0\] \[40, 60\).*not committed offsets from 50 "
                                           r"on \(live position 50\).*another table"):
        check_backfill_window({("t", 0): (40, 60)}, {("t", 0): 50}, "orders")
    with pytest.raises(RequestError, match=r"t\[1\] \[0, 5\).*live position none yet"):
        check_backfill_window({("t", 1): (0, 5)}, {("t", 0): 50}, "orders")
