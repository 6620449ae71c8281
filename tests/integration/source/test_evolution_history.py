"""`format.schema_evolution` against a subject's history, not only its neighbours (real Kafka,
Spark, PostgreSQL and the stack's registry):

- a field removed and re-added with another type: the batch holds records of v1 (`coupon`
  a string) and v2 (no `coupon`) and is read as v3 (`coupon` an int). Each step follows the
  one before, yet v3 cannot read v1's records: the batch must stop with
  SchemaEvolutionError instead of routing good v1 records to the dead letters;
- a replay of a window read before a column existed: the column the evolution added later
  holds for the old rows what the reader schema gives them (the field's default), so the
  replay writes the same rows the first run left.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.config import load_pipeline
from offsetflow.errors import SchemaEvolutionError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import kafka_for, plan_only, plan_window, submit_window
from offsetflow.plan import parse_request
from tests.integration.source.test_records_avro_evolution import (
    PARTITIONS,
    _pipeline,
    _produce,
    _register,
)
from tests.tooling.pipeline_data import query

BASE = {"type": "record", "name": "Hx", "namespace": "offsetflow.test"}
H1 = {**BASE, "fields": [{"name": "order_id", "type": "long"},
                         {"name": "coupon", "type": "string", "default": ""}]}
H2 = {**BASE, "fields": [{"name": "order_id", "type": "long"}]}
D2 = {**BASE, "fields": [{"name": "order_id", "type": "long"},
                         {"name": "channel", "type": "string", "default": "web"},
                         {"name": "n", "type": "long", "default": 7}]}
H3 = {**BASE, "fields": [{"name": "order_id", "type": "long"},
                         {"name": "coupon", "type": "int", "default": 0}]}


@pytest.fixture
def topic(kafka_bootstrap: str) -> str:
    name = f"evh-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(timeout=30)
    return name


def _url() -> str:
    url = os.environ.get("OFFSETFLOW_SCHEMA_REGISTRY_URL")
    if not url:
        pytest.fail("OFFSETFLOW_SCHEMA_REGISTRY_URL is not set: start the stack's registry")
    return url


def test_field_readded_with_another_type_stops_the_batch(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Path, topic: str) -> None:
    url = _url()
    _produce(kafka_bootstrap, url, topic, H1,
             [{"order_id": i, "coupon": f"c{i}"} for i in range(4)])
    _produce(kafka_bootstrap, url, topic, H2, [{"order_id": i} for i in range(4, 8)])
    _register(url, topic, H3)  # the reader: coupon is back, as an int
    name = f"evh_{uuid.uuid4().hex[:8]}"
    cfg = load_pipeline(_pipeline(tmp_path, name, topic, pg_dsn, kafka_bootstrap, url,
                                  "add_columns"))
    planned = plan_only(cfg, pg_dsn, started_by="test")
    assert planned.batch is not None
    with pytest.raises(SchemaEvolutionError, match=r"coupon.*string to int"):
        run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM dl_{name}") == [(0,)]
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(planned.batch.batch_id).status != "committed"


def test_replay_of_a_window_read_before_the_column_existed(
        spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path: Path, topic: str) -> None:
    url = _url()
    _produce(kafka_bootstrap, url, topic, H2, [{"order_id": i} for i in range(4)])
    name = f"evh_{uuid.uuid4().hex[:8]}"
    cfg = load_pipeline(_pipeline(tmp_path, name, topic, pg_dsn, kafka_bootstrap, url,
                                  "add_columns"))
    for step in range(2):  # v1 only; then v2, which adds two fields with defaults
        planned = plan_only(cfg, pg_dsn, started_by="test")
        assert planned.batch is not None
        run_batch(spark, cfg, planned.batch.batch_id, pg_dsn)
        if step == 0:
            _produce(kafka_bootstrap, url, topic, D2,
                     [{"order_id": i, "channel": "app", "n": i} for i in range(4, 6)])
    rows = f"SELECT order_id, channel, n FROM {name} ORDER BY order_id"
    first = query(pg_dsn, rows)
    req = parse_request("replay", {"pipeline": cfg.name, "topic": topic, "from_offset": 0,
                                   "until_offset": 2})
    with Ledger(pg_dsn) as ledger:
        ids = submit_window(cfg, ledger, plan_window(cfg, ledger, kafka_for(cfg), req), "test")
    for bid in ids:
        run_batch(spark, cfg, bid, pg_dsn)
    again = query(pg_dsn, rows)
    assert [r[0] for r in again] == list(range(6))
    assert again == first, "the replay wrote other rows than the first run left"
    assert first[:4] == [(i, "web", 7) for i in range(4)]
