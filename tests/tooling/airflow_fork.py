"""`airflow dags test` without paying Airflow's start-up per run: one warm process imports
Airflow, its providers and OffsetFlow's orchestration once, then forks a child per request
that takes the request's environment, initializes Airflow's settings with it (logging,
the metadata database's engine, the DAG folder) and runs the CLI's `dags test` as
`airflow dags test` would. A cold `airflow dags test` spends ~14 CPU-s of a 2-core machine
before its DAG's first task runs (imports, provider discovery, the in-process execution
API); the child starts from the parent's imported modules.

The parent never initializes Airflow (`_AIRFLOW__AS_LIBRARY`): no settings, logging, engine
or connection a child would inherit. What a child runs is the CLI's own code, with the
request's environment, arguments and working directory, its output to a file: the same
assertions hold as on a cold process. `OFFSETFLOW_TESTS_DAGS_TEST_FORK=0` turns it off
(tests/tooling/airflow_dags.py then starts `airflow dags test` processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Client, Listener
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AUTHKEY = b"offsetflow-tests-dags-test"
# what a cold `airflow dags test` of an OffsetFlow DAG imports anyway, env-independent
WARM_MODULES = (
    "airflow.cli.cli_parser", "airflow.cli.commands.dag_command", "airflow.utils.cli",
    "airflow.sdk.definitions.dag", "airflow.sdk.execution_time.supervisor",
    "airflow.sdk.execution_time.task_runner", "airflow.api_fastapi.execution_api.app",
    "airflow.api_fastapi.execution_api.routes", "airflow.models.dagrun",
    "airflow.models.taskinstance", "airflow.serialization.serialized_objects",
    "airflow.dag_processing.dagbag", "airflow.providers.standard.operators.python",
    "airflow.providers.apache.spark.hooks.spark_submit",
    "airflow.providers.apache.kafka.hooks.base", "airflow.providers.postgres.hooks.postgres",
    "offsetflow.orchestration",
    "pyspark.sql.connect.session", "pyspark.sql.connect.dataframe",
)


def _warm() -> None:
    """Import what every run needs; a module that fails to import is left to the child."""
    import importlib

    for name in WARM_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    with contextlib.suppress(Exception):
        from airflow.providers_manager import ProvidersManager

        pm = ProvidersManager()
        pm.initialize_providers_list()
        pm.initialize_providers_hooks()


def _clear_caches() -> None:
    """Forget what Airflow's and OffsetFlow's cached functions computed in the parent from
    its environment (e.g. the OpenLineage provider's `conf.namespace()` is `@cache`d)."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("airflow", "offsetflow")):
            continue
        for value in list(vars(module).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and getattr(value, "__module__", None) == name:
                with contextlib.suppress(Exception):
                    clear()


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str) -> None:
    """In the forked child: the request's environment, output and working directory, then
    Airflow's settings initialized and the CLI run. Never returns."""
    code = 1
    try:
        os.setsid()
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        os.environ.pop("_AIRFLOW__AS_LIBRARY", None)
        # modules that read the environment when imported, imported again with this one's
        for name in ("airflow.config_templates.airflow_local_settings",):
            sys.modules.pop(name, None)
        _clear_caches()
        from airflow import settings

        settings.initialize()
        # the SDK's serde registers its serializers and Stats' backend factory when imported
        # (from [metrics] of the parent's environment): again, from this one's
        serde = sys.modules.get("airflow.sdk.serde")
        if serde is not None:
            serde._register()
        from airflow.__main__ import main

        sys.argv = argv
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's output is the report
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            import atexit
            import logging
            import threading

            # the interpreter's own order at exit: threads' exit hooks first (a process
            # pool's shutdown, e.g. the OpenLineage listener's), then atexit's (which joins
            # that pool's worker processes: before its shutdown, forever)
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(address: str) -> None:
    """The warm parent: one request at a time, each run in a forked child."""
    os.environ["_AIRFLOW__AS_LIBRARY"] = "1"
    _warm()
    with Listener(address, authkey=AUTHKEY) as listener:
        print("ready", flush=True)
        while True:
            with listener.accept() as conn:
                req = conn.recv()
                if req.get("stop"):
                    return
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    _child(req["argv"], req["env"], req["cwd"], req["out"])
                conn.send({"pid": pid})
                # a kill request may come on another connection while this one waits
                _, status, usage = os.wait4(pid, 0)
                conn.send({"rc": os.waitstatus_to_exitcode(status),
                           "cpu_s": usage.ru_utime + usage.ru_stime})


class DagsTestForkServer:
    """The warm process, started on first use and stopped with `stop()`."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._address = ""
        self._lock = threading.Lock()
        self.last_cpu_s = 0.0  # the CPU seconds of the last run's child

    def _start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dags-test-fork-")
        self._address = str(Path(self._dir.name) / "sock")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.tooling.airflow_fork", self._address],
            env={**os.environ}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        assert self._proc.stdout is not None
        for line in self._proc.stdout:  # import output, then "ready"
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"the dags-test fork server exited: {self._proc.wait()}")

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, out: Path,
            timeout: float = 600) -> int:
        """`argv` (`airflow dags test ...`) in a forked child with `env`, its output to
        `out`; its exit code. The child is killed after `timeout` seconds."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            with Client(self._address, authkey=AUTHKEY) as conn:
                conn.send({"argv": argv, "env": dict(env), "cwd": str(cwd), "out": str(out)})
                pid = conn.recv()["pid"]
                if not conn.poll(timeout):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                    conn.recv()
                    raise subprocess.TimeoutExpired(argv, timeout)
                done = conn.recv()
                self.last_cpu_s = float(done["cpu_s"])
                return int(done["rc"])

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(Exception), Client(self._address, authkey=AUTHKEY) as c:
                c.send({"stop": True})
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


_SERVER: list[DagsTestForkServer] = []


def dags_test_process() -> DagsTestForkServer:
    """This pytest process's warm Airflow, started on first use, stopped when it exits:
    ~7 CPU-s once instead of ~7 more for each `dags test` of its tests."""
    if not _SERVER:
        import atexit

        _SERVER.append(DagsTestForkServer())
        atexit.register(_SERVER[0].stop)
    return _SERVER[0]


if __name__ == "__main__":
    serve(sys.argv[1])
