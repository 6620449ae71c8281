"""What a person sees from `offsetflow run` on a real batch: a progress line per batch and a
summary on stdout, nothing of the INFO detail on the console; the detail is in the log file."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.tooling.pipeline_data import SCHEMA, produce_plain, query


def test_run_prints_a_line_per_batch_and_a_summary_and_logs_the_detail_to_a_file(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path) -> None:
    topic = make_topic("cli_out", 2)
    produce_plain(kafka_bootstrap, topic, 300, f"c{unique}", 2)
    f = tmp_path / f"cli_{unique}.yaml"
    f.write_text(yaml.safe_dump({
        "name": f"cli_{unique}", "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "max_records_per_partition": 100},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": f"cli_{unique}"}}))
    log_file = tmp_path / "logs" / "offsetflow.log"
    r = subprocess.run(["offsetflow", "--log-file", str(log_file), "run", "--pipeline-file",
                        str(f), "--max-batches", "3"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    t = re.escape(topic)
    # 150 records a partition, 100 a partition per batch: 200, then 100, then caught up
    assert len(lines) == 4, r.stdout
    for line, span, n in ((lines[0], r"\[0, 100\)", 200), (lines[1], r"\[100, 150\)", 100)):
        assert re.fullmatch(
            rf"pipeline cli_{unique}: batch \d+ committed in [0-9.]+s: 2 range\(s\) "
            rf"{t}\[0\] {span}, {t}\[1\] {span}; {n} offsets -> {n} rows, [0-9,]+ rec/s",
            line), line
    assert lines[2] == f"pipeline cli_{unique}: caught up, nothing new to read"
    assert re.fullmatch(rf"pipeline cli_{unique}: 2 batch\(es\), 300 rows written, 0 dead "
                        rf"letters in [0-9.]+s; full log: {re.escape(str(log_file))}",
                        lines[3]), lines[3]
    # nothing below WARNING on the console, from Python or from Spark's JVM (whose WARN
    # start-up notes go to spark.log beside the log file); the JVM's own note on incubator
    # modules is printed before any logging is set up
    assert not re.search(r" (INFO|DEBUG) offsetflow", r.stdout + r.stderr), r.stderr[-3000:]
    assert [ln for ln in r.stderr.splitlines() if "incubator modules" not in ln] == [], \
        r.stderr[-3000:]
    assert "WARN" in (log_file.parent / "spark.log").read_text()
    detail = log_file.read_text()
    assert re.search(r"INFO offsetflow\.\S+: .*batch \d+", detail), detail[-3000:]
    assert f"cli_{unique}" in detail
    assert query(pg_dsn, f"SELECT count(*) FROM cli_{unique}")[0][0] == 300


def test_run_batch_keeps_the_detail_on_its_console_for_airflow_task_logs(
        pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        tmp_path: Path) -> None:
    """run-batch is what the DAGs spark-submit: its console is the task log, so it keeps
    the INFO records (and the machine-readable timings line) without -v."""
    from offsetflow.config import load_pipeline
    from offsetflow.ops import plan_only

    topic = make_topic("cli_rb", 1)
    produce_plain(kafka_bootstrap, topic, 50, f"r{unique}", 1)
    f = tmp_path / f"clirb_{unique}.yaml"
    f.write_text(yaml.safe_dump({
        "name": f"clirb_{unique}", "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic]}, "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": f"clirb_{unique}"}}))
    planned = plan_only(load_pipeline(f), pg_dsn)
    assert planned.batch is not None
    bid = planned.batch.batch_id
    r = subprocess.run(["offsetflow", "--log-file", str(tmp_path / "rb.log"), "run-batch",
                        "--pipeline-file", str(f), "--batch-id", str(bid)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(rf"INFO offsetflow\.job\.driver: batch {bid} committed: 50 rows", r.stderr), \
        r.stderr[-3000:]
    assert re.search(rf"INFO offsetflow\.cli\.commands: batch {bid} timings \{{", r.stderr), \
        r.stderr[-3000:]
