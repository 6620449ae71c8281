"""Both parsing paths give every record the same answer (review s27-hotpath H1-H3, M1, L1).

A chunk of good records goes through pyarrow's reader (the fast path); a chunk holding a bad
record goes record by record through Python (the slow path, `parse_json_record`). Which path
a record takes depends on its neighbours, so each odd value is put among good records only
and its result compared with what `parse_json_record` says of it alone. Before the fixes:
`{..}{..}` beside an empty value shifted the rows between them, `null` became an all-null
row (or crashed pyarrow when first), NaN/Infinity and `123456` for decimal(6,2) were stored,
a BOM was accepted when first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from offsetflow.source import deserialize_json
from offsetflow.source.deserialize import parse_json_record

SCHEMA = {"a": "long", "d": "double", "f": "float", "p": "decimal(6,2)", "s": "string"}
GOOD = [json.dumps({"a": i, "d": i / 4, "f": 0.5, "p": f"{i}.25", "s": f"g{i}"}).encode()
        for i in range(9)]
ODD = [b"null", b"", b"  ", b"\t", b'{"a":1}{"a":2}', b'{"a":1} {"a":2}', b'{"a":1}null',
       b'{"d":NaN}', b'{"d":Infinity}', b'{"d":-Infinity}', b'{"f":NaN}', b'{"f":1e39}',
       b'{"d":1e400}', b'{"p":123456}', b'{"p":"123456"}', b'{"p":9999.995}', b'{"p":"1.005"}',
       b'\xef\xbb\xbf{"a":1}', b' {"a":1}', b"[1]", b"1", b'"s"', b"true", b'{"a":1',
       b'{"a":9223372036854775808}', b'{"s":"a\\u0000b"}', b'{"a":5}']


def expected(value: bytes) -> dict[str, Any] | str:
    """What the slow path says of `value` alone: its fields, or its reason."""
    try:
        return parse_json_record(value, SCHEMA)
    except ValueError as e:
        return str(e)


def judged(values: list[bytes], at: int) -> tuple[dict[str, Any] | str, list[dict[str, Any]]]:
    """The chunk through `deserialize_json`: the record at `at` (fields or reason), and the
    other records' rows in order."""
    table, bad, good = deserialize_json(values, SCHEMA)
    rows = dict(zip(good, table.to_pylist(), strict=True))
    reasons = {b.index: b.reason for b in bad}
    assert set(rows) | set(reasons) == set(range(len(values))) and not set(rows) & set(reasons)
    mine = reasons[at] if at in reasons else rows[at]
    return mine, [rows.get(i, reasons.get(i)) for i in range(len(values)) if i != at]


@pytest.mark.parametrize("value", ODD, ids=[repr(v)[:30] for v in ODD])
@pytest.mark.parametrize("at", [4, 9], ids=["middle", "last"])
def test_an_odd_value_among_good_ones_gets_the_slow_paths_answer(value: bytes, at: int) -> None:
    values = [*GOOD[:at], value, *GOOD[at:]]
    mine, others = judged(values, at)
    assert mine == expected(value)
    assert others == [expected(v) for v in GOOD]  # every other row is its own


def test_two_objects_in_one_value_and_an_empty_value_shift_no_row() -> None:
    values = [GOOD[0], b'{"a":100}{"a":200}', GOOD[1], GOOD[2], b"", GOOD[3]]
    table, bad, good = deserialize_json(values, SCHEMA)
    assert [b.index for b in bad] == [1, 4]
    assert good == [0, 2, 3, 5]
    assert table.column("a").to_pylist() == [0, 1, 2, 3]


def test_an_odd_value_first_in_a_chunk_is_judged_in_a_process_that_survives() -> None:
    """First in the buffer is where pyarrow crashed (SIGSEGV on `null`): run it in a child
    so a crash fails this test instead of ending the test run."""
    code = (
        "import json, sys\n"
        "from tests.unit.source.test_deserialize_paths import ODD, GOOD, judged, expected\n"
        "for v in ODD:\n"
        "    mine, others = judged([v, *GOOD], 0)\n"
        "    assert mine == expected(v), (v, mine, expected(v))\n"
        "    assert others == [expected(g) for g in GOOD], v\n"
        "print('ok')\n")
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", \
        f"exit {proc.returncode} (-11: the parser crashed): {proc.stderr[-2000:]}"


# -- review s27-odd: what the first fix left --------------------------------------------------
def test_a_value_left_open_is_not_continued_by_the_next_one() -> None:
    """A1: pyarrow continues an object left open on the next line; a two-object value
    elsewhere made the row count match again, so {"a":3} was stored with a=4."""
    values = [b'{"a":1,"x":', b'{"a":2}}', b'{"a":3}', b'{"a":4}{"a":5}', b'{"a":6}']
    table, bad, good = deserialize_json(values, SCHEMA)
    assert [b.index for b in bad] == [0, 1, 3]
    assert dict(zip(good, table.column("a").to_pylist(), strict=True)) == {2: 3, 4: 6}


def test_a_decimal_keeps_every_digit_on_the_slow_path() -> None:
    """A2: the slow path read JSON numbers as Python floats before making decimals."""
    schema = {"p": "decimal(38,18)"}
    value = b'{"p":1.123456789012345678}'
    for chunk in ([value], [value, b"not json"]):  # fast path, then slow path
        table, _, good = deserialize_json(chunk, schema)
        assert table.column("p").to_pylist()[good.index(0)] == \
            Decimal("1.123456789012345678"), chunk


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity", b"Inf", b"-Inf"])
def test_nan_or_infinity_outside_the_declared_fields_gets_one_answer(token: bytes) -> None:
    """A3: in a field the schema does not declare (or nested), pyarrow accepted the token
    and Python refused the record."""
    for value in (b'{"a":1,"extra":' + token + b"}", b'{"a":1,"n":{"m":[' + token + b"]}}"):
        alone, _ = judged([GOOD[0], value], 1)
        with_bad, _ = judged([GOOD[0], value, b"not json"], 1)
        assert alone == with_bad == expected(value), (value, alone, with_bad)


def test_float_max_is_a_float_on_both_paths() -> None:
    """A4: Java's Float.MAX_VALUE printed (3.4028235E38) rounds to float32's largest value;
    the slow path called it an overflow."""
    value = b'{"f":3.4028235E38}'
    alone, _ = judged([GOOD[0], value], 1)
    with_bad, _ = judged([GOOD[0], value, b"not json"], 1)
    assert alone == with_bad == expected(value)
    assert isinstance(alone, dict) and alone["f"] == float(np.float32(3.4028235e38))


@pytest.mark.parametrize("value", [b'{"dt":"0000-01-01"}', b'{"t":"0000-12-31T23:00:00Z"}'])
def test_year_zero_gets_one_answer(value: bytes) -> None:
    """A6: pyarrow reads year 0, Python's datetime (the slow path) refuses it."""
    schema = {"dt": "date", "t": "timestamp"}
    table, bad, good = deserialize_json([value], schema)
    table2, bad2, good2 = deserialize_json([value, b"not json"], schema)
    assert [b.index for b in bad] == [0] and [b.index for b in bad2] == [0, 1]
