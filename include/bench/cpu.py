"""CPU time of a run, by process class: where the machine's cores went.

A run on this 2-core machine is CPU-bound; its wall time cannot be lower than the CPU every
process needs divided by the cores. This sampler adds up user + system time (from
/proc/<pid>/stat through psutil) during a run for:

- the engine's own process tree: the driver (the process that starts the run), the Spark
  JVM (every `java` in the tree) and the Spark Python workers;
- the local stack's services, found by their pid files under `.stack/`: PostgreSQL (the
  postmaster and its backends), the Kafka broker and the Spark Connect server (with its
  Python workers) when it runs.

Processes are sampled every `interval` s (the sampler's own time counts as `driver`); a
process that exits between two samples loses at most its last interval. A run returns the
`window` it timed, so set-up and verification outside it are not counted. Other processes
on the machine are reported apart as `other`, so a busy neighbour shows in the figures.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil
from report import CPU_CLASSES as CLASSES
from rss import PY_WORKER_MARKERS, Sampler

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


class CpuUse(Sampler):
    """Context manager: core-seconds per class (`CLASSES`) while it is open."""

    def __init__(self, roots: Iterable[int], interval: float = 0.25,
                 stack: Path = STACK) -> None:
        super().__init__()
        self.roots = list(roots)
        self.interval = interval
        self.stack = stack
        # (time.perf_counter(), {pid: (class, cpu seconds so far)}) per sample
        self._samples: list[tuple[float, dict[int, tuple[str, float]]]] = []

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

    def _sample(self) -> None:
        known = self._classes()
        now: dict[int, tuple[str, float]] = {}
        for p in psutil.process_iter():
            try:
                t = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            now[p.pid] = (known.get(p.pid, "other"), t.user + t.system)
        self._samples.append((time.perf_counter(), now))

    def as_dict(self, window: Sequence[float] | None = None) -> dict[str, float]:
        """Core-seconds per class between the samples nearest the window's start and end
        (`time.perf_counter()` values; the whole time open without one). A process that
        started in between counts from zero; one that ended counts up to its last sample."""
        samples = self._samples
        if window is not None:
            t0, t1 = window
            inside = [s for s in samples if t0 - self.interval <= s[0] <= t1 + self.interval]
            samples = inside if len(inside) >= 2 else samples
        total: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
        if len(samples) < 2:
            return {}
        first = samples[0][1]
        last: dict[int, tuple[str, float]] = {}
        for _, procs in samples:
            last.update(procs)
        for pid, (cls, used) in last.items():
            start = first[pid][1] if pid in first else 0.0
            total[cls] += max(used - start, 0.0)
        return {k: round(v, 2) for k, v in total.items() if v >= 0.005}
