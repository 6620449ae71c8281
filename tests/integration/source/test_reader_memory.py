"""A Spark Python worker's memory stays flat over the tasks it runs (issue 19: "peak memory per
task unchanged at 10M records").

Every range a task reads starts a consumer, and librdkafka's threads (a main thread, one per
broker) each got a glibc malloc arena of their own, up to 8 per core. Memory freed in an arena
mostly stays mapped, so a reused worker carried 100-150 MB of them over its ~300 MB: at 10M
records (100 tasks) the largest worker peaked at 480-514 MB against 412 at 1M. The reader caps
the arenas (`reader.MALLOC_ARENAS`) before its first consumer; this counts them in the
workers of a real Spark local[2] after tasks that read real Kafka ranges.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from offsetflow.ranges import OffsetRange
from offsetflow.source.reader import MALLOC_ARENAS
from tests.tooling.pipeline_data import produce_plain

TASKS = 8
RANGES_PER_TASK = 3
RECORDS = 6_000  # per partition


def test_reader_caps_the_malloc_arenas_of_a_worker_that_runs_many_tasks(
        spark: Any, kafka_bootstrap: str, make_topic: Callable[..., str]) -> None:
    topic = make_topic("mem", partitions=RANGES_PER_TASK)
    produce_plain(kafka_bootstrap, topic, RECORDS * RANGES_PER_TASK, "mem", RANGES_PER_TASK)
    conf = {"bootstrap.servers": kafka_bootstrap, "group.id": "offsetflow-mem",
            "enable.auto.commit": "false", "auto.offset.reset": "error",
            "enable.partition.eof": "true"}
    ranges = [OffsetRange(topic, p, 0, RECORDS).to_dict() for p in range(RANGES_PER_TASK)]

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import ctypes
        import tempfile

        from offsetflow.source import read_range

        for b in batches:
            n = 0
            for _ in b.column("id").to_pylist():
                for spec in ranges:  # a consumer of its own per range, as a large range has
                    n += sum(len(c) for c in read_range(conf, OffsetRange.from_dict(spec)))
            libc = ctypes.CDLL(None)
            libc.fopen.restype = ctypes.c_void_p
            libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
            libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
            libc.fclose.argtypes = [ctypes.c_void_p]
            with tempfile.NamedTemporaryFile(suffix=".xml") as f:
                fp = libc.fopen(f.name.encode(), b"w")
                libc.malloc_info(0, fp)
                libc.fclose(fp)
                heaps = f.read().count(b"<heap nr=")
            yield pa.RecordBatch.from_pylist(
                [{"pid": os.getpid(), "records": n, "arenas": heaps}],
                schema=pa.schema([("pid", pa.int64()), ("records", pa.int64()),
                                  ("arenas", pa.int64())]))

    rows = (spark.range(TASKS, numPartitions=TASKS)
            .mapInArrow(task, "pid long, records long, arenas long").collect())
    assert [r.records for r in rows] == [RECORDS * RANGES_PER_TASK] * TASKS
    # before the first consumer a worker may hold an arena of pyarrow's or Spark's threads
    worst = max(r.arenas for r in rows)
    assert worst <= MALLOC_ARENAS + 1, (
        f"a Spark Python worker holds {worst} malloc arenas after reading "
        f"{RANGES_PER_TASK} ranges per task ({sorted((r.pid, r.arenas) for r in rows)})")
