"""Great Expectations quality gate on real staged batches (issue: data quality gate)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from offsetflow.ledger import Ledger
from offsetflow.quality import QualityGateError
from offsetflow.runner import run_cycle
from tests.integration.helpers import pipeline_for, query


@pytest.fixture
def gx_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import great_expectations as gx
    import great_expectations.expectations as gxe

    ctx = gx.get_context(mode="file", project_root_dir=str(tmp_path))
    ctx.suites.add_or_update(gx.ExpectationSuite(name="amounts", expectations=[
        gxe.ExpectColumnValuesToBeBetween(column="amount", min_value=0, max_value=1000),
        gxe.ExpectColumnValuesToNotBeNull(column="event_id"),
    ]))
    monkeypatch.setenv("OFFSETFLOW_GX_ROOT", str(tmp_path))
    return tmp_path


def produce_with_negative_amounts(bootstrap: str, topic: str) -> list[int]:
    p = Producer({"bootstrap.servers": bootstrap})
    bad = []
    for i in range(100):
        amount = -5.0 if i % 25 == 7 else float(i)
        if amount < 0:
            bad.append(i)
        p.produce(topic, json.dumps({"event_id": f"e{i}", "seq": i, "amount": amount,
                                     "checksum": "x"}).encode(), partition=0)
    p.flush(30)
    return bad  # offsets of the rows that break the suite (one partition, one per offset)


def test_failing_batch_is_not_committed_and_result_is_in_ledger(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        gx_root: Path) -> None:
    topic = make_topic("gx", 1)
    bad = produce_with_negative_amounts(kafka_bootstrap, topic)
    table = f"gx_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table,
                       quality={"suite": "amounts", "on_failure": "fail"})
    with pytest.raises(QualityGateError) as ei:
        run_cycle(cfg, pg_dsn, spark)
    assert "expect_column_values_to_be_between on amount: 4 of 100 rows" in str(ei.value)
    with Ledger(pg_dsn) as ledger:
        b = ledger.recent_batches(cfg.name)[0]
        assert ledger.positions(cfg.name) == {(topic, 0): 0}  # the start, nothing committed
    assert b.status == "failed" and b.quality is not None
    assert b.quality["success"] is False
    failed = [e for e in b.quality["expectations"] if not e["success"]]
    assert [(e["expectation"], e["column"], e["unexpected_count"]) for e in failed] == [
        ("expect_column_values_to_be_between", "amount", len(bad))]
    assert failed[0]["sample_values"][0] == "-5.0"
    assert query(pg_dsn, f"SELECT count(*) FROM {table}")[0][0] == 0
    assert (gx_root / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html").exists()


def test_dead_letter_policy_commits_good_rows_and_routes_bad_ones(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        gx_root: Path) -> None:
    topic = make_topic("gxd", 1)
    bad = produce_with_negative_amounts(kafka_bootstrap, topic)
    table = f"gxd_{unique}"
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, table,
                       quality={"suite": "amounts", "on_failure": "dead_letter"},
                       dead_letter_table=f"gxdead_{unique}")
    res = run_cycle(cfg, pg_dsn, spark)
    assert res.report is not None and res.report.result.status == "committed"
    assert res.report.result.rows_written == 100 - len(bad)
    dead = query(pg_dsn, f"SELECT topic, partition, \"offset\", stage, error, value "
                         f"FROM gxdead_{unique} ORDER BY \"offset\"")
    assert [(d[0], d[1], d[2], d[3]) for d in dead] == [(topic, 0, o, "quality") for o in bad]
    assert "expect_column_values_to_be_between(amount)" in dead[0][4]
    assert json.loads(bytes(dead[0][5]))["amount"] == -5.0
    offsets = {r[0] for r in query(pg_dsn, f"SELECT \"offset\" FROM {table}")}
    assert offsets == set(range(100)) - set(bad)
    with Ledger(pg_dsn) as ledger:
        b = ledger.get_batch(res.report.batch_id)
        assert ledger.positions(cfg.name) == {(topic, 0): 100}
    assert b.quality is not None and b.quality["routed_rows"] == len(bad)
    assert b.quality["policy"] == "dead_letter"
