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
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import yaml
from confluent_kafka import KafkaError, Message, Producer

from tests.tooling.checker import DeadLetter, ProducedRecord, SinkRow

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "include" / "stack" / "stack.sh"
SCHEMA = {"event_id": "string", "seq": "long", "amount": "double", "checksum": "string"}
# with large records: `pad` carries the bulk; the checker compares its md5 (see sink_rows)
SCHEMA_WITH_PAD = {**SCHEMA, "pad": "string"}
LARGE_RECORD_BYTES = 1_000_000  # Kafka's default maximum is 1,048,588 bytes per batch
# a producer's own cap (librdkafka's default is 1,000,000 bytes, key and headers included)
PRODUCER_MAX_BYTES = 1_048_588


def payload(event_id: str, seq: int) -> dict[str, Any]:
    amount = round(random.Random(seq).uniform(0, 1000), 2)
    return {"event_id": event_id, "seq": seq, "amount": amount,
            "checksum": hashlib.sha1(f"{event_id}|{seq}|{amount}".encode()).hexdigest()}


def pad_text(seq: int, size: int) -> str:
    """`size` ASCII bytes that differ per record (a truncated or mixed-up value shows)."""
    unit = hashlib.sha1(str(seq).encode()).hexdigest()
    return (unit * (size // len(unit) + 1))[:size]


def expected_checksum(checksum: str, pad: str | None) -> str:
    """What sink_rows reports for a row: the payload checksum, with the pad's md5 if any."""
    return f"{checksum}:{hashlib.md5(pad.encode()).hexdigest()}" if pad else checksum


# one record as the producer sees it: (record id, checksum the sink must show, tombstone?)
Pending = list[tuple[str, str, bool, Message]]


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
        self.kinds: Counter[str] = Counter()  # records acknowledged, by kind

    def _next(self, pad_bytes: int = 0) -> tuple[str, bytes, int, str]:
        seq = self._seq
        self._seq += 1
        rec = payload(f"{self.prefix}-{seq}", seq)
        pad = pad_text(seq, pad_bytes) if pad_bytes else None
        if pad:
            rec["pad"] = pad
        return (rec["event_id"], json.dumps(rec).encode(), seq % self.partitions,
                expected_checksum(rec["checksum"], pad))

    def _next_tombstone(self) -> tuple[str, int]:
        seq = self._seq
        self._seq += 1
        return f"{self.prefix}-{seq}", seq % self.partitions

    @staticmethod
    def _on_delivery(pending: Pending, rid: str, checksum: str, tombstone: bool
                     ) -> Callable[[KafkaError | None, Message], None]:
        def cb(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                pending.append((rid, checksum, tombstone, msg))
        return cb

    def _record(self, pending: Pending, committed: bool, kind: str = "plain") -> None:
        for rid, checksum, tombstone, msg in pending:
            self.produced[rid] = ProducedRecord(rid, checksum, msg.topic() or self.topic,
                                                int(msg.partition() or 0),
                                                int(msg.offset() or 0), committed, tombstone)
        self.kinds[kind] += len(pending)

    def _producer(self, **conf: Any) -> Producer:
        return Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True,
                         "linger.ms": 20, **conf})

    def plain(self, n: int) -> None:
        p = self._producer()
        pending: Pending = []
        for i in range(n):
            rid, value, part, checksum = self._next()
            p.produce(self.topic, value, partition=part,
                      on_delivery=self._on_delivery(pending, rid, checksum, False))
            if i % 10_000 == 0:
                p.poll(0)
        if p.flush(60):
            raise RuntimeError("not every record was delivered")
        self._record(pending, True)

    def large(self, n: int, size: int = LARGE_RECORD_BYTES) -> None:
        """`n` records whose value is about `size` bytes (1 MB: Kafka's default maximum)."""
        p = self._producer(**{"message.max.bytes": PRODUCER_MAX_BYTES})
        pending: Pending = []
        for _ in range(n):
            rid, value, part, checksum = self._next(pad_bytes=size - 200)
            p.produce(self.topic, value, partition=part,
                      on_delivery=self._on_delivery(pending, rid, checksum, False))
            p.poll(0)
        if p.flush(120):
            raise RuntimeError("not every large record was delivered")
        self._record(pending, True, "large")

    def tombstones(self, n: int) -> None:
        """`n` records with a key and a null value: "delete this key" on a changelog."""
        p = self._producer()
        pending: Pending = []
        for _ in range(n):
            rid, part = self._next_tombstone()
            p.produce(self.topic, None, key=rid.encode(), partition=part,
                      on_delivery=self._on_delivery(pending, rid, "", True))
        if p.flush(60):
            raise RuntimeError("not every tombstone was delivered")
        self._record(pending, True, "tombstone")

    def transaction(self, n: int, commit: bool) -> None:
        if self._tx is None:
            self._tx = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5,
                                 "transactional.id": f"offsetflow-chaos-{self.prefix}"})
            self._tx.init_transactions(60)
        tx = self._tx
        pending: Pending = []
        tx.begin_transaction()
        for _ in range(n):
            rid, value, part, checksum = self._next()
            tx.produce(self.topic, value, partition=part,
                       on_delivery=self._on_delivery(pending, rid, checksum, False))
        tx.flush(60)
        if commit:
            tx.commit_transaction(60)
            self.transactions["committed"] += 1
        else:
            tx.abort_transaction(60)
            self.transactions["aborted"] += 1
        self._record(pending, commit, "transactional" if commit else "aborted")

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
    """The target's rows as the checker sees them; with a `pad` column (large records) the
    checksum carries the pad's md5, so a truncated or swapped value is caught."""
    from psycopg2 import sql

    from offsetflow.ledger import qualified

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT * FROM {} LIMIT 0").format(qualified(table)))
            names = {d[0] for d in cur.description or ()}
            checksum = sql.SQL("checksum || CASE WHEN coalesce(pad, '') = '' THEN '' "
                               "ELSE ':' || md5(pad) END" if "pad" in names else "checksum")
            cur.execute(sql.SQL("SELECT event_id, {}, topic, partition, \"offset\" "
                                "FROM {}").format(checksum, qualified(table)))
            return [SinkRow(*r) for r in cur.fetchall()]
    finally:
        conn.close()


