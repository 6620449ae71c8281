"""The Kafka sink's stage read (`select_sql` after `order_index_sql`), on PostgreSQL alone:
the commit streams the stage in source order without sorting the batch first (the plan
has no Sort node), whether the stage is split into parts (the fused path) or not (a
transform run stages into the stage table itself), and the order it gives is source order
per partition."""

from __future__ import annotations

import re
from typing import Any

import psycopg2
import pytest
from psycopg2 import sql

from offsetflow.commit import create_stage_tables
from offsetflow.job.tasks import stage_columns
from offsetflow.ledger import stage_part_table, stage_table
from offsetflow.sinks.kafka.form import order_index_sql, select_sql
from tests.tooling.kafka_case import kafka_sink_pipeline

# a Sort node (Merge Append's own "Sort Key" line is no such node)
SORT_NODE = re.compile(r"(^|->\s+)(Incremental )?Sort\s+\(")


@pytest.mark.parametrize("parts", [0, 3])
def test_the_stage_streams_in_source_order_without_a_sort(pg_dsn: str, unique: str,
                                                          parts: int) -> None:
    cfg = kafka_sink_pipeline(f"so_{unique}", "src", pg_dsn, "127.0.0.1:1", topic="out")
    columns = stage_columns(cfg)
    bid = 2_000_000_000 + int(unique, 16) % 100_000_000  # no batch of the ledger
    create_stage_tables(pg_dsn, bid, columns, parts=parts)
    conn = psycopg2.connect(pg_dsn)
    try:
        with conn.cursor() as cur:
            names = [c for c, _ in columns]
            # offsets of two partitions spread over the parts against their order
            for i in range(3000):
                table = (stage_part_table(bid, i % parts) if parts
                         else stage_table(bid))
                cur.execute(sql.SQL("INSERT INTO {} (topic, partition, \"offset\", value) "
                                    "VALUES ('src', %s, %s, '\\x7b7d')").format(table),
                            ((i * 7) % 2, 3000 - i))
            conn.commit()
            cur.execute("SET LOCAL jit = off")
            cur.execute(order_index_sql(bid))
            assert cfg.sink.kafka is not None
            query = select_sql(cfg.sink.kafka, dict(columns), stage_table(bid))
            cur.execute(sql.SQL("EXPLAIN DECLARE c CURSOR FOR {}").format(query))
            plan = [r[0] for r in cur.fetchall()]
            assert not [line for line in plan if SORT_NODE.search(line.strip())], \
                "\n".join(plan)
            cur.execute(query)
            rows: list[Any] = cur.fetchall()
            assert len(rows) == 3000 and names
            for p in (0, 1):
                offsets = [r[2] for r in rows if r[1] == p]
                assert offsets == sorted(offsets), p
        conn.rollback()
    finally:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {} CASCADE").format(stage_table(bid)))
            cur.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(
                sql.Identifier("offsetflow_stage", f"b{bid}_dead")))
        conn.commit()
        conn.close()


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
