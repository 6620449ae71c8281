"""stage_form: vectorised hex/JSON must equal the obvious per-value encoding."""

from __future__ import annotations

import base64
import json
import random

import pyarrow as pa
import pytest

from offsetflow.stage import stage_form
from offsetflow.stage.form import hex_bytea, nested_json


def reference_hex(values: list[bytes | None]) -> list[str | None]:
    return [None if v is None else "\\x" + v.hex() for v in values]


@pytest.mark.parametrize("values", [
    [b"abc", b"", None, b"\x00\xff\x10", b'{"a": "\\u00e9"}'],
    [None, None],
    [],
    [bytes(range(256)) * 3],
    [b"x"] * 5,
])
def test_hex_matches_reference(values: list[bytes | None]) -> None:
    arr = pa.array(values, pa.binary())
    assert hex_bytea(arr).to_pylist() == reference_hex(values)


def test_hex_random_values_and_nulls() -> None:
    rnd = random.Random(7)
    values = [None if rnd.random() < 0.1 else rnd.randbytes(rnd.randint(0, 300))
              for _ in range(2000)]
    out = hex_bytea(pa.array(values, pa.binary()))
    assert out.to_pylist() == reference_hex(values)
    assert out.null_count == sum(v is None for v in values)


def test_hex_of_sliced_chunked_and_large_binary() -> None:
    values = [b"a", None, b"bc", b"", b"\x01\x02", None, b"zz"]
    arr = pa.array(values, pa.binary())
    for lo, hi in ((1, 5), (2, 7), (3, 3), (0, 7)):
        assert hex_bytea(arr.slice(lo, hi - lo)).to_pylist() == reference_hex(values[lo:hi])
    chunked = pa.chunked_array([arr.slice(0, 3), arr.slice(3)])
    assert hex_bytea(chunked).to_pylist() == reference_hex(values)
    assert hex_bytea(arr.cast(pa.large_binary())).to_pylist() == reference_hex(values)


def test_nested_json_base64_binary_like_spark_to_json() -> None:
    t = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))
    arr = pa.array([None, [{"key": "k", "value": b"\x00v"}], [], [{"key": "n", "value": None}]],
                   t)
    out = nested_json(arr).to_pylist()
    assert out[0] is None
    assert json.loads(out[1]) == [{"key": "k", "value": base64.b64encode(b"\x00v").decode()}]
    assert json.loads(out[2]) == []
    assert json.loads(out[3]) == [{"key": "n", "value": None}]


def test_stage_form_keeps_other_columns_and_names() -> None:
    b = pa.RecordBatch.from_pydict({"offset": pa.array([1, 2], pa.int64()),
                                    "value": pa.array([b"hi", None], pa.binary()),
                                    "note": ["a", None]})
    out = stage_form(b)
    assert out.schema.names == ["offset", "value", "note"]
    assert out.column(0).to_pylist() == [1, 2]
    assert out.column(1).to_pylist() == ["\\x6869", None]
    assert out.column(2).to_pylist() == ["a", None]
