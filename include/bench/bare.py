"""bare-parallel: the fastest design hand-built from the same parts, as a yardstick.

One process per core, each reading its share of the ranges with confluent-kafka, parsing
with OffsetFlow's JSON parser and binary-COPYing straight into the target in a transaction
of its own: no Spark, no stage, no ledger, no exactly-once (a crash leaves half the rows).
What OffsetFlow gives up against it is the price of Spark and of exactly-once; a goal below
it asks more of this machine than any pipeline on these parts has shown.
The processes are started and have imported everything before the clock starts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from typing import Any

from dataset import DataSet
from engines import baseline_copy, create_target, verify_and_drop


def _child(ds: DataSet, name: str, ctx: dict[str, Any], ready: Any, go: Any,
           out: Any) -> None:
    ready.put(os.getpid())
    go.wait()
    try:
        out.put(("ok", baseline_copy(ds, name, ctx)))
    except BaseException as e:  # the parent reports it
        out.put(("error", f"{type(e).__name__}: {e}"))


def bare_parallel_run(ds: DataSet, name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    create_target(ctx["dsn"], name)
    n = int(ctx.get("bare_processes") or os.cpu_count() or 2)
    shares = [DataSet(ds.topic, 0, 0, ds.ranges[i::n]) for i in range(n)]
    spawn = mp.get_context("spawn")
    ready, out, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    procs = [spawn.Process(target=_child, args=(s, name, ctx, ready, go, out), daemon=True)
             for s in shares if s.ranges]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    t0 = time.perf_counter()
    go.set()
    stages: dict[str, float] = {}
    try:
        for _ in procs:
            status, res = out.get(timeout=1800)
            if status != "ok":
                raise RuntimeError(f"bare-parallel process failed: {res}")
            for k, v in res.items():  # summed over the processes, like task-seconds
                stages[k] = stages.get(k, 0.0) + v
    except queue.Empty:
        raise RuntimeError("bare-parallel: a process gave no result in 30 min") from None
    finally:
        wall = time.perf_counter() - t0
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {"wall_s": wall, "window": (t0, t0 + wall), "processes": len(procs),
            "stages": {f"{k} (summed)": round(v, 3) for k, v in stages.items()},
            **verify_and_drop(ctx["dsn"], name, ds)}