def dead_letters(dsn: str, table: str, pipeline: str) -> list[DeadLetter]:
    """The pipeline's rows in its dead-letter table (none if the table does not exist)."""
    from psycopg2 import sql

    from offsetflow.ledger import qualified

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT to_regclass(%s)", (table,))
            row = cur.fetchone()
            if not row or row[0] is None:
                return []
            cur.execute(sql.SQL("SELECT topic, partition, \"offset\", error FROM {} "
                                "WHERE pipeline = %s").format(qualified(table)), (pipeline,))
            return [DeadLetter(*r) for r in cur.fetchall()]
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


BLOCKED_BY_CHAOS = ("EXISTS (SELECT 1 FROM pg_stat_activity h WHERE h.pid = ANY(pg_blocking_pids("
                    "pg_stat_activity.pid)) AND h.application_name = 'offsetflow-chaos')")


def commit_waiting(dsn: str) -> bool:
    """True when an OffsetFlow connection waits for a lock `hold_positions` holds: a commit
    at its fencing step. Only that holder counts: on the transform path the tasks' own
    connections wait on each other briefly while staging (catalog and marker locks), and
    taking one of those for the commit put the fault before staging had finished."""
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn, conn.cursor() as cur:
            cur.execute(f"""SELECT count(*) FROM pg_stat_activity
                            WHERE application_name = 'offsetflow' AND wait_event_type = 'Lock'
                              AND datname = current_database() AND {BLOCKED_BY_CHAOS}""")
            row = cur.fetchone()
            return bool(row and row[0])
    finally:
        conn.close()


