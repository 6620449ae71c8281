"""One sink's soak: producers keep writing (transactions abort at random) while batches run
with the sink's faults injected round-robin (`faults.py`); then a drain, and the
exactly-once checker judges what the sink holds (`sinks.py` reads it back)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from confluent_kafka.admin import AdminClient, NewTopic

from include.soak.faults import FAULTS
from include.soak.sinks import SinkSoak
from offsetflow.config import load_pipeline
from offsetflow.ledger import Batch, Ledger
from offsetflow.ops import plan_only
from offsetflow.ranges import TopicPartition
from tests.tooling import chaos
from tests.tooling.checker import check

log = logging.getLogger("offsetflow.soak")
ROOT = Path(__file__).resolve().parents[2]
Window = tuple[str, int, int, int, int | None]  # topic, partition, from, until, per batch
# faults that hold the pipeline's position rows, or replay committed offsets
NEEDS_POSITIONS = ("kill_after_staging", "cut_commit_connection", "restart_postgres",
                   "crash_postgres", "replay")


class Soak:
    def __init__(self, args: argparse.Namespace, sink: type[SinkSoak]) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.dsn = os.environ["OFFSETFLOW_PG_DSN"]
        self.bootstrap = os.environ.get("OFFSETFLOW_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
        run = uuid.uuid4().hex[:6]
        self.topic = f"soak-{run}"
        self.name = f"soak_{run}"
        self.out = ROOT / "test-output" / "soak" / f"{run}-{sink.kind}"
        self.out.mkdir(parents=True, exist_ok=True)
        self.sink = sink(self.out, self.name, self.dsn, self.bootstrap)
        self.file = self.out / f"{self.name}.yaml"
        self.file.write_text(yaml.safe_dump({
            "name": self.name, "kafka": {"bootstrap_servers": self.bootstrap},
            "source": {"topics": [self.topic], "max_records_per_partition": 20_000},
            "format": {"type": "json", "schema": dict(chaos.SCHEMA_WITH_PAD)},
            "bad_records": "dead_letter",  # tombstones and refused records become dead letters
            "spark": {"master": "local[2,4]", "max_offsets_per_task": 10_000},
            **self.sink.config()}))
        self.cfg = load_pipeline(self.file)
        self.faults_here = [f for f in args.faults if f in self.sink.faults]
        self.workload = chaos.Workload(self.bootstrap, self.topic, args.partitions, f"s{run}")
        self.large: set[str] = set()  # ids of the 1 MB records
        self.producing = threading.Event()
        self.producing.set()
        self.stop = threading.Event()
        self.faults: Counter[str] = Counter()
        self.fault_errors: Counter[str] = Counter()  # the injection itself went wrong
        self.counts: Counter[str] = Counter()  # replays, maintenance runs
        self.replayed: list[Window] = []
        self.producer_errors = 0
        self.wedged: list[int] = []  # batches that never committed in the drain
        self.hung: list[str] = []  # jobs that ran 15 minutes (killed then)
        self.workload_lock = threading.Lock()  # the producer thread and the cycles share it
        self._tags = 0

    # -- what the faults use ------------------------------------------------------------
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "OFFSETFLOW_SPARK_LOG_LEVEL": "ERROR",
                "OFFSETFLOW_PIPELINES_DIR": str(self.out), **(extra or {})}

    def job(self, batch_id: int, env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
        return subprocess.Popen(
            ["offsetflow", "run-batch", "--pipeline-file", str(self.file), "--batch-id",
             str(batch_id)], stdout=(self.out / "jobs.log").open("ab"),
            stderr=subprocess.STDOUT, start_new_session=True, env=self.env(env))

    def tag(self) -> str:
        self._tags += 1
        return str(self._tags)

    def status(self, batch_id: int) -> str:
        with Ledger(self.dsn) as ledger:
            return ledger.get_batch(batch_id).status

    def positions(self) -> dict[TopicPartition, int]:
        with Ledger(self.dsn) as ledger:
            return ledger.positions(self.name)

    def batches(self) -> list[Batch]:
        with Ledger(self.dsn) as ledger:
            return ledger.recent_batches(self.name, 100_000)

    def not_injected(self, fault: str, e: BaseException) -> None:
        self.fault_errors[fault] += 1
        log.warning("fault %s not (fully) injected: %s", fault, e)

    @contextlib.contextmanager
    def producers_paused(self) -> Iterator[None]:
        """A producer cut mid-transaction by a broker fault cannot say what landed."""
        self.producing.clear()
        with self.workload_lock:  # the transaction in flight ends first
            pass
        try:
            yield
        finally:
            self.producing.set()

    def maintain(self, idle: bool) -> None:
        try:
            self.sink.maintain(self.file, self.env(), idle)
        except Exception as e:  # noqa: BLE001 - a refusal is a finding, not a crash
            self.not_injected("maintenance", e)

    def replay_window(self) -> Window:
        """A committed window: one replayed before (a third of the time), one around a dead
        letter (a third), else anywhere below the position; cut into 1 or 2 batches."""
        pos = {tp: n for tp, n in self.positions().items() if n > 0}
        pick = self.rng.random()
        if self.replayed and pick < 1 / 3:
            return self.rng.choice(self.replayed)
        dead = [d for d in chaos.dead_letters(self.dsn, self.cfg.dead_letter_table, self.name)
                if d.offset < pos.get((d.topic, d.partition), 0)]
        if dead and pick < 2 / 3:
            d = self.rng.choice(dead)
            lo = max(0, d.offset - self.rng.randint(0, 500))
            hi = min(pos[(d.topic, d.partition)], d.offset + self.rng.randint(1, 500))
            topic, part = d.topic, d.partition
        else:
            (topic, part), end = self.rng.choice(sorted(pos.items()))
            size = min(end, self.rng.randint(100, 3000))
            lo = self.rng.randint(0, end - size)
            hi = lo + size
        return topic, part, lo, hi, self.rng.choice([None, (hi - lo) // 2 + 1])

    def replay(self, topic: str, part: int, lo: int, hi: int,
               per_batch: int | None) -> subprocess.Popen[Any]:
        self.replayed.append((topic, part, lo, hi, per_batch))
        self.counts["replays"] += 1
        cmd = ["offsetflow", "replay", "-p", self.name, "--local", "--topic", topic,
               "--partitions", str(part), "--from-offset", str(lo), "--until-offset", str(hi)]
        if per_batch:
            cmd += ["--records-per-batch", str(per_batch)]
        with (self.out / "jobs.log").open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
        return subprocess.Popen(cmd, stdout=(self.out / "jobs.log").open("ab"),
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=self.env())

    def open_replays(self, status: str | None = None) -> list[int]:
        return sorted(b.batch_id for b in self.batches() if b.kind == "replay" and b.is_open
                      and (status is None or b.status == status))

    def finish_replays(self, runs: int = 3) -> list[int]:
        """Run open replay batches again, in order, until committed; those left open."""
        for _ in range(runs):
            left = self.open_replays()
            if not left:
                return []
            for bid in left:
                self.run_job(bid)
        return self.open_replays()

    # -- producers ------------------------------------------------------------------------
    def produce_forever(self) -> None:
        rng = random.Random(self.args.seed + 1)
        while not self.stop.is_set():
            if not self.producing.wait(timeout=1):
                continue
            try:
                with self.workload_lock:
                    if self.producing.is_set():
                        self.workload.mixed(rng.randint(200, 1500), rng, abort_ratio=0.3)
            except Exception as e:  # noqa: BLE001 - a failed write is simply not counted
                self.producer_errors += 1
                log.warning("producer error (records not counted as produced): %s", e)
                self.workload._tx = None
            time.sleep(rng.uniform(0.5, 2.0))  # ~ 500 records/s: batches can keep up

    # -- one cycle with one fault ---------------------------------------------------------
    def cycle(self, fault: str) -> bool:
        if fault in ("large_records", "tombstones"):
            with self.workload_lock:
                if fault == "large_records":
                    before = set(self.workload.produced)
                    self.workload.large(self.rng.randint(2, 6))
                    self.large |= set(self.workload.produced) - before
                else:
                    self.workload.tombstones(self.rng.randint(10, 100))
        planned = plan_only(self.cfg, self.dsn, started_by="soak")
        if planned.batch is None:
            return False
        bid = planned.batch.batch_id
        if fault in NEEDS_POSITIONS and not any(self.positions().values()):
            self.recover(bid)  # a first batch: the fault needs a committed one
            return False
        try:
            FAULTS[fault](self, bid)
        except subprocess.TimeoutExpired as e:  # a job that hangs: a wedge (it was killed)
            self.hung.append(f"{fault}: batch {bid}: {e}")
            log.error("fault %s, batch %d: a job hung: %s", fault, bid, e)
        self.faults[fault] += 1
        self.recover(bid)
        return True

    def recover(self, bid: int) -> None:
        """The same batch re-run cleanly unless committed (Airflow's task retry)."""
        if self.status(bid) != "committed":
            self.run_job(bid)

    def run_job(self, bid: int) -> None:
        """A clean run of the batch to its end; one that hangs 15 minutes is killed."""
        p = self.job(bid)
        try:
            p.wait(timeout=900)
        except subprocess.TimeoutExpired as e:
            self.hung.append(f"batch {bid}: {e}")
            log.error("batch %d: a clean run hung: %s", bid, e)
        finally:
            chaos.kill(p)

    def drain(self) -> None:
        """Run batches until caught up; a batch that fails three runs in a row is wedged (the
        check then reports what it kept from the sink) and ends the drain."""
        tries: Counter[int] = Counter()
        for _ in range(100):
            planned = plan_only(self.cfg, self.dsn, started_by="soak-drain")
            if planned.batch is None:
                break
            bid = planned.batch.batch_id
            tries[bid] += 1
            if tries[bid] > 3:
                self.wedged.append(bid)
                log.error("batch %d did not commit in 3 runs; see %s", bid,
                          self.out / "jobs.log")
                break
            self.run_job(bid)
        self.wedged += self.finish_replays()

    def loop(self) -> tuple[int, int]:
        deadline = time.monotonic() + self.args.minutes * 60
        cycles = rounds = 0

        def over() -> bool:  # the first round always completes: every fault injected once
            return (rounds > 0 and time.monotonic() >= deadline) or bool(
                self.args.cycles and cycles >= self.args.cycles)

        while not over():
            order = self.faults_here[:]
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
                log.info("[%s] cycle %d: %s done in %.1fs; produced so far %d",
                         self.sink.kind, cycles, fault, time.monotonic() - t,
                         len(self.workload.produced))
            rounds += 1
        return cycles, rounds

    def run(self) -> tuple[bool, dict[str, Any]]:
        started = time.monotonic()
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        admin.create_topics([NewTopic(self.topic, self.args.partitions, 1)])[self.topic].result(30)
        with Ledger(self.dsn) as ledger:
            ledger.upgrade()
        self.sink.prepare()
        producer = threading.Thread(target=self.produce_forever, daemon=True)
        producer.start()
        try:
            cycles, rounds = self.loop()
        finally:
            self.stop.set()
            producer.join(timeout=120)
        self.drain()
        return self.judge(cycles, rounds, time.monotonic() - started)

    def judge(self, cycles: int, rounds: int, wall_s: float) -> tuple[bool, dict[str, Any]]:
        positions = self.positions()
        batches = self.batches()
        dead = chaos.dead_letters(self.dsn, self.cfg.dead_letter_table, self.name)
        produced = list(self.workload.produced.values())
        refused = self.sink.refused(self.large)
        rep = check(produced, self.sink.rows(self.cfg), positions, dead,
                    tombstones=self.sink.tombstones, refused=refused)
        extra, extra_ok = self.sink.extra(self.cfg, produced, positions, dead, batches,
                                          refused)
        figures = {
            "sink": self.sink.kind, "pipeline": self.name, "minutes": self.args.minutes,
            "wall_s": round(wall_s), "cycles": cycles, "rounds": rounds,
            "records_produced": len(produced),
            "records_committed_by_producers": self.workload.committed_count,
            "records_aborted_by_producers": len(produced) - self.workload.committed_count,
            "transactions": self.workload.transactions,
            "records_by_kind": dict(sorted(self.workload.kinds.items())),
            "rows_in_sink": rep.found, "dead_letters": rep.dead_letters,
            "expected": rep.expected,
            **{name: len(getattr(rep, name)) for name in rep.VIOLATIONS},
            "faults_injected": dict(sorted(self.faults.items())),
            "faults_not_injected": dict(sorted(self.fault_errors.items())),
            "operations": dict(sorted((self.counts + self.sink.counts).items())),
            "batches": dict(Counter(f"{b.kind}/{b.status}" for b in batches)),
            "batches_retried": sum(1 for b in batches if b.attempts > 1),
            "producer_errors": self.producer_errors,
            "wedged_batches": self.wedged, "hung_jobs": self.hung,
            **extra,
        }
        ok = (rep.ok and rep.expected == self.workload.committed_count and not self.wedged
              and not self.hung and extra_ok)
        figures["verdict"] = f"{'OK' if ok else 'FAILED'}: {rep.explain()}"
        (self.out / "figures.json").write_text(json.dumps(figures, indent=2))
        return ok, figures
