"""Great Expectations quality gate on real staged batches (issue: data quality gate)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from offsetflow.job.quality import QualityGateError
from offsetflow.ledger import Ledger
from offsetflow.ops.runner import run_cycle
from tests.tooling.pipeline_data import pipeline_for, produce_with_negative_amounts, query


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


# one validation process: waits for the shared start time, runs the suite's checkpoint
# `rounds` times on a staged batch, prints the outcomes as JSON
VALIDATE = """
import json, sys, time
from offsetflow.job.quality import validate_stage
dsn, batch_id, suite, rounds, start = sys.argv[1:]
time.sleep(max(0.0, float(start) - time.time()))
out = []
for _ in range(int(rounds)):
    r = validate_stage(dsn, int(batch_id), suite)
    out.append([r.success, [o.unexpected_count for o in r.outcomes],
                sorted(r.failing_coordinates())])
print(json.dumps(out))
"""

CONFIG_FILES = ("great_expectations.yml", "checkpoints", "validation_definitions",
                "expectations")


def project_config_hash(root: Path) -> str:
    """Content hash of the GX project's config (not of results under uncommitted/)."""
    import hashlib

    h = hashlib.sha256()
    for name in CONFIG_FILES:
        p = root / "gx" / name
        for f in sorted([p] if p.is_file() else p.rglob("*") if p.exists() else []):
            if f.is_file():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def stage_table(dsn: str, batch_id: int, topic: str, seqs: list[int]) -> None:
    """A staged batch as the job leaves it (offsetflow_stage.b<id>), with a batch id far
    above the ledger's so no real batch is touched."""
    rows = ", ".join(f"('{topic}', 0, {i}, 'e{i}', {s}, {float(s)})" for i, s in enumerate(seqs))
    query(dsn, f"CREATE TABLE offsetflow_stage.b{batch_id} (topic text, partition int, "
               f"\"offset\" bigint, event_id text, seq bigint, amount double precision); "
               f"INSERT INTO offsetflow_stage.b{batch_id} VALUES {rows}")


def test_two_pipelines_validating_at_once_do_not_touch_the_project_config(
        pg_dsn: str, unique: str, gx_root: Path) -> None:
    """Two processes run their suites' checkpoints at the same time, several rounds each:
    both get their own right answer, and the project config (great_expectations.yml,
    checkpoints, validation definitions, suites) is byte-for-byte what set-up left, during
    the runs (polled) and after them."""
    import subprocess
    import sys
    import threading
    import time

    from offsetflow.ledger import Ledger

    with Ledger(pg_dsn) as ledger:
        ledger.upgrade()
    base = 900_000_000 + int(time.time() * 1000) % 1_000_000 * 10
    amounts, seqs = base + 1, base + 2
    stage_table(pg_dsn, amounts, f"a_{unique}", list(range(40)))  # amounts 0..39: passes
    stage_table(pg_dsn, seqs, f"s_{unique}", [*range(45), 70, 80])  # 2 seqs above 49
    before = project_config_hash(gx_root)
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.add(project_config_hash(gx_root))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.time() + 8  # both interpreters have imported GX by then
    procs = [subprocess.Popen([sys.executable, "-c", VALIDATE, pg_dsn, str(b), suite, "3",
                               str(start)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for b, suite in ((amounts, "amounts"), (seqs, "seqs"))]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        stop.set()
        watcher.join()
        query(pg_dsn, f"DROP TABLE offsetflow_stage.b{amounts}, offsetflow_stage.b{seqs}")
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got_amounts, got_seqs = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert got_amounts == [[True, [0, 0], []]] * 3
    assert got_seqs == [[False, [2], [[f"s_{unique}", 0, 45], [f"s_{unique}", 0, 46]]]] * 3
    assert seen == {before} and project_config_hash(gx_root) == before
    assert (gx_root / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html").exists()


def test_suite_without_its_checkpoint_fails_naming_the_set_up_step(tmp_path: Path) -> None:
    """A suite added after set-up has no Checkpoint yet: the batch fails saying what to run,
    and the run adds nothing to the project (it never reaches PostgreSQL either)."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    from offsetflow.errors import OffsetFlowError
    from offsetflow.job.quality import validate_stage

    ctx = gx.get_context(mode="file", project_root_dir=str(tmp_path))
    ctx.suites.add_or_update(gx.ExpectationSuite(name="late", expectations=[
        gxe.ExpectColumnValuesToNotBeNull(column="event_id")]))
    before = project_config_hash(tmp_path)
    with pytest.raises(OffsetFlowError, match=r"quality suite 'late' has no checkpoint "
                                              r"'offsetflow_late' .*create_suites\.py"):
        validate_stage("postgresql://nobody@127.0.0.1:1/none", 1, "late", root=tmp_path)
    assert project_config_hash(tmp_path) == before
