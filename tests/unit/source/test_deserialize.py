import datetime as dt
from decimal import Decimal

import pyarrow as pa
import pytest

from offsetflow.source import deserialize_json

SCHEMA = {"id": "string", "n": "long", "amount": "double", "ok": "boolean",
          "at": "timestamp", "day": "date", "price": "decimal(10,2)"}


def test_fast_path_parses_typed_columns() -> None:
    vals = [b'{"id":"a","n":1,"amount":2.5,"ok":true,"at":"2026-01-01T00:00:00Z",'
            b'"day":"2026-01-02","price":1.25}',
            b'{"id":"b","n":2,"extra":"ignored"}']
    table, bad, good = deserialize_json(vals, SCHEMA)
    assert bad == [] and good == [0, 1]
    assert table.column("id").to_pylist() == ["a", "b"]
    assert table.column("n").type == pa.int64()
    assert table.column("at")[0].as_py() == dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    assert table.column("day")[0].as_py() == dt.date(2026, 1, 2)
    assert table.column("price")[0].as_py() == Decimal("1.25")
    assert table.column("amount").to_pylist() == [2.5, None]


def test_bad_records_are_named_and_nothing_is_dropped() -> None:
    vals = [b'{"id":"a","n":1}', b'{"id":"b","n":"two"}', b"not json", b"null",
            b'[1,2]', b'{"id":"c",\n"n":3}', b'\xff\xfe']
    table, bad, good = deserialize_json(vals, {"id": "string", "n": "long"})
    reasons = {b.index: b.reason for b in bad}
    assert good == [0, 5]
    assert table.column("id").to_pylist() == ["a", "c"]
    assert set(reasons) == {1, 2, 3, 4, 6}
    assert "field 'n'" in reasons[1] and "integer" in reasons[1]
    assert "invalid JSON" in reasons[2]
    assert "JSON object" in reasons[3]
    assert "JSON object" in reasons[4]
    assert len(good) + len(bad) == len(vals)


# --- poison pills: every record comes out as a good row or a BadRecord, never an exception ---

POISON_SCHEMA = {"id": "string", "n": "long", "small": "int", "ratio": "float",
                 "amount": "double", "price": "decimal(6,2)", "at": "timestamp"}
GOOD = b'{"id":"ok","n":1,"price":"12.5"}'


def _reasons(vals: list[bytes | None], schema: dict[str, str] = POISON_SCHEMA
             ) -> tuple[pa.Table, dict[int, str], list[int]]:
    table, bad, good = deserialize_json(vals, schema)
    assert len(good) + len(bad) == len(vals) == len(set(good) | {b.index for b in bad})
    assert table.num_rows == len(good)
    return table, {b.index: b.reason for b in bad}, good


def test_nul_in_a_string_is_a_bad_record_on_the_fast_path() -> None:
    # the fast path alone (all other records fine): pyarrow accepts \u0000, PostgreSQL not
    table, reasons, good = _reasons([GOOD, b'{"id":"a\\u0000b"}', GOOD])
    assert good == [0, 2] and set(reasons) == {1}
    assert "field 'id'" in reasons[1] and "NUL" in reasons[1]
    assert table.column("id").to_pylist() == ["ok", "ok"]


def test_nul_in_a_string_is_a_bad_record_on_the_slow_path() -> None:
    table, reasons, good = _reasons([GOOD, b'{"id":"a\\u0000b"}', b"not json"])
    assert good == [0] and set(reasons) == {1, 2}
    assert "NUL" in reasons[1]


def test_escaped_backslash_u0000_is_not_a_nul() -> None:
    table, reasons, good = _reasons([b'{"id":"\\\\u0000"}'])
    assert reasons == {} and table.column("id").to_pylist() == ["\\u0000"]


def test_lone_surrogate_is_a_bad_record() -> None:
    table, reasons, good = _reasons([GOOD, b'{"id":"\\ud800"}', GOOD])
    assert good == [0, 2] and "surrogate" in reasons[1] and "field 'id'" in reasons[1]
    # a proper pair is fine
    table, reasons, good = _reasons([b'{"id":"\\ud83d\\ude00"}'])
    assert reasons == {} and table.column("id").to_pylist() == ["\U0001F600"]


def test_decimal_beyond_its_precision_is_a_bad_record() -> None:
    table, reasons, good = _reasons([GOOD, b'{"price":123456.7}', b'{"price":"NaN"}',
                                     b'{"price":"1e9"}', b'{"price":9999.99}'])
    assert good == [0, 4]
    for i in (1, 3):
        assert "field 'price'" in reasons[i] and "decimal(6,2)" in reasons[i]
    assert "field 'price'" in reasons[2]
    assert table.column("price").to_pylist() == [Decimal("12.50"), Decimal("9999.99")]


