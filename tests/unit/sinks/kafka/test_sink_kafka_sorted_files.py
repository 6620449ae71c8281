"""The sorted read of a batch's task files (review finding 1): source order across parts
without the whole batch in the driver's memory."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from offsetflow.sinks.kafka.sink import FileParts
from offsetflow.sinks.kafka.taskfile import FILE_SCHEMA, PartFile

PARTS, PER_PART, VALUE = 8, 4_000, b"v" * 400


def test_the_sorted_read_from_files_is_in_source_order_in_bounded_memory(
        tmp_path: Path) -> None:
    """Eight parts each holding every other offset of two partitions in reverse (a packed
    layout no unsorted read can follow): read sorted, every record once in source order,
    and Arrow's allocations stay well under the batch's size (~13 MB of records)."""
    entries = {}
    for part in range(PARTS):
        f = PartFile(str(tmp_path), "L", 1, part)
        offs = [o for o in range(PARTS * PER_PART // 2) if o % PARTS == part][::-1]
        n = len(offs)
        f.write(pa.RecordBatch.from_pydict({
            "topic": ["t"] * 2 * n, "partition": [0] * n + [1] * n, "offset": offs * 2,
            "key": [None] * 2 * n, "value": [VALUE] * 2 * n, "headers": [None] * 2 * n,
            "ts": [None] * 2 * n}, schema=FILE_SCHEMA))
        entries[part] = f.close()
    src = FileParts(1, [(p, None) for p in range(PARTS)], entries, ordered=True)
    base, peak, got = pa.total_allocated_bytes(), 0, []
    for chunk in src.chunks():
        peak = max(peak, pa.total_allocated_bytes() - base)
        got.extend((r[1], r[2]) for r in chunk)
    half = PARTS * PER_PART // 2
    assert got == [(0, o) for o in range(half)] + [(1, o) for o in range(half)]
    batch_bytes = PARTS * PER_PART * len(VALUE)
    assert peak < batch_bytes / 4, (peak, batch_bytes)
