"""The sorted read of a batch's task files (review finding 1): source order across parts
without the whole batch in the driver's memory, in time linear in the batch's bytes."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from offsetflow.sinks.kafka import sink
from offsetflow.sinks.kafka.sink import FileParts
from offsetflow.sinks.kafka.taskfile import FILE_SCHEMA, PartFile

# each part as a task writes it: one IPC record batch per write call, many of them
PARTS, PER_PART, WRITES, VALUE = 8, 20_000, 50, b"v" * 300
# this read's own allocation counts; never freed (a buffer it allocated may outlive the test)
POOL = pa.proxy_memory_pool(pa.default_memory_pool())


def _write_parts(directory: Path) -> dict[int, dict[str, object]]:
    """Eight parts each holding every other offset of two partitions in reverse (a packed
    layout no unsorted read can follow), each part in WRITES record batches."""
    entries = {}
    for part in range(PARTS):
        f = PartFile(str(directory), "L", 1, part)
        offs = [o for o in range(PARTS * PER_PART // 2) if o % PARTS == part][::-1]
        rows = [(1, o) for o in offs] + [(0, o) for o in offs]  # partition 1 first
        step = -(-len(rows) // WRITES)
        for i in range(0, len(rows), step):
            w = rows[i:i + step]
            f.write(pa.RecordBatch.from_pydict({
                "topic": ["t"] * len(w), "partition": [p for p, _o in w],
                "offset": [o for _p, o in w], "key": [None] * len(w),
                "value": [VALUE] * len(w), "headers": [None] * len(w),
                "ts": [None] * len(w)}, schema=FILE_SCHEMA))
        entries[part] = f.close()
    return entries


def test_the_sorted_read_from_files_is_in_source_order_in_bounded_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read sorted, every record once in source order; the memory Arrow and Python hold at
    any time stays under ONE part's bytes (~6 MB of the batch's ~48 MB), and the bytes
    Arrow allocates over the whole read are linear in the batch's (a `take` of a few rows
    from a table of many record batches copies every batch of it: apache/arrow#39565;
    counted in bytes, not timed, so the test cannot be flaky)."""
    monkeypatch.setattr(sink, "CURSOR_ROWS", 1_000)  # the rows Python holds: a chunk's
    entries = _write_parts(tmp_path)
    assert all(e["records"] == PER_PART for e in entries.values())
    src = FileParts(1, [(p, None) for p in range(PARTS)], entries, ordered=True)
    half = PARTS * PER_PART // 2
    want: Iterator[tuple[int, int]] = iter([(0, o) for o in range(half)]
                                           + [(1, o) for o in range(half)])
    pool = POOL
    pa.set_memory_pool(pool)
    used, total = pool.bytes_allocated(), pool.total_bytes_allocated()
    tracemalloc.start()
    try:
        base, n = tracemalloc.get_traced_memory()[0], 0
        for chunk in src.chunks():
            for r in chunk:
                assert (r[1], r[2]) == next(want), (n, r[:3])
                n += 1
            del chunk, r
        py_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(pa.default_memory_pool())
    assert n == PARTS * PER_PART and next(want, None) is None
    part_bytes = PER_PART * len(VALUE)
    batch_bytes = PARTS * part_bytes
    arrow_peak, allocated = pool.max_memory() - used, pool.total_bytes_allocated() - total
    assert arrow_peak + py_peak < part_bytes, (arrow_peak, py_peak, part_bytes)
    assert allocated < 3 * batch_bytes, (allocated, batch_bytes)
