"""The Kafka sink's stage read (`select_sql`), on PostgreSQL alone:
the commit streams the stage in source order without sorting the batch first (the plan
has no Sort node), whether the stage is split into parts (the fused path) or not (a
transform run stages into the stage table itself), and the order it gives is source order
per partition."""

from __future__ import annotations

import re
from typing import Any

from tests.tooling.kafka_case import kafka_sink_pipeline

# a Sort node (Merge Append's own "Sort Key" line is no such node)
SORT_NODE = re.compile(r"(^|->\s+)(Incremental )?Sort\s+\(")


def test_a_batch_of_only_aborted_records_commits_with_no_record(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str) -> None:
    """A batch whose ranges hold only an aborted transaction stages no row: the commit
    indexes an empty stage, produces nothing and still commits the source offsets."""
    from offsetflow.job import run_batch
    from offsetflow.ops import plan_only
    from tests.tooling.chaos import Workload
    from tests.tooling.topic_checker import read_topic

    src = make_topic("kz-src", 2)
    out = make_topic("kz-out", 2)
    w = Workload(kafka_bootstrap, src, 2, f"kz{unique}")
    w.transaction(6, commit=False)
    cfg = kafka_sink_pipeline(f"kz_{unique}", src, pg_dsn, kafka_bootstrap, topic=out,
                              partitioning="source", headers="none", split=2)
    planned = plan_only(cfg, pg_dsn)
    assert planned.batch is not None
    rep = run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert rep.result.status == "committed" and rep.result.rows_written == 0, rep.result
    assert read_topic(kafka_bootstrap, out) == []