def cut_commit_connection(dsn: str) -> int:
    """pg_terminate_backend every OffsetFlow connection waiting for `hold_positions`."""
    conn = psycopg2.connect(dsn, application_name="offsetflow-chaos")
    try:
        with conn, conn.cursor() as cur:
            cur.execute(f"""SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                            WHERE application_name = 'offsetflow' AND wait_event_type = 'Lock'
                              AND datname = current_database() AND {BLOCKED_BY_CHAOS}""")
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


def stack(*args: str, timeout_s: float = 180) -> None:
    """`stack.sh ARGS`; a failure raises with the script's own last lines (its [stack] ERROR
    says why: a port taken, a service not ready), not only its exit status."""
    p = subprocess.run(["bash", str(STACK), *args], timeout=timeout_s,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"stack.sh {' '.join(args)} failed ({p.returncode}):\n"
                           f"{p.stderr[-3000:]}")


def restart_postgres() -> None:
    """A clean stop and start (`-m fast`: unlogged tables keep their data)."""
    stack("pg-stop")
    stack("pg-start")


def crash_postgres(restart: bool = True) -> None:
    """`pg_ctl stop -m immediate`: no shutdown checkpoint, so recovery replays WAL and
    empties every UNLOGGED table, as a host crash or a failover does. Then start it again
    unless `restart` is False (the caller starts it with `stack("pg-start")`)."""
    stack("pg-crash")
    if restart:
        stack("pg-start")


def stop_kafka() -> None:
    stack("kafka-stop")


def start_kafka() -> None:
    stack("kafka-start")


def kill_kafka(restart: bool = True) -> None:
    """kill -9 of the broker (no controlled shutdown, no log flush), then start it again
    unless `restart` is False."""
    stack("kafka-kill")
    if restart:
        stack("kafka-start")


