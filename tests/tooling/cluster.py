"""The local Spark standalone cluster and three-broker Kafka cluster for tests and the bench.

Starts and stops them with include/stack/stack.sh (each daemon in its own process group, so a
stop leaves no JVM behind), reads which executors ran tasks from Spark's event log, and finds
the Python interpreters the executors really run, so a test can prove they came from the
shipped archive and not from the repo's virtualenv.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "include" / "stack" / "stack.sh"
STATE = Path(os.environ.get("OFFSETFLOW_STACK_DIR") or ROOT / ".stack")
SPARK_CLUSTER = STATE / "spark-cluster"
KAFKA_CLUSTER = STATE / "kafka-cluster"
ENV_NAME = "environment"  # where spark.archives unpacks the executor environment


def stack(*args: str, timeout_s: float = 600) -> None:
    p = subprocess.run(["bash", str(STACK), *args], capture_output=True, text=True,
                       timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"stack.sh {' '.join(args)} failed:\n{p.stderr[-4000:]}")


def master_url() -> str:
    return os.environ.get("OFFSETFLOW_SPARK_MASTER_URL", "spark://127.0.0.1:17077")


def env_archive() -> str:
    return os.environ.get("OFFSETFLOW_SPARK_ENV_ARCHIVE",
                          str(STATE / "spark-env" / "offsetflow-env.tar.gz"))


def kafka_cluster_bootstrap() -> str:
    return os.environ.get("OFFSETFLOW_KAFKA_CLUSTER_BOOTSTRAP",
                          "127.0.0.1:17092,127.0.0.1:17094,127.0.0.1:17096")


def spark_conf(event_dir: Path, executors: int = 2) -> dict[str, str]:
    """A pipeline's `spark.conf` for the local cluster: one 1-core executor per worker, the
    packed environment shipped with spark.archives, its Python for the executors, and an
    event log to tell afterwards which executors ran tasks."""
    event_dir.mkdir(parents=True, exist_ok=True)
    return {
        "spark.archives": f"{env_archive()}#{ENV_NAME}",
        "spark.pyspark.python": f"./{ENV_NAME}/bin/python",
        "spark.executor.cores": "1",
        "spark.executor.memory": "512m",
        "spark.cores.max": str(executors),
        # the first tasks wait (up to 30 s) until every executor has registered
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": f"file://{event_dir}",
        # one plain JSON-lines file per app (Spark 4 rolls and compresses by default)
        "spark.eventLog.rolling.enabled": "false",
        "spark.eventLog.compress": "false",
        # a lost worker's tasks are rescheduled at once, not after the 120 s default
        "spark.network.timeout": "30s",
        "spark.network.timeoutInterval": "10s",
        "spark.executor.heartbeatInterval": "3s",
        # short executor JVMs on small data (as SPARK_SUBMIT_OPTS makes the drivers, tests/
        # conftest.py): C1 only and the serial collector halve what each one burns
        "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 "
                                           "-XX:+UseSerialGC",
    }


@contextmanager
def spark_cluster() -> Iterator[str]:
    """The packed environment (built if stale) and a running master with two workers; the
    cluster is stopped at the end only if it was started here."""
    was_up = (SPARK_CLUSTER / "master" / "pid").exists()
    stack("spark-env", timeout_s=900)
    try:
        stack("spark-cluster-start")
        yield master_url()
    finally:
        if not was_up:
            stack("spark-cluster-stop")
            left = cluster_processes()
            if left:
                raise RuntimeError(f"spark-cluster-stop left processes behind: {left}")


def cluster_processes() -> list[str]:
    """Processes of the local Spark cluster still running (daemons, executors, Python
    workers in its work directories)."""
    marks = (f"--work-dir {SPARK_CLUSTER}", f"SPARK_LOG_DIR={SPARK_CLUSTER}",
             "deploy.master.Master", "CoarseGrainedExecutorBackend")
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if cwd.startswith(str(SPARK_CLUSTER)) or (
                str(ROOT) in cmd and any(m in cmd for m in marks)):
            out.append(f"{d.name}: {cmd[:160]}")
    return out


@contextmanager
def kafka_cluster() -> Iterator[str]:
    was_up = (KAFKA_CLUSTER / "node1" / "kafka.pid").exists()
    try:
        stack("kafka-cluster-start")
        yield kafka_cluster_bootstrap()
    finally:
        if not was_up:
            stack("kafka-cluster-stop")


class SharedKafkaCluster:
    """The three-broker cluster for every test that asks for `kafka3` (tests/integration/
    conftest.py): started by the first `get()`, stopped by `stop()` after the last test that
    uses it (its two files run one after the other on one worker, tests/tooling/
    xdist_groups.py), so it starts once, not once per module, and idles beside no other
    file; a `get()` after a `stop()` starts it again."""

    def __init__(self) -> None:
        self._stack: ExitStack | None = None
        self._bootstrap: str | None = None

    def get(self) -> str:
        if self._bootstrap is None:
            stack = ExitStack()
            try:
                self._bootstrap = stack.enter_context(kafka_cluster())
            except BaseException:
                stack.close()
                raise
            self._stack = stack
        return self._bootstrap

    def stop(self) -> None:
        stack, self._stack, self._bootstrap = self._stack, None, None
        if stack is not None:
            stack.close()


def worker_pids() -> dict[int, int]:
    """worker number -> pid (= process group) of the running workers."""
    out: dict[int, int] = {}
    for d in sorted(SPARK_CLUSTER.glob("worker*")):
        pidf = d / "pid"
        if pidf.exists():
            pid = int(pidf.read_text().strip())
            if Path(f"/proc/{pid}").exists():
                out[int(d.name.removeprefix("worker"))] = pid
    return out


@dataclass(frozen=True)
class ExecutorPython:
    pid: int
    worker: int
    python: str  # argv[0] resolved against the process's working directory
    tasks_running: int  # forked task processes


def executor_pythons() -> list[ExecutorPython]:
    """The `pyspark.daemon` processes under the cluster's workers, with the interpreter each
    was started with (a relative ./environment/bin/python is resolved against its cwd)."""
    table: dict[int, tuple[int, list[str], str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        table[int(d.name)] = (int(stat[stat.rindex(")") + 2:].split()[1]), argv, cwd)
    workers = {pid: n for n, pid in worker_pids().items()}

    def worker_of(pid: int) -> int | None:
        for _ in range(64):
            if pid in workers:
                return workers[pid]
            if pid not in table or pid <= 1:
                return None
            pid = table[pid][0]
        return None

    found = []
    for pid, (ppid, argv, cwd) in table.items():
        parent_argv = table.get(ppid, (0, [""], ""))[1]
        if "pyspark.daemon" not in argv or "pyspark.daemon" in parent_argv:
            continue  # not a daemon, or a task process the daemon forked
        w = worker_of(pid)
        if w is None:
            continue
        children = sum(1 for p, (pp, _, _) in table.items() if pp == pid)
        found.append(ExecutorPython(pid, w, os.path.normpath(os.path.join(cwd, argv[0])),
                                    children))
    return found


def executor_commands(app_id: str) -> dict[str, str]:
    """Executor id -> the command line its worker started the executor JVM with, for one
    application: the first line of the executor's stderr in the worker's directory for the
    app (`Spark Executor Command: ...`). A worker deletes that directory about a minute after
    the app's last write (stack.sh: spark.worker.cleanup.appDataTtl): read it right after."""
    out: dict[str, str] = {}
    for f in sorted(SPARK_CLUSTER.glob(f"worker*/work/{app_id}/*/stderr")):
        first = f.read_text(errors="replace").split("\n", 1)[0]
        out[f.parent.name] = first.removeprefix("Spark Executor Command: ")
    return out


