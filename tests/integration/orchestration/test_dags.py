"""The DAGs run for real: `airflow dags test` with spark-submit in local mode against the
real Kafka and PostgreSQL (issue: Airflow orchestration)."""

from __future__ import annotations

import subprocess
from collections import Counter
from typing import Any

import pytest
import yaml

from offsetflow.ledger import Ledger
from tests.tooling.airflow_dags import dags_test
from tests.tooling.pipeline_data import produce_plain, query

pytestmark = pytest.mark.slow  # Airflow runs each DAG (dags test) with a Spark job


def test_scheduled_run_commits_a_batch_and_empty_run_skips_spark(
        airflow_project: dict[str, Any], pg_dsn: str, kafka_bootstrap: str) -> None:
    p = airflow_project
    produce_plain(kafka_bootstrap, p["topic"], 600, f"s{p['name']}", 2)
    out = dags_test(p, f"offsetflow_{p['name']}")
    assert "spark-submit" in out or "SparkSubmit" in out
    assert p["password"] not in out  # the task log never shows credentials
    with Ledger(pg_dsn) as ledger:
        batches = ledger.recent_batches(p["name"])
        positions = ledger.positions(p["name"])
    assert [(b.kind, b.status) for b in batches] == [("scheduled", "committed")]
    assert batches[0].started_by.startswith(f"airflow:offsetflow_{p['name']}")
    # its timings (issue 31): due when the run was triggered (`dags test`: a manual run),
    # derived in the spark-submit driver's commit
    b = batches[0]
    assert b.due_source == "trigger" and b.due_at is not None and b.stats is not None
    assert b.due_at <= b.started_at <= b.staged_at <= b.committed_at
    assert b.stats["total_delay_s"] == pytest.approx(
        b.stats["scheduling_delay_s"] + b.stats["processing_s"], abs=0.002)
    assert positions == {(p["topic"], 0): 300, (p["topic"], 1): 300}
    assert query(pg_dsn, f"SELECT count(*) FROM {p['table']}")[0][0] == 600

    out = dags_test(p, f"offsetflow_{p['name']}")  # nothing new: no batch, Spark skipped
    assert "nothing new to read" in out
    with Ledger(pg_dsn) as ledger:
        assert len(ledger.recent_batches(p["name"])) == 1


def test_backfill_window_commits_backfill_batches_without_moving_position(
        airflow_project: dict[str, Any], pg_dsn: str, kafka_bootstrap: str) -> None:
    p = airflow_project
    produce_plain(kafka_bootstrap, p["topic"], 400, f"b{p['name']}", 2)
    side = f"side_{p['name']}"
    dry = dags_test(p, "offsetflow_backfill", {"pipeline": p["name"], "from_offset": 0,
                                                "until_offset": 150, "dry_run": True})
    assert '"offsets_total": 300' in dry
    with Ledger(pg_dsn) as ledger:
        assert ledger.recent_batches(p["name"]) == []
    dags_test(p, "offsetflow_backfill", {"pipeline": p["name"], "from_offset": 0,
                                         "until_offset": 150, "records_per_batch": 120,
                                         "target_table": side})
    with Ledger(pg_dsn) as ledger:
        batches = ledger.recent_batches(p["name"])
        assert ledger.positions(p["name"]) == {}
    assert {b.kind for b in batches} == {"backfill"} and len(batches) == 3
    assert all(b.status == "committed" and not b.moves_positions for b in batches)
    # one request, one due time (the trigger's): each batch waits for the ones before it
    assert len({b.due_at for b in batches}) == 1 and {b.due_source for b in batches} == \
        {"trigger"}
    waits = [b.stats["scheduling_delay_s"] for b in sorted(batches, key=lambda b: b.batch_id)
             if b.stats is not None]
    assert len(waits) == 3 and waits == sorted(waits) and waits[0] < waits[-1]
    assert all(b.stats is not None and b.stats["input_rate"] is None for b in batches)
    rows = query(pg_dsn, f"SELECT partition, \"offset\" FROM {side}")
    assert sorted(rows) == sorted((pt, o) for pt in (0, 1) for o in range(150))


