"""Planning under contention on real Kafka and PostgreSQL: two planners of one pipeline at
once plan one batch (the other re-uses it), never two overlapping ones."""

from __future__ import annotations

import threading
from typing import Any

from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from offsetflow.plan import PlanOutcome
from tests.tooling.pipeline_data import pipeline_for, produce_plain


def test_two_planners_at_once_plan_one_batch(pg_dsn: str, kafka_bootstrap: str,
                                             make_topic: Any, unique: str) -> None:
    topic = make_topic("pc", 4)
    produce_plain(kafka_bootstrap, topic, 400, f"c{unique}", 4)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"pc_{unique}", starting="latest")
    # first plan under `latest`: both planners must resolve the start once, the same way
    assert plan_only(cfg, pg_dsn).batch is None
    produce_plain(kafka_bootstrap, topic, 400, f"d{unique}", 4, start_seq=400)
    outcomes: list[PlanOutcome] = []
    errors: list[BaseException] = []
    go = threading.Barrier(4)

    def plan() -> None:
        try:
            go.wait()
            outcomes.append(plan_only(cfg, pg_dsn))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=plan) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    ids = {o.batch_id for o in outcomes}
    assert len(ids) == 1 and sum(not o.reused for o in outcomes) == 1
    with Ledger(pg_dsn) as ledger:
        batch = ledger.get_batch(ids.pop())  # type: ignore[arg-type]
        assert len(ledger.recent_batches(cfg.name)) == 1
    assert sorted((r.partition, r.from_offset, r.until_offset) for r in batch.ranges) == \
        [(p, 100, 200) for p in range(4)]
