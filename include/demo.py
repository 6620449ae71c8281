"""`make demo`: the main job on local defaults, for real.

Creates the `orders` topic, produces sample order events (plain, one committed and one
aborted transaction, and one malformed record), runs the `orders` pipeline
(include/pipelines/orders.yaml) for a few rate-limited micro-batches on local Spark, and
prints what was committed, read back from PostgreSQL.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import uuid
from datetime import UTC, datetime

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import find_pipeline
from offsetflow.ledger import Ledger
from offsetflow.orchestration.connections import resolve
from offsetflow.runner import run_until_caught_up
from offsetflow.status import format_status, pipeline_status

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


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
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

    results = run_until_caught_up(cfg, dsn, max_batches=20, started_by="demo")
    print("\nmicro-batches:")
    for r in results:
        s = r.summary()
        if s["batch_id"] is None:
            print("  (caught up: nothing new to read)")
        else:
            with Ledger(dsn) as ledger:
                q = ledger.get_batch(s["batch_id"]).quality or {}
            quality = f", quality suite {q['suite']}: {q['summary']}" if q else ""
            print(f"  batch {s['batch_id']}: {s['status']}, {s['rows_written']} rows, "
                  f"{s['bad_records']} dead letters, read+stage {s.get('read_stage_s')}s"
                  f"{quality}")

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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
