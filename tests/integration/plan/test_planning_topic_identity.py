"""A topic deleted and recreated under the same name, on real Kafka: its offsets restart, so
nothing planned or committed for the old topic may be applied to the new one, and the
README's recovery (abandon, reset-position) must bring the pipeline back."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka.admin import AdminClient, NewTopic

from offsetflow.cli import main as cli
from offsetflow.config import load_pipeline
from offsetflow.errors import BatchStateError, TopicRecreatedError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only, run_until_caught_up
from tests.tooling.kafka_topics import recreate
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query


def _pipeline_file(tmp: Path, name: str, topic: str, dsn: str, bootstrap: str,
                   **source: Any) -> Path:
    f = tmp / f"{name}.yaml"
    f.write_text(yaml.safe_dump({
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topic], "max_records_per_partition": 100_000, **source},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": dsn, "table": name},
        "spark": {"master": "local[2]"}}))
    return f


@pytest.fixture
def topic_name(kafka_bootstrap: str, unique: str) -> Any:
    name = f"recr-{unique}"
    yield name
    AdminClient({"bootstrap.servers": kafka_bootstrap}).delete_topics([name])


def test_reset_position_records_the_new_topic_id(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, unique: str, topic_name: str,
        spark: Any, capsys: Any) -> None:
    """The README's recovery for a recreated topic whose old records never reached the sink
    (started at `latest`): reset-position alone makes planning work again."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic_name, 1, 1)])[topic_name].result(30)
    f = _pipeline_file(tmp_path, f"rid_{unique}", topic_name, pg_dsn, kafka_bootstrap,
                       starting="latest")
    cfg = load_pipeline(f)
    assert plan_only(cfg, pg_dsn).batch is None  # position 0 recorded with the topic id
    new_id = recreate(kafka_bootstrap, topic_name, 1)
    new = produce_plain(kafka_bootstrap, topic_name, 100, f"n{unique}", 1)
    with pytest.raises(TopicRecreatedError, match="reset-position"):
        plan_only(cfg, pg_dsn)

    assert cli(["--dsn", pg_dsn, "reset-position", "--pipeline-file", str(f), "--topic",
                topic_name, "--partition", "0", "--offset", "0", "--reason",
                "topic recreated"]) == 0
    run_until_caught_up(cfg, pg_dsn, spark, max_batches=3)
    assert new_id in capsys.readouterr().out
    rows = query(pg_dsn, f"SELECT event_id, count(*) FROM rid_{unique} GROUP BY 1")
    assert dict(rows) == {k: 1 for k in new.committed}