def _socket_owner(local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The pid of the process holding the IPv4 TCP socket `local` -> `remote` (a client's
    end, as the server side saw its peer), or None if it is gone or not ours to read."""
    def hexaddr(addr: tuple[str, int]) -> str:
        a, b, c, d = (int(x) for x in addr[0].split("."))
        return f"{d:02X}{c:02X}{b:02X}{a:02X}:{addr[1]:04X}"

    want = (hexaddr(local), hexaddr(remote))
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if (f[1], f[2]) == want:
            inode = f[9]
            break
    if inode is None:
        return None
    link = f"socket:[{inode}]"
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (d / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == link:
                        return int(d.name)
    return None


def wait_for_reconnect(bootstrap: str, of_pid: int, unless: Callable[[], bool],
                       timeout_s: float = 120) -> int | None:
    """With the broker of `bootstrap` dead: listen on its port until a client process
    descending from `of_pid` (or `of_pid` itself, unless it is the test's own process)
    tries to connect, i.e. its Kafka client now retries against the dead broker; the
    connection is reset at once (the client retries on). Returns that client's pid, or None
    once `unless()` is true (no client is left to retry: the run ended). A wait on that
    condition, not a fixed sleep after the kill: the client's reconnect backoff
    (librdkafka: 100 ms doubling to 10 s at most) bounds it."""
    import socket
    import struct

    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    table = proc_table()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, int(port)))
    srv.listen(16)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for a Kafka "
                                   f"client of process {of_pid} to reconnect to {bootstrap}")
            if unless():
                return None
            srv.settimeout(min(left, 0.2))
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                continue
            try:
                pid = _socket_owner(peer, (host, int(port)))
                if pid is not None and pid not in table:  # a process started since
                    table = proc_table()
                if pid is not None and pid != os.getpid() and descends(table, pid, of_pid):
                    return pid
            finally:
                # RST, not FIN: no TIME_WAIT left on the broker's port for its restart
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
    finally:
        srv.close()


def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, command line) of every process we can read."""
    table: dict[int, tuple[int, int, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(d.name)] = (int(fields[1]), int(fields[2]), cmd)
    return table


def descends(table: dict[int, tuple[int, int, str]], pid: int, root: int) -> bool:
    """Whether `pid` is `root` or a descendant of it in a `proc_table()`."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid == root:
            return True
        pid = table.get(pid, (0, 0, ""))[0]
        seen += 1
    return False


def python_workers(job_pid: int) -> list[int]:
    """Spark's Python workers of one job: the processes that its `pyspark.daemon` forked
    for tasks, not the daemon itself. Found by ancestry: the daemon puts itself in a process
    group of its own."""
    table = proc_table()
    daemons = {pid for pid, (_, _, cmd) in table.items() if "pyspark.daemon" in cmd}
    roots = {pid for pid in daemons
             if table[pid][0] not in daemons and descends(table, pid, job_pid)}
    return sorted(pid for pid, (ppid, _, _) in table.items() if ppid in roots)


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process in clock ticks, None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def kill_python_worker(job_pid: int, timeout_s: float = 180) -> int:
    """kill -9 one Python worker of the job while it runs a task; returns its pid. Spark
    sees the task fail with "Python worker exited unexpectedly" and retries it when the
    master allows retries (local[N,F]). A worker between tasks (Spark reuses them) waits
    idle on its socket, and Spark silently replaces an idle one that died, so only a
    worker burning CPU is killed: one whose CPU time grew while it was watched."""
    found: list[int] = []

    def busy_worker() -> bool:
        before = {pid: _cpu_ticks(pid) for pid in python_workers(job_pid)}
        if not before:
            return False
        time.sleep(0.05)
        found[:] = [pid for pid, t in before.items()
                    if t is not None and (_cpu_ticks(pid) or -1) > t]
        return bool(found)

    wait_for(busy_worker, timeout_s, f"a busy Spark Python worker of job process {job_pid}",
             every_s=0.01)
    os.kill(found[0], signal.SIGKILL)
    return found[0]


def run_batch_process(pipeline_file: Path, batch_id: int, log: Path,
                      env: dict[str, str] | None = None) -> subprocess.Popen[Any]:
    """`offsetflow run-batch` as its own process group (so a kill takes its JVM too)."""
    out = log.open("ab")
    return subprocess.Popen(
        ["offsetflow", "run-batch", "--pipeline-file", str(pipeline_file), "--batch-id",
         str(batch_id)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OFFSETFLOW_SPARK_LOG_LEVEL": "ERROR", **(env or {})})


def connect_file(pipeline_file: Path, url: str) -> Path:
    """A copy of the pipeline file with `spark.launch: connect` on the server at `url`,
    beside it (`NAME.connect.yaml`): run-batch with it is a thin Spark Connect client of the
    warm server, no JVM or Python workers of its own (~3 CPU s, not ~15). For a fault that
    hits the driver's own steps (its commit), where the batch's Spark tasks have all ended;
    a kill while tasks run needs the job's own JVM (they would go on on the server). The
    spark section is not in the config's fingerprint: batches planned with either file run
    with the other."""
    raw = yaml.safe_load(pipeline_file.read_text())
    raw.setdefault("spark", {}).update({"launch": "connect", "connect_url": url})
    out = pipeline_file.with_name(f"{pipeline_file.stem}.connect.yaml")
    out.write_text(yaml.safe_dump(raw))
    return out


class JobThread:
    """A run of a batch in a thread of the test process with its warm Spark session, with
    Popen's `poll` and `wait` (0, or 1 with `error` set): for a fault of a service (the
    ledger's PostgreSQL stopped or crashed while the commit waits, the broker killed while
    tasks read) that a job process meets the same way, since the process is not what is
    killed; no JVM of its own. A kill -9 of the driver needs a process (`Case.job`)."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.error: BaseException | None = None
        self.result: Any = None
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], Any]) -> None:
        try:
            self.result = run()
        except BaseException as e:  # noqa: BLE001 - reported by wait()/poll()
            self.error = e

    def poll(self) -> int | None:
        if self._thread.is_alive():
            return None
        return 1 if self.error is not None else 0

    def wait(self, timeout: float) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("run_batch in a thread", timeout)
        return 1 if self.error is not None else 0


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
