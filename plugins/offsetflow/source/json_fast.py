"""The fast path of `deserialize`: pyarrow's JSON reader over a clean chunk, and the checks
that prove its rows are the chunk's values one for one and hold only what the slow path
(Python, record by record) would accept; anything else sends the chunk to the slow path.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

NUL_ESCAPE = b"\\u0000"  # the only way a JSON text can hold a NUL character


@dataclass(frozen=True)
class BadRecord:
    index: int  # position in the chunk
    reason: str


def parse_fast(values: Sequence[bytes | None], target: pa.Schema, errors: list[str] | None = None,
          newlines: bool = False) -> tuple[pa.Table, list[BadRecord], list[int]] | None:
    """The chunk through pyarrow's reader, or None when a record needs the slow path
    (`errors` gets the reader's complaint)."""
    buf = b"\n".join(values)  # type: ignore[arg-type]
    # one record per line: no newline inside a value (counted on the joined buffer, at
    # memchr speed, instead of a Python test per value)
    if not newlines and (buf.count(b"\n") != len(values) - 1 or b"\r" in buf):
        return None
    if not _objects_only(values, buf, newlines):
        return None
    # pyarrow's JSON reader does not parse dates: read them as strings and cast after.
    read_schema = pa.schema([pa.field(f.name, pa.string()) if pa.types.is_date(f.type) else f
                             for f in target])
    try:
        _check_utf8(buf)  # pyarrow passes invalid UTF-8 through into string columns
        table = pajson.read_json(
            io.BytesIO(buf),
            read_options=pajson.ReadOptions(use_threads=False,
                                            block_size=max(1 << 20, len(buf) + 1)),
            parse_options=pajson.ParseOptions(explicit_schema=read_schema,
                                              unexpected_field_behavior="ignore",
                                              newlines_in_values=newlines))
        if table.num_rows != len(values):
            return None
        table = table.select(target.names).cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        if errors is not None:
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    if not table.schema.equals(target):
        return None
    why = _unfit_value(table, target)
    if why is not None:
        if errors is not None:
            errors.append(why)
        return None
    good = list(range(len(values)))
    if NUL_ESCAPE not in buf:  # one memchr-speed scan; the usual case ends here
        return table, [], good
    return _drop_nul_rows(table, target)


def _objects_only(values: Sequence[bytes | None], buf: bytes, newlines: bool) -> bool:
    """Whether every value starts with `{` and ends with `}`. pyarrow's reader skips a blank
    line, reads `{..}{..}` as two rows and continues an object left open on the next line
    (JSON needs a `,` or `}` after a `}`, so a line ending in `}` cannot be continued by one
    starting with `{`): only then does its row count prove that row i is value i. It also
    crashes on a first line of `null`. Anything else (blank, `null`, a BOM, surrounding
    space, an array) goes to the slow path, which names it or parses it."""
    if newlines:  # one record, possibly spread over lines (`_parse_deep`)
        return all(v is not None and v.lstrip()[:1] == b"{" and v.rstrip()[-1:] == b"}"
                   for v in values)
    lengths = np.fromiter(map(len, values), dtype=np.int64,  # type: ignore[arg-type]
                          count=len(values))
    if not len(lengths) or lengths.min() == 0:
        return False
    starts = np.empty(len(lengths), dtype=np.int64)
    starts[0] = 0
    np.cumsum(lengths[:-1] + 1, out=starts[1:])
    raw = np.frombuffer(buf, dtype=np.uint8)
    return bool(np.all(raw[starts] == ord("{")) and np.all(raw[starts + lengths - 1] == ord("}")))


def _unfit_value(table: pa.Table, target: pa.Schema) -> str | None:
    """What pyarrow's reader lets through but the declared type or JSON does not hold: NaN
    and Infinity (not JSON; an infinite float is an overflow), a decimal with more digits
    than its precision (pyarrow checks the digits as written, not after scaling), a date or
    timestamp in year 0 (pyarrow reads it, Python's datetime does not)."""
    for f in target:
        col = table.column(f.name)
        if pa.types.is_floating(f.type):
            if pc.any(pc.or_(pc.is_nan(col), pc.is_inf(col))).as_py():
                return f"field {f.name!r}: NaN, Infinity or a number that overflows {f.type}"
        elif pa.types.is_decimal(f.type):
            try:
                col.validate(full=True)
            except pa.ArrowInvalid as e:
                return f"field {f.name!r}: {e}"
        elif pa.types.is_timestamp(f.type) or pa.types.is_date(f.type):
            lo, hi = _YEARS_1_TO_9999[pa.types.is_date(f.type)]
            if pc.any(pc.or_(pc.less(col, pa.scalar(lo, f.type)),
                             pc.greater(col, pa.scalar(hi, f.type)))).as_py():
                return f"field {f.name!r}: outside years 1-9999"
    return None


# what Python's datetime (the slow path) holds; pyarrow also reads year 0
_YEARS_1_TO_9999 = {
    False: (datetime(1, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)),
    True: (date(1, 1, 1), date(9999, 12, 31))}


def _check_utf8(buf: bytes) -> None:
    """Raise ArrowInvalid if `buf` is not UTF-8 (Arrow's vectorised validation, no copy)."""
    offsets = pa.py_buffer(np.array([0, len(buf)], dtype=np.int32).tobytes())
    pa.StringArray.from_buffers(1, offsets, pa.py_buffer(buf)).validate(full=True)


def _drop_nul_rows(table: pa.Table, target: pa.Schema
                   ) -> tuple[pa.Table, list[BadRecord], list[int]]:
    reasons: dict[int, str] = {}
    for f in target:
        if not pa.types.is_string(f.type):
            continue
        hit = pc.fill_null(pc.match_substring(table.column(f.name), "\x00"), False)
        for i in np.flatnonzero(np.asarray(hit.to_numpy(zero_copy_only=False))):
            reasons.setdefault(int(i), f"field {f.name!r}: contains a NUL character "
                                       f"(\\u0000), which PostgreSQL text cannot store")
    if not reasons:
        return table, [], list(range(table.num_rows))
    keep = np.ones(table.num_rows, dtype=bool)
    keep[list(reasons)] = False
    bad = [BadRecord(i, r) for i, r in sorted(reasons.items())]
    return table.filter(pa.array(keep)), bad, [int(i) for i in np.flatnonzero(keep)]
