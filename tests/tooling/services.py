"""A watch on the local stack's long-lived services during a test session.

Fault tests kill the broker and crash PostgreSQL on purpose and start them again before they
end. A service that dies for any other reason (a full disk, the kernel's OOM killer) used to
show only as every later test failing on `Connection refused`: a CI run of 650 tests ended
with hundreds of failures and no cause. After each integration test this module checks the
broker's and PostgreSQL's processes; for one that is gone it gathers why (the end of its
log, free disk, free memory) so the test that saw it die fails with the cause, then starts
the service again so later tests run on a live one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the stack the tests talk to: make test runs the fault tests on a second one
STATE = Path(os.environ.get("OFFSETFLOW_STACK_DIR") or ROOT / ".stack")
STACK = ROOT / "include" / "stack" / "stack.sh"
# lines of a service's log worth showing when it died: Kafka's and the JVM's fatal ones, a
# full disk, PostgreSQL's PANIC/FATAL
_CAUSE = re.compile(r"\b(FATAL|PANIC|ERROR)\b|No space left|OutOfMemory|IOException|"
                    r"insufficient memory|shutting down|halt(ing)?\b")


@dataclass(frozen=True)
class Service:
    name: str
    pid_file: Path
    logs: tuple[Path, ...]
    start: str  # the stack.sh command that starts it again


SERVICES = (
    Service("kafka", STATE / "kafka" / "kafka.pid",
            (STATE / "kafka" / "kafka.log", STATE / "kafka" / "stdout.log"), "kafka-start"),
    Service("postgres", STATE / "pg" / "data" / "postmaster.pid",
            (STATE / "pg" / "postgres.log",), "pg-start"),
)


def _alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    # a killed process not yet reaped is gone once all its threads are zombies (its main
    # thread is one before the others have exited)
    for task in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            stat = task.read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] not in "ZX":
            return True
    return False


@dataclass
class Watch:
    """The services this session's stack runs (their pid files exist when it starts), and
    where each log ended then: a diagnosis shows only what the session wrote."""
    services: list[Service]
    log_offsets: dict[Path, int]

    def dead(self) -> list[Service]:
        return [s for s in self.services if not _alive(s.pid_file)]

    def diagnose(self, service: Service) -> str:
        """Why `service` is gone, as far as its logs, the disk and the memory tell."""
        lines = [f"{service.name} is no longer running ({service.pid_file} names no live "
                 f"process); {disk_and_memory()}"]
        for log in service.logs:
            causes = [ln for ln in self._since_start(log) if _CAUSE.search(ln)][-12:]
            if causes:
                lines.append(f"last error lines of {log.relative_to(ROOT)}:")
                lines.extend(f"  {ln[:400]}" for ln in causes)
        return "\n".join(lines)

    def restart(self, service: Service) -> str | None:
        """Start `service` again; None when it is up, else what the stack said. Its next
        diagnosis starts after what the restart logged."""
        p = subprocess.run(["bash", str(STACK), service.start], capture_output=True,
                           text=True, timeout=300)
        for log in service.logs:
            self.log_offsets[log] = _size(log)
        return None if p.returncode == 0 else (p.stderr or p.stdout)[-3000:]

    def _since_start(self, log: Path) -> list[str]:
        try:
            with log.open("rb") as f:
                f.seek(0, os.SEEK_END)
                end = f.tell()
                start = self.log_offsets.get(log, 0)
                f.seek(max(start if start <= end else 0, end - 512 * 1024))
                return f.read().decode(errors="replace").splitlines()
        except OSError:
            return []


def watch() -> Watch:
    services = [s for s in SERVICES if s.pid_file.exists()]
    return Watch(services, {log: _size(log) for s in services for log in s.logs})


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def disk_and_memory() -> str:
    parts = []
    for label, path in (("project", ROOT), ("/tmp", Path("/tmp"))):
        u = shutil.disk_usage(path)
        parts.append(f"free disk at {label}: {u.free / 2**30:.1f} GiB of {u.total / 2**30:.0f}")
    try:
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        parts.append(f"MemAvailable {int(mem['MemAvailable'].split()[0]) // 1024} MiB")
    except (OSError, KeyError, ValueError):
        pass
    return "; ".join(parts)
