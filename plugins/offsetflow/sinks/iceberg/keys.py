"""The Iceberg upsert's pure key and window selection (`sink_iceberg_upsert`, step 2): which
files a chunk of keys may touch (a pyiceberg filter) and which rows of a file it or a
replay's window selects (a mask); supersets, the exact match is made in SQL."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offsetflow.ledger import Batch

COORDINATES = ("topic", "partition", "offset")


# key types whose Python values pyiceberg takes as literals of the column's type
_FILTERABLE = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer,
               pa.types.is_binary, pa.types.is_large_binary)


def key_filter(key: Sequence[str], keys: pa.Table) -> Any:
    """A pyiceberg row filter that holds for every row whose key is in `keys` (per column:
    in its values and between their least and greatest, so file statistics can rule files
    out even when the value list is too long for them); a superset for several columns."""
    from pyiceberg import expressions

    ex: Any = expressions
    terms = []
    for k in key:
        col = keys.column(k)
        if not any(f(col.type) for f in _FILTERABLE):  # e.g. timestamps: no pruning by it
            continue
        values = set(col.to_pylist())
        lo, hi = pc.min_max(col).values()
        terms += [ex.In(k, values), ex.GreaterThanOrEqual(k, lo.as_py()),
                  ex.LessThanOrEqual(k, hi.as_py())]
    if not terms:
        return ex.AlwaysTrue()
    out = terms[0]
    for t in terms[1:]:
        out = ex.And(out, t)
    return out


def key_mask(rows: pa.Table, key: Sequence[str], keys: pa.Table) -> np.ndarray:
    """Rows whose every key column is among `keys`' values (a superset for several columns;
    the exact match is made in SQL). Float zeros compare as PostgreSQL does (-0.0 = 0.0);
    NaN matches NaN, as in PostgreSQL."""
    mask = np.ones(rows.num_rows, dtype=bool)
    for k in key:
        col = rows.column(k)
        values = keys.column(k).cast(col.type)
        if pa.types.is_floating(col.type):  # PostgreSQL's -0.0 = 0.0: x + 0.0 is +0.0
            col, values = pc.add(col, 0.0), pc.add(values, 0.0)
        mask &= pc.is_in(col, value_set=values).fill_null(False).to_numpy(
            zero_copy_only=False)
    return mask


def window_mask(rows: pa.Table, batch: Batch) -> np.ndarray:
    """Rows at coordinates of the batch's ranges."""
    mask = np.zeros(rows.num_rows, dtype=bool)
    topic, part, off = (rows.column(c) for c in COORDINATES)
    for r in batch.ranges:
        m = pc.and_(pc.and_(pc.equal(topic, r.topic), pc.equal(part, r.partition)),
                    pc.and_(pc.greater_equal(off, r.from_offset),
                            pc.less(off, r.until_offset)))
        mask |= m.fill_null(False).to_numpy(zero_copy_only=False)
    return mask
