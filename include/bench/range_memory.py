"""Peak memory of one OffsetFlow task reading a range, by range size (run by bench.py).

    python include/bench/range_memory.py TOPIC PARTITION UNTIL_OFFSET [--tasks K]

One fresh process per size runs exactly what a Spark task of the fused path runs (read the
range chunk by chunk, parse, encode for binary COPY; the COPY itself is left out, it holds one
chunk) and prints {"records": n, "peak_rss_mb": x}. If memory grew with the range, the peak
would grow with UNTIL_OFFSET; streaming keeps it at about one chunk.

With `--tasks K` one process runs K such tasks in a row, as a reused Spark Python worker
does, and prints its RSS and the bytes Arrow still holds after each: if a task left data
behind, both would climb with K.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from typing import Any

import pyarrow as pa
from engines import SCHEMA

from offsetflow.config import parse_pipeline
from offsetflow.job.tasks import ReadContext, read_subrange, stage_columns
from offsetflow.ranges import OffsetRange
from offsetflow.stage import TaskClock, binary_encoder
from offsetflow.stage.metrics import current_rss_mb


def _peak_rss_mb() -> float:
    """This process's own high-water mark. Not `ru_maxrss`: Linux carries the parent's RSS
    into it across fork and exec, so a probe started by a large parent reads the parent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(topic: str, partition: int, until_offset: int, tasks: int = 1) -> dict[str, Any]:
    raw = {"name": "range_memory", "source": {"topics": [topic]},
           "kafka": {"bootstrap_servers": os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP",
                                                         "127.0.0.1:19092")},
           "format": {"type": "json", "schema": dict(SCHEMA)},
           "sink": {"connection": "postgresql://unused@127.0.0.1:1/unused",
                    "table": "range_memory"}}
    cfg = parse_pipeline(raw, "<range memory>", {})
    encode = binary_encoder([t for _, t in stage_columns(cfg)])
    rss_after: list[float] = []
    arrow_held: list[float] = []
    for _ in range(tasks):
        r = OffsetRange(topic, partition, 0, until_offset)
        rc = ReadContext.of(cfg, 0, cfg.sink.connection, [r.to_dict()])
        n = 0
        for batch in read_subrange(rc, 0, TaskClock()):
            encode(batch)
            n += batch.num_rows
        if n != until_offset:
            raise RuntimeError(f"{topic}[{partition}]: read {n} records of [0, {until_offset})")
        del rc
        gc.collect()
        rss_after.append(current_rss_mb() or 0.0)
        arrow_held.append(round(pa.total_allocated_bytes() / 2**20, 1))
    out: dict[str, Any] = {"records": until_offset, "peak_rss_mb": _peak_rss_mb()}
    if tasks > 1:
        out.update(tasks=tasks, rss_mb_after_task=rss_after, arrow_held_mb_after_task=arrow_held)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("topic")
    ap.add_argument("partition", type=int)
    ap.add_argument("until_offset", type=int)
    ap.add_argument("--tasks", type=int, default=1, help="tasks in a row in this process")
    a = ap.parse_args()
    print(json.dumps(main(a.topic, a.partition, a.until_offset, a.tasks)))
