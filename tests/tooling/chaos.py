"""Workloads and fault injectors for proving exactly-once (fault tests and `make soak`).

A `Workload` writes records with a unique id and a payload checksum and remembers each
one's coordinates from the delivery report, and whether its transaction committed, so
`tests.tooling.checker` can judge the sink. The fault helpers act on the real services:
processes are killed, connections cut, servers restarted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
from confluent_kafka import KafkaError, Message, Producer

from tests.tooling.checker import ProducedRecord, SinkRow

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "include" / "stack" / "stack.sh"
SCHEMA = {"event_id": "string", "seq": "long", "amount": "double", "checksum": "string"}


def payload(event_id: str, seq: int) -> dict[str, Any]:
    amount = round(random.Random(seq).uniform(0, 1000), 2)
    return {"event_id": event_id, "seq": seq, "amount": amount,
            "checksum": hashlib.sha1(f"{event_id}|{seq}|{amount}".encode()).hexdigest()}


class Workload:
    """Produces to one topic and records what Kafka acknowledged."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, prefix: str) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.partitions = partitions
        self.prefix = prefix
        self.produced: dict[str, ProducedRecord] = {}
        self._seq = 0
        self._tx: Producer | None = None
        self.transactions = {"committed": 0, "aborted": 0}

    def _next(self) -> tuple[str, bytes, int]:
        seq = self._seq
        self._seq += 1
        rec = payload(f"{self.prefix}-{seq}", seq)
        return rec["event_id"], json.dumps(rec).encode(), seq % self.partitions

    @staticmethod
    def _on_delivery(pending: list[tuple[str, str, Message]]
                     ) -> Callable[[KafkaError | None, Message], None]:
        def cb(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                rec = json.loads(msg.value() or b"{}")
                pending.append((rec["event_id"], rec["checksum"], msg))
        return cb

    def _record(self, pending: list[tuple[str, str, Message]], committed: bool) -> None:
        for rid, checksum, msg in pending:
            self.produced[rid] = ProducedRecord(rid, checksum, msg.topic() or self.topic,
                                                int(msg.partition() or 0),
                                                int(msg.offset() or 0), committed)

    def plain(self, n: int) -> None:
        p = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                      "linger.ms": 20})
        pending: list[tuple[str, str, Message]] = []
        cb = self._on_delivery(pending)
        for i in range(n):
            _, value, part = self._next()
            p.produce(self.topic, value, partition=part, on_delivery=cb)
            if i % 10_000 == 0:
                p.poll(0)
        if p.flush(60):
            raise RuntimeError("not every record was delivered")
        self._record(pending, True)

    def transaction(self, n: int, commit: bool) -> None:
        if self._tx is None:
            self._tx = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5,
                                 "transactional.id": f"offsetflow-chaos-{self.prefix}"})
            self._tx.init_transactions(60)
        tx = self._tx
        pending: list[tuple[str, str, Message]] = []
        cb = self._on_delivery(pending)
        tx.begin_transaction()
        for _ in range(n):
            _, value, part = self._next()
            tx.produce(self.topic, value, partition=part, on_delivery=cb)
        tx.flush(60)
        if commit:
            tx.commit_transaction(60)
            self.transactions["committed"] += 1
        else:
            tx.abort_transaction(60)
            self.transactions["aborted"] += 1
        self._record(pending, commit)

    def mixed(self, n: int, rng: random.Random, abort_ratio: float = 0.3) -> None:
        """About `n` records: plain writes and transactions, some aborted at random."""
        written = 0
        while written < n:
            k = min(n - written, rng.randint(50, 2000))
            if rng.random() < 0.5:
                self.plain(k)
            else:
                self.transaction(k, commit=rng.random() >= abort_ratio)
            written += k

    @property
    def committed_count(self) -> int:
        return sum(1 for p in self.produced.values() if p.committed)


def sink_rows(dsn: str, table: str) -> list[SinkRow]:
    from psycopg2 import sql

    from offsetflow.ledger import qualified

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT event_id, checksum, topic, partition, \"offset\" "
                                "FROM {}").format(qualified(table)))
            return [SinkRow(*r) for r in cur.fetchall()]
    finally:
        conn.close()


# -- faults -----------------------------------------------------------------------------
def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def kill(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process started with start_new_session=True, with its Spark JVM."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


@contextlib.contextmanager
def hold_positions(dsn: str, pipeline: str) -> Iterator[None]:
    """Lock the pipeline's position rows: only a commit touches them (its fencing step), so
    a job stages everything and then blocks inside its commit transaction, which is the
    window for a fault. Planning and staging never wait on these rows."""
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM offsetflow.positions WHERE pipeline = %s FOR UPDATE",
                        (pipeline,))
            if cur.rowcount == 0:
                raise RuntimeError(f"pipeline {pipeline} has no positions to hold yet")
            yield
        conn.rollback()
    finally:
        conn.close()


def staged_rows(dsn: str, batch_id: int) -> int:
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn, conn.cursor() as cur:
            cur.execute("""SELECT COALESCE(sum(rows_staged), 0) FROM offsetflow.staged_parts
                            WHERE batch_id = %s AND kind = 'rows'""", (batch_id,))
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def commit_waiting(dsn: str) -> bool:
    """True when an OffsetFlow connection is blocked on a lock (a commit waiting)."""
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn, conn.cursor() as cur:
            cur.execute("""SELECT count(*) FROM pg_stat_activity
                            WHERE application_name = 'offsetflow' AND wait_event_type = 'Lock'
                              AND datname = current_database()""")
            row = cur.fetchone()
            return bool(row and row[0])
    finally:
        conn.close()


def cut_commit_connection(dsn: str) -> int:
    """pg_terminate_backend every OffsetFlow connection waiting on a lock."""
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn, conn.cursor() as cur:
            cur.execute("""SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                            WHERE application_name = 'offsetflow' AND wait_event_type = 'Lock'
                              AND datname = current_database()""")
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def stack(*args: str, timeout_s: float = 180) -> None:
    subprocess.run(["bash", str(STACK), *args], check=True, timeout=timeout_s,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def restart_postgres() -> None:
    stack("pg-stop")
    stack("pg-start")


def stop_kafka() -> None:
    stack("kafka-stop")


def start_kafka() -> None:
    stack("kafka-start")


def run_batch_process(pipeline_file: Path, batch_id: int, log: Path) -> subprocess.Popen[Any]:
    """`offsetflow run-batch` as its own process group (so a kill takes its JVM too)."""
    out = log.open("ab")
    return subprocess.Popen(
        ["offsetflow", "run-batch", "--pipeline-file", str(pipeline_file), "--batch-id",
         str(batch_id)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OFFSETFLOW_SPARK_LOG_LEVEL": "ERROR"})


def maybe_fail_task(df: Any) -> Any:
    """A pipeline transform for soak runs: with OFFSETFLOW_CHAOS_TASK_FAIL=1 in the job's
    environment, the first attempt of every other Spark task fails halfway through its rows
    (Spark retries it); otherwise rows pass through unchanged."""
    if os.environ.get("OFFSETFLOW_CHAOS_TASK_FAIL") != "1":
        return df

    def gen(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        seen = 0
        for b in batches:
            seen += b.num_rows
            yield b
            if ctx is not None and ctx.attemptNumber() == 0 and ctx.partitionId() % 2 == 0 \
                    and seen >= 20:
                raise RuntimeError(f"chaos: task {ctx.partitionId()} attempt 0 fails after "
                                   f"{seen} rows")

    return df.mapInArrow(gen, df.schema)
