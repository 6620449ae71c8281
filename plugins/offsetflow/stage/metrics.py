"""Per-task time accounting, so a batch's wall time can be split into read / parse / stage.

Inside a Spark task the stages are interleaved (a chunk is read, parsed and staged before the
next is read), so wall-clock stage times do not exist there; task-seconds per stage do.
Tasks log them; when `OFFSETFLOW_TASK_METRICS_DIR` is set (the benchmark sets it) each task
also writes them as one small JSON file, which works for local and Spark Connect servers on
the same machine.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_DIR_ENV = "OFFSETFLOW_TASK_METRICS_DIR"


class TaskClock:
    """Accumulates seconds per named stage of one task."""

    def __init__(self, ignore: tuple[str, ...] = ()) -> None:
        self.ignore = ignore
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        if name in self.ignore:
            return
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def emit(self, batch_id: int, kind: str, part: int) -> None:
        doc: dict[str, Any] = {"batch_id": batch_id, "kind": kind, "part": part,
                               "pid": os.getpid(), "t": round(time.time(), 3),
                               "rss_mb": current_rss_mb(),
                               "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                               "counts": self.counts}
        log.info("batch %d %s task %d: %s", batch_id, kind, part, doc["seconds"])
        where = os.environ.get(METRICS_DIR_ENV)
        if not where:
            return
        try:
            d = Path(where)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"b{batch_id}-{kind}-{part}-{uuid.uuid4().hex[:8]}.json").write_text(
                json.dumps(doc))
        except OSError as e:  # metrics must never fail a batch
            log.warning("could not write task metrics to %s: %s", where, e)


def current_rss_mb() -> float | None:
    """Resident memory of this process now (not its peak: Spark reuses Python workers, so a
    worker's RSS at the end of each task shows whether tasks leave memory behind)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):  # not Linux
        return None
    return round(resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def load_task_metrics(directory: Path) -> list[dict[str, Any]]:
    """Every task document written to `directory`."""
    return [json.loads(f.read_text()) for f in directory.glob("b*.json")]


def read_task_metrics(directory: Path, batch_id: int) -> dict[str, float]:
    """Sum the task-seconds per stage that the tasks of `batch_id` wrote."""
    total: dict[str, float] = {}
    for f in directory.glob(f"b{batch_id}-*.json"):
        doc = json.loads(f.read_text())
        for k, v in doc["seconds"].items():
            total[k] = total.get(k, 0.0) + float(v)
    return {k: round(v, 3) for k, v in total.items()}
