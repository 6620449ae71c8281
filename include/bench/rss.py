"""Peak resident memory of a process tree, sampled in a background thread."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Self

import psutil

PY_WORKER_MARKERS = ("pyspark.daemon", "pyspark.worker", "pyspark/daemon", "pyspark/worker")


class Sampler:
    """Calls `_sample` on entry, every `interval` s in a background thread, and on exit."""

    interval = 0.1

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=type(self).__name__)

    def __enter__(self) -> Self:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        raise NotImplementedError


class PeakRss(Sampler):
    """Samples every `interval` s: the sum over the trees of `roots` (this process by
    default) and the largest single Spark Python worker. The per-worker peak is what would
    grow if a range were collected in memory; the tree total includes the JVM heap."""

    def __init__(self, roots: Iterable[int] = (), interval: float = 0.1) -> None:
        super().__init__()
        self.roots = list(roots) or [psutil.Process().pid]
        self.interval = interval
        self.peak_total = 0
        self.peak_worker = 0

    def _sample(self) -> None:
        total = 0
        for root in self.roots:
            try:
                r = psutil.Process(root)
                procs = [r, *r.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    rss = p.memory_info().rss
                    total += rss
                    if any(m in " ".join(p.cmdline()) for m in PY_WORKER_MARKERS):
                        self.peak_worker = max(self.peak_worker, rss)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
        self.peak_total = max(self.peak_total, total)

    def as_dict(self) -> dict[str, float]:
        return {"peak_rss_mb": round(self.peak_total / 2**20, 1),
                "peak_py_worker_rss_mb": round(self.peak_worker / 2**20, 1)}
