"""`make soak`: producers keep writing (transactions abort at random) while batches run and
faults of every kind are injected; at the end the exactly-once checker judges the sink.

    .venv/bin/python include/soak.py --minutes 10 [--seed 7]

Faults (round-robin, in random order each round): the job killed after planning (mid-read),
a Spark task failing mid-range (retried by Spark), the job killed after staging, the commit
connection cut, PostgreSQL restarted during the commit, Kafka restarted while a batch reads,
the job killed after its commit (the retry must be a no-op), two runs of one batch at once;
and faults that destroy state: PostgreSQL crashed during the commit (`-m immediate`: unlogged
data gone), the broker killed with kill -9 while a batch reads, a Spark Python worker killed
mid-task (Spark retries it), 1 MB records, tombstones (dead letters under `bad_records:
dead_letter`). The first round always completes, so every fault is injected at least
once however short `--minutes` is; `--faults a,b` runs a subset.
Prints: records produced, committed, lost, duplicated, aborted visible, dead letters, faults
by kind, batches retried.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[1]
# the workload, fault injectors and checker are test tooling (tests/tooling), not shipped;
# Spark workers and job processes find them through PYTHONPATH
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

from offsetflow.config import load_pipeline  # noqa: E402 - after the sys.path line
from offsetflow.ledger import Ledger  # noqa: E402 - after the sys.path line
from offsetflow.ops import plan_only  # noqa: E402 - after the sys.path line
from tests.tooling import chaos  # noqa: E402 - after the sys.path line
from tests.tooling.checker import check  # noqa: E402 - after the sys.path line

log = logging.getLogger("offsetflow.soak")
FAULTS = ["kill_after_plan", "task_failure", "kill_after_staging", "cut_commit_connection",
          "restart_postgres", "restart_kafka", "kill_after_commit", "zombie_same_batch",
          "crash_postgres", "kill_kafka", "kill_executor", "large_records", "tombstones"]
COMMIT_WINDOW = ("kill_after_staging", "cut_commit_connection", "restart_postgres",
                 "crash_postgres")


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.dsn = os.environ["OFFSETFLOW_PG_DSN"]
        self.bootstrap = os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
        run = uuid.uuid4().hex[:6]
        self.topic = f"soak-{run}"
        self.name = f"soak_{run}"
        self.out = ROOT / "test-output" / "soak" / run
        self.out.mkdir(parents=True, exist_ok=True)
        self.file = self.out / f"{self.name}.yaml"
        self.file.write_text(yaml.safe_dump({
            "name": self.name, "kafka": {"bootstrap_servers": self.bootstrap},
            "source": {"topics": [self.topic], "max_records_per_partition": 20_000},
            "format": {"type": "json", "schema": dict(chaos.SCHEMA_WITH_PAD)},
            "transform": "tests.tooling.chaos.maybe_fail_task",
            "bad_records": "dead_letter",  # tombstones become dead letters
            "sink": {"connection": self.dsn, "table": f"soak_{run}"},
            "spark": {"master": "local[2,4]", "max_offsets_per_task": 10_000}}))
        self.cfg = load_pipeline(self.file)
        self.workload = chaos.Workload(self.bootstrap, self.topic, args.partitions, f"s{run}")
        self.producing = threading.Event()
        self.producing.set()
        self.stop = threading.Event()
        self.faults: Counter[str] = Counter()
        self.fault_errors: Counter[str] = Counter()  # the injection itself went wrong
        self.producer_errors = 0
        self.wedged: int | None = None  # a batch that never committed in the drain
        self.workload_lock = threading.Lock()  # the producer thread and the cycles share it

    # -- producers ------------------------------------------------------------------------
    def produce_forever(self) -> None:
        rng = random.Random(self.args.seed + 1)
        while not self.stop.is_set():
            if not self.producing.wait(timeout=1):
                continue
            try:
                with self.workload_lock:
                    self.workload.mixed(rng.randint(200, 1500), rng, abort_ratio=0.3)
            except Exception as e:  # noqa: BLE001 - a failed write is simply not counted
                self.producer_errors += 1
                log.warning("producer error (records not counted as produced): %s", e)
                self.workload._tx = None
            time.sleep(rng.uniform(0.5, 2.0))  # ~ 500 records/s: batches can keep up

    # -- one cycle with one fault ---------------------------------------------------------
    def job(self, batch_id: int, env: dict[str, str] | None = None) -> Any:
        import subprocess

        return subprocess.Popen(
            ["offsetflow", "run-batch", "--pipeline-file", str(self.file), "--batch-id",
             str(batch_id)], stdout=(self.out / "jobs.log").open("ab"),
            stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OFFSETFLOW_SPARK_LOG_LEVEL": "ERROR", **(env or {})})

    def status(self, batch_id: int) -> str:
        with Ledger(self.dsn) as ledger:
            return ledger.get_batch(batch_id).status

    def cycle(self, fault: str) -> bool:
        if fault in ("large_records", "tombstones"):
            with self.workload_lock:
                if fault == "large_records":
                    self.workload.large(self.rng.randint(2, 6))
                else:
                    self.workload.tombstones(self.rng.randint(10, 100))
        planned = plan_only(self.cfg, self.dsn, started_by="soak")
        if planned.batch is None:
            return False
        bid = planned.batch.batch_id
        if fault == "kill_after_plan":
            p = self.job(bid)
            chaos.wait_for(lambda: self.status(bid) == "running", 120, "job start")
            time.sleep(self.rng.uniform(0, 3))
            chaos.kill(p)
        elif fault == "task_failure":
            p = self.job(bid, {"OFFSETFLOW_CHAOS_TASK_FAIL": "1"})
            p.wait(timeout=600)
        elif fault in COMMIT_WINDOW:
            p = None
            try:
                with chaos.hold_positions(self.dsn, self.name):
                    p = self.job(bid)
                    chaos.wait_for(lambda: chaos.commit_waiting(self.dsn), 300, "commit")
                    if fault == "kill_after_staging":
                        chaos.kill(p)
                    elif fault == "cut_commit_connection":
                        chaos.cut_commit_connection(self.dsn)
                    elif fault == "crash_postgres":
                        chaos.crash_postgres(restart=False)
                    else:
                        chaos.stack("pg-stop")
            except Exception as e:  # noqa: BLE001 - our lock connection dies with the server
                log.info("fault %s: %s", fault, e)
            finally:
                if fault in ("restart_postgres", "crash_postgres"):
                    chaos.stack("pg-start")
            if p is not None:
                p.wait(timeout=300)
        elif fault in ("kill_kafka", "kill_executor"):
            if fault == "kill_kafka":
                self.producing.clear()  # a producer cut mid-transaction cannot say what landed
                time.sleep(1)
            p = self.job(bid)
            try:
                if fault == "kill_kafka":
                    # a Python worker exists once a task runs: the batch is reading
                    chaos.wait_for(lambda: bool(chaos.python_workers(p.pid)), 300, "a task")
                    chaos.kill_kafka(restart=False)
                    time.sleep(self.rng.uniform(1, 5))
                else:
                    chaos.kill_python_worker(p.pid, timeout_s=300)
            except Exception as e:  # noqa: BLE001 - e.g. the job ended before a task ran
                self.fault_errors[fault] += 1
                log.warning("fault %s not injected: %s", fault, e)
            finally:
                if fault == "kill_kafka":
                    chaos.start_kafka()
                    self.producing.set()
            p.wait(timeout=600)
        elif fault == "restart_kafka":
            self.producing.clear()
            time.sleep(1)
            p = self.job(bid)
            chaos.wait_for(lambda: self.status(bid) == "running", 120, "job start")
            chaos.stop_kafka()
            time.sleep(self.rng.uniform(2, 6))
            chaos.start_kafka()
            self.producing.set()
            p.wait(timeout=600)
        elif fault in ("large_records", "tombstones"):
            self.job(bid).wait(timeout=600)  # the workload is the fault
        elif fault == "kill_after_commit":
            p = self.job(bid)
            p.wait(timeout=600)
            retry = self.job(bid)  # what Airflow's task retry does
            retry.wait(timeout=600)
        elif fault == "zombie_same_batch":
            a, b = self.job(bid), self.job(bid)
            a.wait(timeout=600)
            b.wait(timeout=600)
        self.faults[fault] += 1
        if self.status(bid) != "committed":  # recover: the same batch, re-run cleanly
            self.job(bid).wait(timeout=600)
        return True

    def drain(self) -> None:
        """Run batches until caught up; a batch that fails three runs in a row is wedged (the
        check then reports what it kept from the sink) and ends the drain."""
        tries: Counter[int] = Counter()
        for _ in range(100):
            planned = plan_only(self.cfg, self.dsn, started_by="soak-drain")
            if planned.batch is None:
                return
            bid = planned.batch.batch_id
            tries[bid] += 1
            if tries[bid] > 3:
                self.wedged = bid
                log.error("batch %d did not commit in 3 runs; see %s", bid,
                          self.out / "jobs.log")
                return
            self.job(bid).wait(timeout=600)

    def run(self) -> int:
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        admin.create_topics([NewTopic(self.topic, self.args.partitions, 1)])[self.topic].result(30)
        with Ledger(self.dsn) as ledger:
            ledger.upgrade()
        producer = threading.Thread(target=self.produce_forever, daemon=True)
        producer.start()
        deadline = time.monotonic() + self.args.minutes * 60
        cycles = 0
        rounds = 0

        def over() -> bool:  # the first round always completes: every fault injected once
            return (rounds > 0 and time.monotonic() >= deadline) or bool(
                self.args.cycles and cycles >= self.args.cycles)

        while not over():
            order = self.args.faults[:]
            self.rng.shuffle(order)
            for fault in order:
                if over():
                    break
                t = time.monotonic()
                while not self.cycle(fault):  # wait for data to inject this fault on
                    if time.monotonic() >= deadline + 600:
                        raise RuntimeError(f"no data to inject {fault} on for 10 minutes")
                    time.sleep(1)
                cycles += 1
                log.info("cycle %d: %s done in %.1fs; produced so far %d", cycles, fault,
                         time.monotonic() - t, len(self.workload.produced))
            rounds += 1
        self.stop.set()
        producer.join(timeout=120)
        self.drain()
        with Ledger(self.dsn) as ledger:
            positions = ledger.positions(self.name)
            batches = ledger.recent_batches(self.name, 100_000)
        dead = chaos.dead_letters(self.dsn, self.cfg.dead_letter_table, self.name)
        rep = check(self.workload.produced.values(),
                    chaos.sink_rows(self.dsn, self.cfg.sink.table), positions, dead,
                    tombstones="dead_letter")
        figures = {
            "minutes": self.args.minutes, "cycles": cycles, "rounds": rounds,
            "records_produced": len(self.workload.produced),
            "records_committed_by_producers": self.workload.committed_count,
            "records_aborted_by_producers": len(self.workload.produced)
            - self.workload.committed_count,
            "transactions": self.workload.transactions,
            "records_by_kind": dict(sorted(self.workload.kinds.items())),
            "rows_in_sink": rep.found, "dead_letters": rep.dead_letters,
            "expected": rep.expected,
            "lost": len(rep.lost), "duplicated": len(rep.duplicated),
            "aborted_visible": len(rep.aborted_visible), "corrupted": len(rep.corrupted),
            "beyond_position": len(rep.beyond_position), "misrouted": len(rep.misrouted),
            "unknown": len(rep.unknown),
            "faults_injected": dict(sorted(self.faults.items())),
            "faults_not_injected": dict(sorted(self.fault_errors.items())),
            "batches": len(batches),
            "batches_retried": sum(1 for b in batches if b.attempts > 1),
            "producer_errors": self.producer_errors,
            "wedged_batch": self.wedged,
        }
        (self.out / "figures.json").write_text(json.dumps(figures, indent=2))
        print(json.dumps(figures, indent=2))
        ok = rep.ok and rep.expected == self.workload.committed_count and self.wedged is None
        print(f"SOAK {'OK' if ok else 'FAILED'}: {rep.explain()}")
        return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--cycles", type=int, default=0, help="stop after N cycles (0: by time)")
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--faults", type=lambda v: [f for f in v.split(",") if f], default=FAULTS,
                    help=f"comma-separated subset of: {','.join(FAULTS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("offsetflow.ops.runner").setLevel(logging.WARNING)
    args = ap.parse_args()
    unknown = sorted(set(args.faults) - set(FAULTS))
    if unknown or not args.faults:
        ap.error(f"--faults: unknown {unknown}; choose from {','.join(FAULTS)}")
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
