"""CPU time of a run, by process class: where the machine's cores went.

A run on this 2-core machine is CPU-bound; its wall time cannot be lower than the CPU every
process needs divided by the cores. This sampler adds up user + system time (from
/proc/<pid>/stat through psutil) during a run for:

- the engine's own process tree: the driver (the process that starts the run), the Spark
  JVM (every `java` in the tree) and the Spark Python workers;
- the local stack's services, found by their pid files under `.stack/`: PostgreSQL (the
  postmaster and its backends), the Kafka broker and the Spark Connect server (with its
  Python workers) when it runs.

Processes are sampled every `interval` s; a process that exits between two samples loses
at most its last interval. Other processes on the machine are left out (and reported as
`other`, so a busy neighbour shows up in the figures).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import psutil
from report import CPU_CLASSES as CLASSES
from rss import PY_WORKER_MARKERS

STACK = Path(__file__).resolve().parents[2] / ".stack"


def _pid_from(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _tree(pid: int | None) -> list[psutil.Process]:
    if pid is None:
        return []
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


class CpuUse:
    """Context manager: core-seconds per class (`CLASSES`) while it is open."""

    def __init__(self, roots: Iterable[int], interval: float = 0.1,
                 stack: Path = STACK) -> None:
        self.roots = list(roots)
        self.interval = interval
        self.stack = stack
        self._start: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cpu-use")

    def __enter__(self) -> CpuUse:
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _classes(self) -> dict[int, str]:
        """pid -> class for the processes of interest now (the stack's first: a Spark
        Connect server's workers are `spark_connect`, not the engine's)."""
        out: dict[int, str] = {}
        for p in _tree(_pid_from(self.stack / "pg" / "data" / "postmaster.pid")):
            out[p.pid] = "postgres"
        for p in _tree(_pid_from(self.stack / "kafka" / "kafka.pid")):
            out[p.pid] = "kafka"
        for p in _tree(_pid_from(self.stack / "connect" / "connect.pid")):
            out[p.pid] = "spark_connect"
        for root in self.roots:
            for p in _tree(root):
                if p.pid in out:
                    continue
                try:
                    cmd = " ".join(p.cmdline())
                    name = p.name()
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                if any(m in cmd for m in PY_WORKER_MARKERS):
                    out[p.pid] = "python_workers"
                elif name == "java" or cmd.startswith("java ") or "/java " in cmd:
                    out[p.pid] = "spark_jvm"
                else:
                    out[p.pid] = "driver"
        return out

    def _sample(self, first: bool = False) -> None:
        known = self._classes()
        for p in psutil.process_iter(["pid"]):
            try:
                t = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            used = t.user + t.system
            cls = known.get(p.pid, "other")
            if first:
                self._start[p.pid] = used
            elif p.pid not in self._start and p.pid not in self._last:
                # started during the run: it counts from zero
                self._start[p.pid] = 0.0
            self._last[p.pid] = (cls, used)

    def as_dict(self) -> dict[str, float]:
        """Core-seconds per class, rounded; classes with nothing are left out."""
        total: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        for pid, (cls, used) in self._last.items():
            total[cls] += max(used - self._start.get(pid, 0.0), 0.0)
        return {k: round(v, 2) for k, v in total.items() if v >= 0.005}
