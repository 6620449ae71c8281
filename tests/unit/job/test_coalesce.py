"""A packed task's small chunks are staged as one COPY (offsetflow.job.tasks.coalesced)."""

from __future__ import annotations

import pyarrow as pa

from offsetflow.job.tasks import coalesced
from offsetflow.source import MAX_CHUNK_ROWS


def chunk(n: int, start: int = 0, name: str = "offset") -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({name: pa.array(range(start, start + n), pa.int64())})


def test_small_chunks_of_successive_ranges_become_one_in_order() -> None:
    out = list(coalesced(iter([chunk(10, 10 * i) for i in range(5)])))
    assert [b.num_rows for b in out] == [50]
    assert out[0].column("offset").to_pylist() == list(range(50))


def test_a_full_chunk_is_never_joined_and_the_row_bound_holds() -> None:
    out = list(coalesced(iter([chunk(10), chunk(MAX_CHUNK_ROWS), chunk(10), chunk(10)])))
    assert [b.num_rows for b in out] == [10, MAX_CHUNK_ROWS, 20]


def test_chunks_of_another_schema_are_not_joined() -> None:
    out = list(coalesced(iter([chunk(3), chunk(3, name="other"), chunk(3, name="other")])))
    assert [(b.schema.names[0], b.num_rows) for b in out] == [("offset", 3), ("other", 6)]
    assert list(coalesced(iter([]))) == []
