"""The DAGs run for real: `airflow dags test` against the real Kafka and PostgreSQL (issue:
Airflow orchestration). One pipeline runs its scheduled DAG with spark-submit in local mode
(the launch a YAML pipeline has by default); the window DAGs' tests, which assert what the
DAGs plan, refuse and replace, run their batches on the stack's warm Spark Connect server
(`spark.launch: connect`) instead of starting a spark-submit JVM per run. The window DAGs'
run_batches is the scheduled DAG's operator (OffsetFlowRunBatchOperator): its spark-submit
through a scheduler and LocalExecutor runs in test_public_api.py (the inline DAG)."""

from __future__ import annotations

import subprocess
from collections import Counter
from typing import Any

import pytest

from offsetflow.config import load_pipeline
from offsetflow.errors import RequestError
from offsetflow.ledger import Ledger
from offsetflow.orchestration.tasks import window_task
from tests.tooling.airflow_dags import dags_test, launch_connect
from tests.tooling.pipeline_data import produce_plain, query

pytestmark = pytest.mark.slow  # Airflow runs each DAG (dags test) with a Spark job


def test_scheduled_run_commits_a_batch_empty_run_skips_spark_and_replay_replaces_rows(
        airflow_project: dict[str, Any], spark_connect_url: str, pg_dsn: str,
        kafka_bootstrap: str) -> None:
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

    # -- replay of a committed range (its batch on the warm Spark Connect server) ----------
    launch_connect(p, spark_connect_url)
    before = dict(query(pg_dsn, f"SELECT \"offset\", _offsetflow_batch_id FROM {p['table']} "
                                f"WHERE partition = 0"))
    assert len(before) == 300

    # refused: offsets never committed (the DAG run fails with the plan task's message);
    # an unknown partition, by the function that task calls (no second `dags test` process)
    bad = dags_test(p, "offsetflow_replay", {"pipeline": p["name"], "partitions": "0",
                                             "from_offset": 250, "until_offset": 400},
                    expect_ok=False)
    assert "never committed" in bad
    with pytest.raises(RequestError, match="do not exist"):
        window_task("replay", {"pipeline": p["name"], "partitions": "7", "from_offset": 0,
                               "until_offset": 10}, "test",
                    load=lambda name: load_pipeline(p["pipelines"] / f"{name}.yaml"))

    dags_test(p, "offsetflow_replay", {"pipeline": p["name"], "partitions": "0",
                                       "from_offset": 20, "until_offset": 70})
    rows = query(pg_dsn, f"SELECT \"offset\", _offsetflow_batch_id, event_id FROM {p['table']} "
                         f"WHERE partition = 0")
    counts = Counter(r[0] for r in rows)
    assert len(rows) == 300 and set(counts.values()) == {1}
    with Ledger(pg_dsn) as ledger:
        replay = [b for b in ledger.recent_batches(p["name"]) if b.kind == "replay"]
        assert len(replay) == 1 and replay[0].status == "committed"
        assert ledger.positions(p["name"]) == {(p["topic"], 0): 300, (p["topic"], 1): 300}
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


def test_connect_pipeline_runs_on_the_warm_server_and_backfill_keeps_the_position(
        airflow_project: dict[str, Any], spark_connect_url: str, pg_dsn: str,
        kafka_bootstrap: str) -> None:
    """`spark.launch: connect`: the scheduled DAG's run_batch and the window DAG's
    run_batches run the batch in the task on the Spark Connect server; no spark-submit. A
    backfill window (a dry run first) commits backfill batches, in order, without moving the
    pipeline's position."""
    p = airflow_project
    launch_connect(p, spark_connect_url)
    produce_plain(kafka_bootstrap, p["topic"], 400, f"c{p['name']}", 2)

    out = dags_test(p, f"offsetflow_{p['name']}")
    assert "SparkSubmitHook" not in out and "spark-submit" not in out
    assert p["password"] not in out
    with Ledger(pg_dsn) as ledger:
        batches = ledger.recent_batches(p["name"])
        assert ledger.positions(p["name"]) == {(p["topic"], 0): 200, (p["topic"], 1): 200}
    assert [(b.kind, b.status) for b in batches] == [("scheduled", "committed")]
    assert query(pg_dsn, f"SELECT count(*) FROM {p['table']}")[0][0] == 400

    side = f"side_{p['name']}"
    dry = dags_test(p, "offsetflow_backfill", {"pipeline": p["name"], "from_offset": 0,
                                                "until_offset": 150, "dry_run": True})
    assert '"offsets_total": 300' in dry
    with Ledger(pg_dsn) as ledger:
        assert [b.kind for b in ledger.recent_batches(p["name"])] == ["scheduled"]
    out = dags_test(p, "offsetflow_backfill", {"pipeline": p["name"], "from_offset": 0,
                                                "until_offset": 150, "records_per_batch": 120,
                                                "target_table": side})
    assert "run_batches" in out and "spark-submit" not in out and "SparkSubmitHook" not in out
    with Ledger(pg_dsn) as ledger:
        batches = [b for b in ledger.recent_batches(p["name"]) if b.kind != "scheduled"]
        positions = ledger.positions(p["name"])
    assert positions == {(p["topic"], 0): 200, (p["topic"], 1): 200}  # not moved
    assert {b.kind for b in batches} == {"backfill"} and len(batches) == 3
    assert all(b.status == "committed" and not b.moves_positions for b in batches)
    # one request, one due time (the trigger's): each batch waits for the ones before it
    assert len({b.due_at for b in batches}) == 1 and {b.due_source for b in batches} == \
        {"trigger"}
    waits = [b.stats["scheduling_delay_s"] for b in sorted(batches, key=lambda b: b.batch_id)
             if b.stats is not None]
    assert len(waits) == 3 and waits == sorted(waits) and waits[0] < waits[-1]
    assert all(b.stats is not None and b.stats["input_rate"] is None for b in batches)
    assert query(pg_dsn, f"SELECT count(*) FROM {p['table']}")[0][0] == 400
    rows = query(pg_dsn, f"SELECT partition, \"offset\" FROM {side}")
    assert sorted(rows) == sorted((pt, o) for pt in (0, 1) for o in range(150))