@dataclass
class EventLogSummary:
    app_id: str
    executor_worker: dict[str, str]  # executor id -> its worker's address (host:ui port)
    tasks_by_executor: Counter[str]
    spark_properties: dict[str, str]

    @property
    def workers_with_tasks(self) -> set[str]:
        return {self.executor_worker.get(e, "?") for e, n in self.tasks_by_executor.items()
                if n > 0}


def read_event_log(path: Path) -> EventLogSummary:
    app_id = ""
    where: dict[str, str] = {}
    tasks: Counter[str] = Counter()
    props: dict[str, str] = {}
    for line in path.read_text().splitlines():
        try:
            ev: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:  # the unflushed end of an .inprogress log
            continue
        kind = ev.get("Event")
        if kind == "SparkListenerApplicationStart":
            app_id = ev.get("App ID", "")
        elif kind == "SparkListenerEnvironmentUpdate":
            props = dict(ev.get("Spark Properties", {}))
        elif kind == "SparkListenerExecutorAdded":
            urls = ev.get("Executor Info", {}).get("Log Urls", {})
            url = urls.get("stdout") or urls.get("stderr") or ""
            where[ev["Executor ID"]] = url.split("//", 1)[-1].split("/", 1)[0]
        elif kind == "SparkListenerTaskEnd":
            info = ev.get("Task Info", {})
            if ev.get("Task End Reason", {}).get("Reason") == "Success":
                tasks[info.get("Executor ID", "?")] += 1
    return EventLogSummary(app_id, where, tasks, props)


def event_logs(event_dir: Path) -> list[EventLogSummary]:
    """One summary per application. A log still named .inprogress counts too: `offsetflow
    run-batch` leaves stopping Spark to the JVM's shutdown hook, which a loaded machine may
    cut short before the rename; stage ends are flushed, so its task events are there."""
    return [read_event_log(p) for p in sorted(event_dir.iterdir()) if p.is_file()]
