"""The soak's faults, one function each: given the planned batch, run it with the fault
injected. The cycle (`Soak.cycle`) then re-runs the batch until it is committed (what
Airflow's task retry does); the checker judges the sink at the end.

Shared by every sink; what a fault needs of a sink (its commit's pause and kill points, its
maintenance, how a task fails) is a method of the sink's class in `sinks.py`, and a sink
lists the faults that apply to it.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tests.tooling import chaos

if TYPE_CHECKING:
    from include.soak.run import Soak, Window

log = logging.getLogger("offsetflow.soak")
Fault = Callable[["Soak", int], None]
FAULTS: dict[str, Fault] = {}


def fault(fn: Fault) -> Fault:
    FAULTS[fn.__name__] = fn
    return fn


def done(p: subprocess.Popen[Any], timeout_s: float = 900) -> None:
    """Wait for a job; then kill what is left of its process group (a driver killed by
    its own fault point may leave its Spark JVM behind)."""
    try:
        p.wait(timeout=timeout_s)
    finally:
        chaos.kill(p)


# -- the run killed at each stage ----------------------------------------------------------
@fault
def kill_after_plan(s: Soak, bid: int) -> None:
    """Killed while it reads (planned ranges, nothing staged or half staged)."""
    p = s.job(bid)
    chaos.wait_for(lambda: s.status(bid) == "running" or p.poll() is not None, 300,
                   "job start")
    time.sleep(s.rng.uniform(0, 3))
    chaos.kill(p)


@fault
def task_failure(s: Soak, bid: int) -> None:
    """A Spark task attempt fails mid-range; Spark retries it."""
    done(s.job(bid, s.sink.task_failure_env(s.tag())))


def _at_fence(s: Soak, bid: int, name: str, act: Callable[[subprocess.Popen[Any]], object],
              restart_pg: bool = False) -> None:
    """Everything staged, the job waiting inside its commit at the fence (before any sink
    commit): `act` there."""
    p, acted = None, False
    try:
        with chaos.hold_positions(s.dsn, s.name):
            p = s.job(bid)
            chaos.wait_for(lambda: chaos.commit_waiting(s.dsn) or p.poll() is not None, 900,
                           "commit")
            if p.poll() is not None:
                raise RuntimeError(f"the job ended (rc {p.returncode}) before its commit")
            acted = True
            act(p)
    except Exception as e:  # noqa: BLE001 - our lock connection dies with the server
        if acted:
            log.info("fault at the fence: %s", e)
        else:
            s.not_injected(name, e)
    finally:
        if restart_pg:
            chaos.stack("pg-start")
    if p is not None:
        done(p)


@fault
def kill_after_staging(s: Soak, bid: int) -> None:
    _at_fence(s, bid, "kill_after_staging", chaos.kill)


@fault
def cut_commit_connection(s: Soak, bid: int) -> None:
    _at_fence(s, bid, "cut_commit_connection", lambda p: chaos.cut_commit_connection(s.dsn))


@fault
def restart_postgres(s: Soak, bid: int) -> None:
    _at_fence(s, bid, "restart_postgres", lambda p: chaos.stack("pg-stop"), restart_pg=True)


@fault
def crash_postgres(s: Soak, bid: int) -> None:
    """`-m immediate` at the commit: unlogged data (the stage) is gone after recovery."""
    _at_fence(s, bid, "crash_postgres", lambda p: chaos.crash_postgres(restart=False),
              restart_pg=True)


def _at_sink_commit(s: Soak, bid: int, act: Callable[[subprocess.Popen[Any]], None],
                    name: str) -> None:
    """The job paused inside its sink's commit (records produced in an open transaction /
    data files written, catalog commit next): `act`, then let it go on."""
    tag = s.tag()
    p = s.job(bid, s.sink.pause_env(tag))
    try:
        chaos.wait_for(lambda: s.sink.paused(tag) or p.poll() is not None, 900,
                       "the sink's commit")
        if p.poll() is not None:
            raise RuntimeError(f"the job ended (rc {p.returncode}) before its sink's commit")
        act(p)
    except Exception as e:  # noqa: BLE001 - counted, the batch is recovered anyway
        s.not_injected(name, e)
    finally:
        while p.poll() is None:  # a commit retried after a conflict pauses again
            s.sink.resume(tag)
            time.sleep(0.2)
        done(p)


@fault
def kill_in_sink_commit(s: Soak, bid: int) -> None:
    _at_sink_commit(s, bid, chaos.kill, "kill_in_sink_commit")


@fault
def kill_after_sink_commit(s: Soak, bid: int) -> None:
    """Dies after its sink's commit, before the ledger's: the retry must find the batch in
    the sink and not write it again."""
    done(s.job(bid, s.sink.kill_after_sink_commit_env()))


@fault
def crash_postgres_at_sink_commit(s: Soak, bid: int) -> None:
    def crash(p: subprocess.Popen[Any]) -> None:
        try:
            chaos.crash_postgres(restart=False)
            time.sleep(s.rng.uniform(0, 2))
        finally:
            chaos.stack("pg-start")
    _at_sink_commit(s, bid, crash, "crash_postgres_at_sink_commit")


@fault
def kill_kafka_at_sink_commit(s: Soak, bid: int) -> None:
    def kill9(p: subprocess.Popen[Any]) -> None:
        with s.producers_paused():
            try:
                chaos.kill_kafka(restart=False)
                time.sleep(s.rng.uniform(1, 5))
            finally:
                chaos.start_kafka()
    _at_sink_commit(s, bid, kill9, "kill_kafka_at_sink_commit")


@fault
def kill_after_commit(s: Soak, bid: int) -> None:
    """Runs to its end; then its task retry runs it again (must be a no-op)."""
    done(s.job(bid))
    done(s.job(bid))


@fault
def zombie_same_batch(s: Soak, bid: int) -> None:
    a, b = s.job(bid), s.job(bid)
    done(a)
    done(b)


# -- the services broken while the batch reads ----------------------------------------------
@fault
def restart_kafka(s: Soak, bid: int) -> None:
    with s.producers_paused():
        p = s.job(bid)
        chaos.wait_for(lambda: s.status(bid) == "running" or p.poll() is not None, 300,
                       "job start")
        chaos.stop_kafka()
        time.sleep(s.rng.uniform(2, 6))
        chaos.start_kafka()
    done(p)


@fault
def kill_kafka(s: Soak, bid: int) -> None:
    """kill -9 of the broker while a task reads (a Python worker exists once one runs)."""
    with s.producers_paused():  # a producer cut mid-transaction cannot say what landed
        p = s.job(bid)
        try:
            chaos.wait_for(lambda: bool(chaos.python_workers(p.pid)), 300, "a task")
            chaos.kill_kafka(restart=False)
            time.sleep(s.rng.uniform(1, 5))
        except Exception as e:  # noqa: BLE001 - e.g. the job ended before a task ran
            s.not_injected("kill_kafka", e)
        finally:
            chaos.start_kafka()
    done(p)


@fault
def kill_executor(s: Soak, bid: int) -> None:
    p = s.job(bid)
    try:
        chaos.kill_python_worker(p.pid, timeout_s=300)
    except Exception as e:  # noqa: BLE001 - e.g. the job ended before a task ran
        s.not_injected("kill_executor", e)
    done(p)


# -- the workload is the fault ----------------------------------------------------------------
@fault
def large_records(s: Soak, bid: int) -> None:
    done(s.job(bid))  # the cycle wrote them before planning


@fault
def tombstones(s: Soak, bid: int) -> None:
    done(s.job(bid))


# -- operators' runs beside the batches ---------------------------------------------------------
def _replay(s: Soak, window: Window, kill: bool) -> None:
    proc = s.replay(*window)
    if kill:
        try:
            chaos.wait_for(lambda: bool(s.open_replays("running")) or proc.poll() is not None,
                           600, "the replay's batch to run")
            time.sleep(s.rng.uniform(0, 8))
            chaos.kill(proc)
            s.counts["replays_killed"] += 1
        except Exception as e:  # noqa: BLE001
            s.not_injected("replay", e)
    done(proc)
    if proc.returncode not in (0, -9):
        s.not_injected("replay", RuntimeError(f"`offsetflow replay` rc {proc.returncode} for "
                                              f"window {window}; see jobs.log"))
    s.finish_replays()


@fault
def replay(s: Soak, bid: int) -> None:
    """`offsetflow replay` of a committed window (sometimes one replayed before, or one
    holding a dead letter) while the live batch runs; killed mid-run half of the time, then
    its open batches run again as Airflow's retry would; then the same window replayed once
    more (a replay is idempotent per target: the target holds the window once)."""
    live = s.job(bid)
    window = s.replay_window()
    _replay(s, window, kill=s.rng.random() < 0.5)
    s.counts["replays_repeated"] += 1
    _replay(s, window, kill=False)
    done(live)


@fault
def maintenance(s: Soak, bid: int) -> None:
    """Maintenance while the batch runs (killed after its sink's commit where a sink has
    one), and again with it open before its retry: the retry must still find its commit."""
    p = s.job(bid, s.sink.kill_after_sink_commit_env() if s.sink.external else None)
    chaos.wait_for(lambda: s.status(bid) == "running" or p.poll() is not None, 300,
                   "job start")
    s.maintain(idle=False)
    done(p)
    s.maintain(idle=True)
