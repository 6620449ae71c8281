"""A user transform that fails the first attempt of one task halfway through its rows, the
way a flaky executor would. Spark retries the task; staging must not count rows twice."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa


def fail_first_attempt_midway(df: Any) -> Any:
    def gen(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        seen = 0
        for b in batches:
            seen += b.num_rows
            yield b
            if ctx is not None and ctx.attemptNumber() == 0 and ctx.partitionId() % 2 == 0 \
                    and seen >= 20:
                raise RuntimeError(f"flaky transform: failing attempt 0 after {seen} rows")

    return df.mapInArrow(gen, df.schema)
