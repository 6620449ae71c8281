"""Peak memory of one OffsetFlow task reading a range, by range size (run by bench.py).

    python include/bench/range_memory.py TOPIC PARTITION UNTIL_OFFSET

One fresh process per size runs exactly what a Spark task of the fused path runs (read the
range chunk by chunk, parse, encode for binary COPY; the COPY itself is left out, it holds one
chunk) and prints {"records": n, "peak_rss_mb": x}. If memory grew with the range, the peak
would grow with UNTIL_OFFSET; streaming keeps it at about one chunk.
"""

from __future__ import annotations

import json
import os
import resource
import sys

from engines import SCHEMA

from offsetflow.config import parse_pipeline
from offsetflow.job import ReadContext, read_subrange, stage_columns
from offsetflow.metrics import TaskClock
from offsetflow.ranges import OffsetRange
from offsetflow.sink import binary_encoder


def main(topic: str, partition: int, until_offset: int) -> dict[str, float]:
    raw = {"name": "range_memory", "source": {"topics": [topic]},
           "kafka": {"bootstrap_servers": os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP",
                                                         "127.0.0.1:19092")},
           "format": {"type": "json", "schema": dict(SCHEMA)},
           "sink": {"connection": "postgresql://unused@127.0.0.1:1/unused",
                    "table": "range_memory"}}
    cfg = parse_pipeline(raw, "<range memory>", {})
    r = OffsetRange(topic, partition, 0, until_offset)
    rc = ReadContext.of(cfg, 0, cfg.sink.connection, [r.to_dict()])
    encode = binary_encoder([t for _, t in stage_columns(cfg)])
    n = 0
    for batch in read_subrange(rc, 0, TaskClock()):
        encode(batch)
        n += batch.num_rows
    if n != until_offset:
        raise RuntimeError(f"{topic}[{partition}]: read {n} records of [0, {until_offset})")
    return {"records": n,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
