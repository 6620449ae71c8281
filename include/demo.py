"""`make demo`: the main job on local defaults, for real.

Creates the `orders` topic, produces sample order events (plain, one committed and one
aborted transaction, and one malformed record), runs the `orders` pipeline
(include/pipelines/orders.yaml) for a few rate-limited micro-batches on local Spark, and
prints what was committed, read back from PostgreSQL: one line per batch and a summary on
the console, the full log in the file it names (`-v`: INFO logs on the console too).
"""

from __future__ import annotations

import json
import logging
import random
import re
import sys
import uuid
from datetime import UTC, datetime

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.cli.console import progress_line, setup_logging
from offsetflow.config import find_pipeline
from offsetflow.ledger import Ledger
from offsetflow.ops import CycleResult, format_status, pipeline_status, run_until_caught_up
from offsetflow.orchestration.connections import resolve

log = logging.getLogger("offsetflow.demo")


def order(i: int, run: str) -> bytes:
    rnd = random.Random(i)
    return json.dumps({
        "order_id": f"{run}-{i}", "customer": f"c{rnd.randint(1, 50)}",
        "amount": round(rnd.uniform(5, 500), 2), "quantity": rnd.randint(1, 9),
        "created_at": datetime.now(UTC).isoformat(),
    }).encode()


def produce(bootstrap: str, topic: str, run: str, n: int) -> dict[str, int]:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True})
    for i in range(n):
        p.produce(topic, order(i, run), key=f"{run}-{i}".encode())
    p.flush(60)
    tx = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"demo-{run}"})
    tx.init_transactions(30)
    tx.begin_transaction()
    for i in range(n, n + 500):
        tx.produce(topic, order(i, run))
    tx.commit_transaction(30)
    tx.begin_transaction()
    for i in range(n + 500, n + 800):
        tx.produce(topic, order(i, f"{run}-aborted"))
    tx.flush(30)
    tx.abort_transaction(30)
    p.produce(topic, b'{"order_id": "broken', key=b"broken")
    p.flush(30)
    return {"committed": n + 500, "aborted": 300, "malformed": 1}


def show(dsn: str, res: CycleResult) -> None:
    """The batch's progress line, with its quality result when it has one."""
    s = res.summary()
    quality = ""
    if s["batch_id"] is not None:
        with Ledger(dsn) as ledger:
            q = ledger.get_batch(s["batch_id"]).quality or {}
        quality = f"; quality suite {q['suite']}: {q['summary']}" if q else ""
    batch = res.plan.batch
    print("  " + progress_line(s, list(batch.ranges) if batch else []) + quality, flush=True)


def main() -> int:
    verbose = sum(a.count("v") for a in sys.argv[1:] if re.fullmatch(r"-v+", a))
    log_file = setup_logging(verbose)
    cfg = resolve(find_pipeline("orders"))  # orders.yaml names Airflow connections
    dsn = cfg.sink.connection
    with Ledger(dsn) as ledger:
        ledger.upgrade()
    admin = AdminClient({"bootstrap.servers": cfg.bootstrap_servers})
    topic = cfg.topics[0]
    if topic not in admin.list_topics(timeout=10).topics:
        admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(30)
    run = uuid.uuid4().hex[:6]
    sent = produce(cfg.bootstrap_servers, topic, run, 30_000)
    print(f"produced to {topic}: {sent}")

    print("\nmicro-batches:", flush=True)
    run_until_caught_up(cfg, dsn, max_batches=20, started_by="demo",
                        on_cycle=lambda res: show(dsn, res))

    import psycopg2

    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT count(*), count(DISTINCT (topic, partition, \"offset\")) FROM "
                    "public.orders WHERE order_id LIKE %s", (f"{run}-%",))
        n, distinct = cur.fetchone()  # type: ignore[misc]
        cur.execute("SELECT count(*) FROM public.orders WHERE order_id LIKE %s",
                    (f"{run}-aborted-%",))
        aborted = cur.fetchone()[0]  # type: ignore[index]
        cur.execute("SELECT topic, partition, \"offset\", order_id, customer, amount "
                    "FROM public.orders WHERE order_id LIKE %s ORDER BY created_at DESC, "
                    "\"offset\" DESC LIMIT 5", (f"{run}-%",))
        sample = cur.fetchall()
        cur.execute("SELECT topic, partition, \"offset\", error FROM public.offsetflow_dead_letter"
                    " ORDER BY recorded_at DESC LIMIT 3")
        dead = cur.fetchall()
    conn.close()
    print(f"\ncommitted to public.orders for run {run}: {n} rows ({distinct} distinct "
          f"source offsets), aborted rows visible: {aborted}")
    for row in sample:
        print(f"  {row}")
    print("dead letters (latest):")
    for row in dead:
        print(f"  {row}")
    print()
    print(format_status(pipeline_status(cfg, dsn, recent=5)))
    ok = n == sent["committed"] == distinct and aborted == 0
    print("\nDEMO OK: every committed event exactly once, no aborted event" if ok
          else "\nDEMO FAILED: counts do not match")
    if log_file is not None:
        print(f"full log: {log_file} (-v for INFO logs on the console)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