def test_replay_replaces_rows_of_committed_range(
        airflow_project: dict[str, Any], pg_dsn: str, kafka_bootstrap: str) -> None:
    p = airflow_project
    produce_plain(kafka_bootstrap, p["topic"], 300, f"r{p['name']}", 2)
    dags_test(p, f"offsetflow_{p['name']}")
    before = dict(query(pg_dsn, f"SELECT \"offset\", _offsetflow_batch_id FROM {p['table']} "
                                f"WHERE partition = 0"))
    assert len(before) == 150

    # refused: offsets never committed, unknown partition, until < from
    bad = dags_test(p, "offsetflow_replay", {"pipeline": p["name"], "partitions": "0",
                                             "from_offset": 100, "until_offset": 400},
                    expect_ok=False)
    assert "never committed" in bad
    bad = dags_test(p, "offsetflow_replay", {"pipeline": p["name"], "partitions": "7",
                                             "from_offset": 0, "until_offset": 10},
                    expect_ok=False)
    assert "do not exist" in bad

    dags_test(p, "offsetflow_replay", {"pipeline": p["name"], "partitions": "0",
                                       "from_offset": 20, "until_offset": 70})
    rows = query(pg_dsn, f"SELECT \"offset\", _offsetflow_batch_id, event_id FROM {p['table']} "
                         f"WHERE partition = 0")
    counts = Counter(r[0] for r in rows)
    assert len(rows) == 150 and set(counts.values()) == {1}
    with Ledger(pg_dsn) as ledger:
        replay = [b for b in ledger.recent_batches(p["name"]) if b.kind == "replay"]
        assert len(replay) == 1 and replay[0].status == "committed"
        assert ledger.positions(p["name"]) == {(p["topic"], 0): 150, (p["topic"], 1): 150}
    rid = replay[0].batch_id
    for off, bid, _ in rows:
        assert bid == (rid if 20 <= off < 70 else before[off])


def test_cli_replay_refuses_bad_input_before_asking_airflow(
        airflow_project: dict[str, Any]) -> None:
    """`offsetflow replay` refuses bad input itself; with good input and no API server to
    reach it says where to point it (the REST trigger itself: test_rest_api.py)."""
    p = airflow_project
    r = subprocess.run(["offsetflow", "replay", "-p", p["name"], "--from-offset", "9",
                        "--until-offset", "3"], capture_output=True, text=True,
                       env=p["env"], timeout=120)
    assert r.returncode == 2 and "until_offset 3 < from_offset 9" in r.stderr
    r = subprocess.run(["offsetflow", "replay", "-p", p["name"], "--partitions", "0",
                        "--from-offset", "0", "--until-offset", "5", "--airflow-url",
                        "http://127.0.0.1:1"], capture_output=True, text=True,
                       env={**p["env"], "OFFSETFLOW_AIRFLOW_TOKEN": "t"}, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot reach Airflow's API server" in r.stderr and "--airflow-url" in r.stderr


def test_connect_pipeline_runs_on_the_warm_server_scheduled_and_backfill(
        airflow_project: dict[str, Any], spark_connect_url: str, pg_dsn: str,
        kafka_bootstrap: str) -> None:
    """`spark.launch: connect`: the scheduled DAG's run_batch and the window DAG's
    run_batches run the batch in the task on the Spark Connect server; no spark-submit."""
    p = airflow_project
    path = p["pipelines"] / f"{p['name']}.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["spark"] = {"launch": "connect", "connect_url": spark_connect_url}
    path.write_text(yaml.safe_dump(cfg))
    produce_plain(kafka_bootstrap, p["topic"], 200, f"c{p['name']}", 2)

    out = dags_test(p, f"offsetflow_{p['name']}")
    assert "SparkSubmitHook" not in out and "spark-submit" not in out
    assert p["password"] not in out
    side = f"side_{p['name']}"
    out = dags_test(p, "offsetflow_backfill", {"pipeline": p["name"], "from_offset": 0,
                                                "until_offset": 50, "target_table": side})
    assert "run_batches" in out and "spark-submit" not in out and "SparkSubmitHook" not in out
    with Ledger(pg_dsn) as ledger:
        batches = ledger.recent_batches(p["name"])
        positions = ledger.positions(p["name"])
    assert sorted((b.kind, b.status) for b in batches) == [("backfill", "committed"),
                                                           ("scheduled", "committed")]
    assert positions == {(p["topic"], 0): 100, (p["topic"], 1): 100}
    assert query(pg_dsn, f"SELECT count(*) FROM {p['table']}")[0][0] == 200
    rows = query(pg_dsn, f"SELECT partition, \"offset\" FROM {side}")
    assert sorted(rows) == sorted((pt, o) for pt in (0, 1) for o in range(50))