def test_decimal_with_more_scale_is_rounded_like_postgresql() -> None:
    table, reasons, good = _reasons([b'{"price":1.235}', b'{"price":"-1.225"}'])
    assert reasons == {}
    assert table.column("price").to_pylist() == [Decimal("1.24"), Decimal("-1.23")]


def test_numbers_that_overflow_are_bad_records() -> None:
    table, reasons, good = _reasons([GOOD, b'{"ratio":1e39}', b'{"amount":1e400}',
                                     b'{"small":2147483648}', b'{"n":9223372036854775808}',
                                     b'{"amount":NaN}', b'{"ratio":3.4e38}'])
    assert good == [0, 6]
    assert "field 'ratio'" in reasons[1] and "float" in reasons[1]
    assert "field 'amount'" in reasons[2]
    assert "field 'small'" in reasons[3] and "field 'n'" in reasons[4]
    assert "NaN" in reasons[5]


def test_float_overflow_alone_is_caught_on_the_fast_path() -> None:
    table, reasons, good = _reasons([GOOD, b'{"ratio":-1e39}'])
    assert good == [0] and "field 'ratio'" in reasons[1]


def test_invalid_utf8_anywhere_in_the_value_is_a_bad_record_on_both_paths() -> None:
    for vals in ([GOOD, b'{"id":"\xff"}', GOOD], [GOOD, b'{"id":"a","other":"\xc3"}', GOOD],
                 [GOOD, b'{"id":"\xff"}', b"not json"]):
        table, reasons, good = _reasons(vals)
        assert 1 in reasons and "UTF-8" in reasons[1], reasons
        assert 0 in good


def test_very_deep_json_does_not_escape_the_per_record_handling() -> None:
    deep = b'{"id":"deep","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for vals in ([GOOD, deep], [GOOD, deep, b"not json"]):  # fast path, then slow path
        table, reasons, good = _reasons(vals)
        assert 1 in good, reasons  # deep but valid: both paths agree it is a good row
        assert "deep" in table.column("id").to_pylist()
    deep_bad = b'{"id":"x","x":' + b"[" * 100_000 + b"}"
    table, reasons, good = _reasons([GOOD, deep_bad])
    assert good == [0] and "invalid JSON" in reasons[1]


def test_timestamp_number_is_a_bad_record_on_both_paths() -> None:
    for vals in ([GOOD, b'{"at":1700000000}'], [GOOD, b'{"at":1700000000}', b"x"]):
        table, reasons, good = _reasons(vals)
        assert "field 'at'" in reasons[1]


# --- tombstones: a null value is a row with null fields, filled from a JSON-object key ---

def test_tombstone_is_a_row_with_fields_from_the_key() -> None:
    vals = [GOOD, None, None, None, GOOD]
    keys = [b"k", b'{"id":"from-key","n":"7","small":3}', b"plain-key", None, b"k"]
    table, bad, good = deserialize_json(vals, POISON_SCHEMA, keys)
    assert bad == [] and good == [0, 1, 2, 3, 4]
    assert table.column("id").to_pylist() == ["ok", "from-key", None, None, "ok"]
    # "7" is not an integer: that field stays null, the record is not bad
    assert table.column("n").to_pylist() == [1, None, None, None, 1]
    assert table.column("small").to_pylist() == [None, 3, None, None, None]
    assert table.schema == good_schema()


def test_tombstones_among_bad_records_keep_chunk_order() -> None:
    vals = [None, b"not json", GOOD, None]
    keys = [b'{"id":"a"}', None, None, b'{"id":"b"}']
    table, bad, good = deserialize_json(vals, POISON_SCHEMA, keys)
    assert good == [0, 2, 3] and [b.index for b in bad] == [1]
    assert table.column("id").to_pylist() == ["a", "ok", "b"]


def good_schema() -> pa.Schema:
    from offsetflow.source import arrow_schema

    return arrow_schema(POISON_SCHEMA)


def test_one_bad_record_sends_only_a_small_piece_of_its_chunk_to_the_slow_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import offsetflow.source.deserialize as d

    calls = []
    real = d.parse_json_record

    def counting(value: bytes | None, schema: dict[str, str]) -> dict[str, object]:
        calls.append(value)
        return real(value, schema)

    monkeypatch.setattr(d, "parse_json_record", counting)
    vals = [b'{"id":"r%d","n":%d}' % (i, i) for i in range(20_000)]
    vals[12_345] = b'{"id":"bad","n":"x"}'
    table, bad, good = deserialize_json(vals, {"id": "string", "n": "long"})
    assert [b.index for b in bad] == [12_345] and "field 'n'" in bad[0].reason
    assert good == [i for i in range(20_000) if i != 12_345]
    assert table.column("n").to_pylist() == [i for i in range(20_000) if i != 12_345]
    assert len(calls) <= d.SLOW_PATH_ROWS
