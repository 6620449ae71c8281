"""How many records the reader asks one consume() call for (pure logic)."""

from offsetflow.source.reader import FIRST_CONSUME, MAX_CONSUME, consume_size

MIB = 1 << 20


def test_first_call_probes_with_a_few_records() -> None:
    assert consume_size(20_000, 64 * MIB, 1_000_000, 0, 0) == FIRST_CONSUME


def test_small_records_ask_for_the_usual_batch() -> None:
    assert consume_size(20_000, 64 * MIB, 1_000_000, 1000, 100_000) == MAX_CONSUME


def test_large_records_ask_for_what_the_chunk_has_room_for() -> None:
    # 1 MB records, 10 MiB of room left: 10 records
    assert consume_size(20_000, 10 * MIB, 1_000_000, 5, 5 * MIB) == 10


def test_never_more_than_the_range_or_the_rows_left_and_at_least_one() -> None:
    assert consume_size(20_000, 64 * MIB, 3, 1000, 1000) == 3
    assert consume_size(2, 64 * MIB, 100, 1000, 1000) == 2
    assert consume_size(20_000, 0, 100, 5, 50 * MIB) == 1
    assert consume_size(20_000, -5, 100, 5, 50 * MIB) == 1
