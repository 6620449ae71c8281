import datetime as dt
from decimal import Decimal

import pyarrow as pa

from offsetflow.deserialize import deserialize_json

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
    vals = [b'{"id":"a","n":1}', b'{"id":"b","n":"two"}', b"not json", None,
            b'[1,2]', b'{"id":"c",\n"n":3}', b'\xff\xfe']
    table, bad, good = deserialize_json(vals, {"id": "string", "n": "long"})
    reasons = {b.index: b.reason for b in bad}
    assert good == [0, 5]
    assert table.column("id").to_pylist() == ["a", "c"]
    assert set(reasons) == {1, 2, 3, 4, 6}
    assert "field 'n'" in reasons[1] and "integer" in reasons[1]
    assert "invalid JSON" in reasons[2]
    assert "tombstone" in reasons[3]
    assert "JSON object" in reasons[4]
    assert len(good) + len(bad) == len(vals)