def test_open_batch_of_the_old_topic_is_refused_before_reading(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, unique: str, topic_name: str,
        spark: Any) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic_name, 2, 1)])[topic_name].result(30)
    f = _pipeline_file(tmp_path, f"rob_{unique}", topic_name, pg_dsn, kafka_bootstrap,
                       starting="earliest")
    cfg = load_pipeline(f)
    produce_plain(kafka_bootstrap, topic_name, 100, f"o{unique}", 2)
    run_until_caught_up(cfg, pg_dsn, spark)
    produce_plain(kafka_bootstrap, topic_name, 100, f"p{unique}", 2, start_seq=100)
    stale = plan_only(cfg, pg_dsn).batch  # planned before the recreation: [50, 100) each
    assert stale is not None
    recreate(kafka_bootstrap, topic_name, 2)
    produce_plain(kafka_bootstrap, topic_name, 400, f"n{unique}", 2)

    with pytest.raises(TopicRecreatedError,
                       match=rf"batch {stale.batch_id}.*offsetflow abandon --batch-id "
                             rf"{stale.batch_id}.*reset-position"):
        run_batch(spark, cfg, stale.batch_id, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM rob_{unique}")[0][0] == 100
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(stale.batch_id).status == "failed"
        assert ledger.positions(cfg.name) == {(topic_name, 0): 50, (topic_name, 1): 50}


def test_topic_recreation_documented_recovery(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, unique: str, topic_name: str,
        spark: Any, capsys: Any) -> None:
    """README, "A topic was deleted and recreated": abandon the open batch, reset every
    partition to the new topic's start, moving the old topic's rows out of the sink; the
    pipeline then commits the new topic's records once."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic_name, 2, 1)])[topic_name].result(30)
    name = f"rdr_{unique}"
    f = _pipeline_file(tmp_path, name, topic_name, pg_dsn, kafka_bootstrap)
    cfg = load_pipeline(f)
    old = produce_plain(kafka_bootstrap, topic_name, 300, f"o{unique}", 2)
    run_until_caught_up(cfg, pg_dsn, spark)
    produce_plain(kafka_bootstrap, topic_name, 10, f"q{unique}", 2, start_seq=300)
    stale = plan_only(cfg, pg_dsn).batch
    assert stale is not None
    new_id = recreate(kafka_bootstrap, topic_name, 2)
    new = produce_plain(kafka_bootstrap, topic_name, 500, f"n{unique}", 2)

    with pytest.raises(TopicRecreatedError):
        run_batch(spark, cfg, stale.batch_id, pg_dsn)
    # without its config (not in the pipelines folder) the sink cannot be asked whether it
    # holds the batch: refused, naming the ways on (review of the abandon guard)
    abandon = ["--dsn", pg_dsn, "abandon", "--batch-id", str(stale.batch_id), "--reason",
               "topic recreated"]
    assert cli(abandon) == 2
    assert "--pipeline-file" in capsys.readouterr().err
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(stale.batch_id).is_open
    # the recovery, as the README gives it
    assert cli([*abandon, "--pipeline-file", str(f)]) == 0
    with pytest.raises(TopicRecreatedError, match=r"partition\(s\) \[0, 1\]"):
        plan_only(cfg, pg_dsn)
    reset = ["--dsn", pg_dsn, "reset-position", "--pipeline-file", str(f), "--topic",
             topic_name, "--all-partitions", "--offset", "0", "--reason", "topic recreated"]
    assert cli(reset) == 2  # the old topic's rows would collide with the new ones
    err = capsys.readouterr().err
    assert f"{name} holds 300 rows of {topic_name}" in err and "--archive-to" in err
    assert cli([*reset, "--archive-to", f"{name}_before_recreation"]) == 0
    out = capsys.readouterr().out
    assert new_id in out and "300 rows" in out
    run_until_caught_up(cfg, pg_dsn, spark, max_batches=3)

    rows = dict(query(pg_dsn, f"SELECT event_id, count(*) FROM {name} GROUP BY 1"))
    assert rows == {k: 1 for k in new.committed}
    archived = dict(query(pg_dsn, f"SELECT event_id, count(*) FROM {name}_before_recreation "
                                  f"GROUP BY 1"))
    assert archived == {k: 1 for k in old.committed}
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic_name, 0): 250, (topic_name, 1): 250}


def test_open_batch_of_a_deleted_topic_names_the_way_out(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, unique: str, topic_name: str,
        spark: Any) -> None:
    """The topic of an open batch was deleted (and not recreated): the batch can never be
    read; the error says so and names the command that closes it."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic_name, 1, 1)])[topic_name].result(30)
    f = _pipeline_file(tmp_path, f"rdt_{unique}", topic_name, pg_dsn, kafka_bootstrap)
    cfg = load_pipeline(f)
    produce_plain(kafka_bootstrap, topic_name, 50, f"o{unique}", 1)
    stale = plan_only(cfg, pg_dsn).batch
    assert stale is not None
    admin.delete_topics([topic_name])[topic_name].result(30)
    deadline = time.monotonic() + 60
    while topic_name in admin.list_topics(timeout=10).topics and time.monotonic() < deadline:
        time.sleep(1)
    with pytest.raises(Exception, match=rf"batch {stale.batch_id} reads topic {topic_name}, "
                                        rf"which no longer exists in Kafka.*offsetflow abandon "
                                        rf"--batch-id {stale.batch_id}"):
        run_batch(spark, cfg, stale.batch_id, pg_dsn)


def test_continue_plans_past_no_open_batch_of_a_deleted_or_recreated_topic(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, unique: str, topic_name: str) -> None:
    """Under `data_loss: continue` planning looks at an open batch's offsets in Kafka: its
    topic's identity is checked first, so a deleted topic gives the way out, not a raw
    UNKNOWN_TOPIC_OR_PART, and a recreated one is not taken for deleted offsets."""
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic_name, 1, 1)])[topic_name].result(30)
    f = _pipeline_file(tmp_path, f"rcd_{unique}", topic_name, pg_dsn, kafka_bootstrap,
                       data_loss="continue")
    cfg = load_pipeline(f)
    produce_plain(kafka_bootstrap, topic_name, 50, f"o{unique}", 1)
    stale = plan_only(cfg, pg_dsn).batch
    assert stale is not None
    admin.delete_topics([topic_name])[topic_name].result(30)
    deadline = time.monotonic() + 60
    while topic_name in admin.list_topics(timeout=10).topics and time.monotonic() < deadline:
        time.sleep(1)
    with pytest.raises(BatchStateError, match=rf"batch {stale.batch_id} reads topic "
                                              rf"{topic_name}, which no longer exists.*"
                                              rf"offsetflow abandon --batch-id {stale.batch_id}"):
        plan_only(cfg, pg_dsn)
    recreate(kafka_bootstrap, topic_name, 1)
    produce_plain(kafka_bootstrap, topic_name, 80, f"n{unique}", 1)
    with pytest.raises(TopicRecreatedError, match=rf"batch {stale.batch_id}"):
        plan_only(cfg, pg_dsn)
    with Ledger(pg_dsn) as ledger:
        assert ledger.get_batch(stale.batch_id).status == "planned"
        assert ledger.data_loss_events(cfg.name) == []


def test_topic_recreated_while_the_batch_reads_is_refused_before_commit(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, unique: str, topic_name: str,
        spark: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity check before reading passes; the topic is then deleted and recreated
    (with as many new records) before the tasks read: what they read is the new topic's,
    and must not be committed under the old topic's positions."""
    import offsetflow.job.driver as job

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic_name, 2, 1)])[topic_name].result(30)
    f = _pipeline_file(tmp_path, f"rwr_{unique}", topic_name, pg_dsn, kafka_bootstrap,
                       starting="earliest")
    cfg = load_pipeline(f)
    produce_plain(kafka_bootstrap, topic_name, 100, f"o{unique}", 2)
    batch = plan_only(cfg, pg_dsn).batch
    assert batch is not None
    real = job.create_stage_tables

    def recreate_then_stage(*args: Any, **kwargs: Any) -> Any:
        recreate(kafka_bootstrap, topic_name, 2)
        produce_plain(kafka_bootstrap, topic_name, 100, f"n{unique}", 2)
        return real(*args, **kwargs)

    monkeypatch.setattr(job, "create_stage_tables", recreate_then_stage)
    with pytest.raises(TopicRecreatedError, match=rf"batch {batch.batch_id}"):
        run_batch(spark, cfg, batch.batch_id, pg_dsn)
    assert query(pg_dsn, f"SELECT count(*) FROM rwr_{unique}")[0][0] == 0
    with Ledger(pg_dsn) as ledger:
        assert ledger.positions(cfg.name) == {(topic_name, 0): 0, (topic_name, 1): 0}
