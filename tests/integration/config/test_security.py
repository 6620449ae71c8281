"""Security basics: identifiers from configs and forms are validated and quoted; credentials
never appear in logs, command output or the ledger (issue: exactly-once under faults)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError, RequestError
from offsetflow.plan import parse_request
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query

INJECTIONS = ['orders"; DROP TABLE offsetflow.batches; --', "orders; DELETE FROM x",
              "public.orders' OR '1'='1", "a.b.c", "x" * 64, "ord ers", "orders--"]


@pytest.mark.parametrize("table", INJECTIONS)
def test_injection_strings_are_refused_as_table_names(table: str) -> None:
    raw = {"kafka": {"bootstrap_servers": "x:1"}, "source": {"topics": ["t"]},
           "format": {"type": "json", "schema": {"a": "string"}},
           "sink": {"connection": "postgresql://u@h/d", "table": table}}
    with pytest.raises(ConfigError, match="sink.table"):
        parse_pipeline(raw, "evil.yaml", {})
    with pytest.raises(RequestError, match="not a valid table name"):
        parse_request("backfill", {"pipeline": "p", "from_offset": 0, "until_offset": 1,
                                   "target_table": table})


@pytest.mark.parametrize("column", ['id"; DROP TABLE t; --', "a b", "1abc"])
def test_injection_strings_are_refused_as_columns(column: str) -> None:
    raw = {"kafka": {"bootstrap_servers": "x:1"}, "source": {"topics": ["t"]},
           "format": {"type": "json", "schema": {column: "string"}},
           "sink": {"connection": "postgresql://u@h/d", "table": "t"}}
    with pytest.raises(ConfigError, match="format.schema"):
        parse_pipeline(raw, "evil.yaml", {})


def test_reserved_and_mixed_case_names_are_quoted(spark: Any, pg_dsn: str,
                                                  kafka_bootstrap: str, make_topic: Any,
                                                  unique: str) -> None:
    """Valid names that are SQL keywords or mixed case work because every one is quoted."""
    from offsetflow.ops.runner import run_cycle
    from tests.tooling.pipeline_data import pipeline_for

    topic = make_topic("quote", 1)
    produce_plain(kafka_bootstrap, topic, 20, f"q{unique}", 1)
    cfg = pipeline_for(topic, pg_dsn, kafka_bootstrap, f"Select_{unique}.Order",
                       name=f"quote_{unique}")
    run_cycle(cfg, pg_dsn, spark)
    assert query(pg_dsn, f'SELECT count(*) FROM "Select_{unique}"."Order"')[0][0] == 20


def test_credentials_never_in_output_or_ledger(secret_dsn: tuple[str, str], pg_dsn: str,
                                               kafka_bootstrap: str, make_topic: Any,
                                               unique: str, tmp_path: Path) -> None:
    dsn, password = secret_dsn
    topic = make_topic("secret", 1)
    produce_plain(kafka_bootstrap, topic, 50, f"x{unique}", 1)
    f = tmp_path / f"sec_{unique}.yaml"
    f.write_text(yaml.safe_dump({
        "name": f"sec_{unique}", "kafka": {"bootstrap_servers": kafka_bootstrap,
                                           "client": {"client.id": "offsetflow-test"}},
        "source": {"topics": [topic]}, "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": "${SECRET_DSN}", "table": f"sec_{unique}"}}))
    env = {**__import__("os").environ, "SECRET_DSN": dsn}
    outputs = []
    for args in (["-v", "run", "--pipeline-file", str(f)],
                 ["status", "--pipeline-file", str(f), "--json"],
                 ["plan", "--pipeline-file", str(f)]):
        r = subprocess.run(["offsetflow", *args], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outputs.append(r.stdout + r.stderr)
    # a failing connection must not echo the DSN either
    bad = subprocess.run(["offsetflow", "status", "--pipeline-file", str(f)],
                         capture_output=True, text=True, timeout=120,
                         env={**env, "SECRET_DSN": dsn.replace("127.0.0.1", "127.0.0.2")
                              .replace("15432", "1")})
    outputs.append(bad.stdout + bad.stderr)
    assert bad.returncode != 0
    ledger = json.dumps(query(pg_dsn, "SELECT row_to_json(b)::text FROM offsetflow.batches b "
                                      "WHERE pipeline = %s", (f"sec_{unique}",)))
    ledger += json.dumps(query(pg_dsn, "SELECT row_to_json(h)::text FROM "
                                       "offsetflow.position_history h WHERE pipeline = %s",
                               (f"sec_{unique}",)))
    for text in [*outputs, ledger]:
        assert password not in text
    assert query(pg_dsn, f"SELECT count(*) FROM sec_{unique}")[0][0] == 50
