"""The sinks' one interface (`offsetflow.sinks.Sink`), its pure parts: which sink a config
gets, what each kind answers to the run, to backfills and replays, and to the repairs, and
that the refusals keep their words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from offsetflow.commit import CommitSpec, PartwiseSink
from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.errors import BatchStateError, ConfigError, RequestError
from offsetflow.ledger import Batch
from offsetflow.ops.backfill import check_live_positions
from offsetflow.plan import parse_request
from offsetflow.ranges import OffsetRange
from offsetflow.sinks import PostgresSink, external_sink, sink_for, task_data_files
from offsetflow.sinks.iceberg import IcebergPipelineSink, IcebergSink
from offsetflow.sinks.kafka import KafkaPipelineSink, KafkaTopicSink

DSN = "postgresql://u:pw@h:5432/db"
COLUMNS = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
           ("value", "bytea"), ("event_id", "text")]


def config(sink: dict[str, Any], **top: Any) -> PipelineConfig:
    raw = {"name": "orders", "kafka": {"bootstrap_servers": "k:9092"},
           "source": {"topics": ["t"]},
           "format": {"type": "json", "schema": {"event_id": "string", "amount": "double"}},
           "sink": sink, **top}
    return parse_pipeline(raw, "orders.yaml", {"OFFSETFLOW_PG_DSN": DSN})


def postgres(**sink: Any) -> PipelineConfig:
    return config({"connection": DSN, "table": "events", **sink})


def iceberg(top: dict[str, Any] | None = None, **sink: Any) -> PipelineConfig:
    return config({"type": "iceberg", "connection": DSN, "table": "events",
                   "catalog": {"warehouse": "file:///w"}, **sink}, **(top or {}))


def kafka(**sink: Any) -> PipelineConfig:
    return config({"type": "kafka", "topic": "o", **sink})


def batch(kind: str = "scheduled", target: str = "events", attempts: int = 1) -> Batch:
    return Batch(7, "orders", kind, "running", (OffsetRange("t", 0, 10, 20),), target,
                 moves_positions=kind == "scheduled", attempts=attempts)


def window(kind: str, **conf: Any) -> Any:
    return parse_request(kind, {"pipeline": "orders", "from_offset": 0, "until_offset": 60,
                                **conf})


def test_each_config_gets_the_sink_of_its_kind() -> None:
    assert type(sink_for(postgres())) is PostgresSink
    assert type(sink_for(postgres(mode="upsert", key=["event_id"]))) is PostgresSink
    assert type(sink_for(iceberg())) is IcebergPipelineSink
    assert type(sink_for(kafka())) is KafkaPipelineSink


def test_step_4_outside_postgresql_is_the_external_sink_of_the_kind() -> None:
    assert sink_for(postgres()).external(DSN, COLUMNS) is None
    assert external_sink(postgres(), DSN) is None
    ice = sink_for(iceberg()).external("host=ledger", COLUMNS, CommitSpec(columns=("topic",)))
    assert isinstance(ice, IcebergSink)
    assert (ice.sink_dsn, ice.table_name, ice.columns, ice.spec.columns) == (
        DSN, "events", tuple(COLUMNS), ("topic",))  # the sink's connection, not the ledger's
    assert isinstance(external_sink(kafka(), DSN), KafkaTopicSink)
    assert external_sink(kafka(), DSN).spec == CommitSpec(columns=())  # type: ignore[union-attr]


def test_a_postgresql_append_and_a_kafka_topic_commit_part_by_part() -> None:
    assert sink_for(postgres()).commits_partwise
    assert not sink_for(postgres(mode="upsert", key=["event_id"])).commits_partwise
    assert not sink_for(iceberg()).commits_partwise  # step 4 commits the whole batch
    # each part produced into the batch's open transaction as its task staged it
    assert sink_for(kafka()).commits_partwise
    assert isinstance(external_sink(kafka(), DSN), PartwiseSink)
    assert not isinstance(sink_for(iceberg()).external(DSN, COLUMNS), PartwiseSink)


def test_an_iceberg_append_and_a_kafka_sink_from_the_fused_path_have_the_tasks_write_files(
        ) -> None:
    assert task_data_files(iceberg()) and sink_for(iceberg()).tasks_write_files
    assert not task_data_files(iceberg({"transform": "mod.fn"}))
    assert not task_data_files(iceberg({"quality": {"suite": "orders"}}))
    assert not task_data_files(iceberg(mode="upsert", key=["event_id"]))
    assert not task_data_files(postgres())
    # a Kafka sink's task files (issue 32): `auto` by default, `off` the stage
    assert task_data_files(kafka()) and not task_data_files(kafka(task_files="off"))
    # no table is loaded, no directory made, where the tasks stage in PostgreSQL: with
    # `auto`, wherever the tasks may run on another host than the driver's
    for cfg in (postgres(), kafka(), kafka(task_files="off"), iceberg({"transform": "mod.fn"})):
        assert sink_for(cfg).task_files(DSN, batch(), COLUMNS) is None


def test_a_kafka_replay_without_a_side_topic_is_refused_before_reading() -> None:
    sink_for(kafka()).check_before_read(batch())  # live: the live topic
    sink_for(kafka(replay_topic="o.replay")).check_before_read(
        batch("replay", "kafka:o.replay"))
    with pytest.raises(ConfigError, match=r"batch 7 is a replay of offsets.*sink.replay_topic"):
        sink_for(kafka()).check_before_read(batch("replay", "kafka:o"))
    for cfg in (postgres(), iceberg()):
        sink_for(cfg).check_before_read(batch("replay"))


def test_after_commit_sweeps_only_iceberg_files(monkeypatch: pytest.MonkeyPatch) -> None:
    from offsetflow.sinks.iceberg import pipeline

    swept: list[tuple[str, int]] = []
    monkeypatch.setattr(pipeline, "sweep_batch_orphans",
                        lambda cfg, dsn, bid: swept.append(("orphans", bid)))
    monkeypatch.setattr(pipeline, "sweep_after_retry",
                        lambda cfg, dsn, bid: swept.append(("retry", bid)))
    tasks, stage = CommitSpec(columns=(), task_files=True), CommitSpec(columns=())
    ice = sink_for(iceberg())
    ice.after_commit(DSN, batch(attempts=1), tasks)
    ice.after_commit(DSN, batch(attempts=1), stage)  # a first attempt left nothing
    ice.after_commit(DSN, batch(attempts=2), stage)
    assert swept == [("orphans", 7), ("retry", 7)]
    for cfg in (postgres(), kafka(task_files="off")):
        sink_for(cfg).after_commit(DSN, batch(attempts=3), stage)
    assert len(swept) == 2


def test_own_table_however_spelled() -> None:
    pg = sink_for(postgres())
    assert pg.owns_table("events") and pg.owns_table("public.events")
    assert not pg.owns_table("other") and not pg.owns_table("lake.events")
    ice = sink_for(iceberg())  # `events`, `public.events`: offsetflow.events there
    assert ice.owns_table("events") and ice.owns_table("offsetflow.events")
    assert ice.owns_table("public.events")
    assert not ice.owns_table("lake.events") and not ice.owns_table("other")


def test_backfills_guarded_by_the_live_position_where_the_live_batches_write() -> None:
    for cfg in (postgres(), iceberg()):
        sink = sink_for(cfg)
        assert sink.writes_live_output(None) and sink.writes_live_output("events")
        assert not sink.writes_live_output("side")
    assert not sink_for(kafka(replay_topic="o.replay")).writes_live_output(None)


@pytest.mark.parametrize("make", [postgres, iceberg])
def test_table_sinks_refuse_a_window_beyond_the_live_position(make: Any) -> None:
    cfg, w, committed = make(), {("t", 0): (0, 60)}, {("t", 0): 50}
    with pytest.raises(RequestError, match=r"cannot backfill t\[0\] \[0, 60\) into the "
                                           r"pipeline's own table events: .*live position 50"):
        check_live_positions(cfg, window("backfill"), w, committed)
    with pytest.raises(RequestError, match=r"cannot backfill"):
        check_live_positions(cfg, window("backfill", target_table="events"), w, committed)
    check_live_positions(cfg, window("backfill", target_table="side"), w, committed)
    with pytest.raises(RequestError, match=r"cannot replay t\[0\] \[0, 60\)"):
        check_live_positions(cfg, window("replay"), w, committed)
    check_live_positions(cfg, window("replay"), {("t", 0): (0, 50)}, committed)


def test_a_kafka_sink_takes_windows_only_into_its_side_topic() -> None:
    w, committed = {("t", 0): (0, 60)}, {("t", 0): 50}
    with pytest.raises(RequestError, match=r"^a backfill of pipeline orders would write its "
                                           r"records to the live output topic o a second time "
                                           r"\(Kafka cannot delete them\); name a side topic "
                                           r"in sink.replay_topic of orders.yaml$"):
        check_live_positions(kafka(), window("backfill"), w, committed)
    side = kafka(replay_topic="o.replay")
    with pytest.raises(RequestError, match=r"^pipeline orders writes to Kafka topic o; a "
                                           r"backfill goes to its sink.replay_topic, not to a "
                                           r"table \(target_table\)$"):
        check_live_positions(side, window("backfill", target_table="t2"), w, committed)
    check_live_positions(side, window("backfill"), w, committed)  # not the live topic
    with pytest.raises(RequestError, match=r"cannot replay"):
        check_live_positions(side, window("replay"), w, committed)


def test_what_a_window_batch_records_as_its_target() -> None:
    for cfg in (postgres(), iceberg()):
        assert sink_for(cfg).window_target(None) == "events"
        assert sink_for(cfg).window_target("side") == "side"
    assert sink_for(kafka(replay_topic="o.replay")).window_target(None) == "kafka:o.replay"
    assert sink_for(kafka()).window_target(None) == "kafka:o"


def test_complete_is_refused_where_no_sink_record_can_complete_a_batch() -> None:
    with pytest.raises(BatchStateError) as e:
        sink_for(postgres()).complete_from(DSN, batch())
    assert str(e.value) == (
        "batch 7: pipeline orders writes to PostgreSQL, where rows and ledger commit "
        "together; there is no sink record to complete it from (run it, or abandon it)")
    with pytest.raises(BatchStateError) as e:
        sink_for(iceberg(mode="upsert", key=["event_id"])).complete_from(DSN, batch())
    assert str(e.value) == (
        "batch 7: complete is not offered for Iceberg upsert pipelines (the batch's deleted "
        "keys could not be remembered); run it")
    assert isinstance(sink_for(iceberg()).complete_from(DSN, batch()), IcebergSink)
    assert isinstance(sink_for(kafka()).complete_from(DSN, batch()), KafkaTopicSink)


def test_what_reset_position_asks_each_sink() -> None:
    pg, up = sink_for(postgres()), sink_for(postgres(mode="upsert", key=["event_id"]))
    ice, kf = sink_for(iceberg()), sink_for(kafka())
    assert [s.reset_rows_table for s in (pg, up, ice, kf)] == ["events", None, None, None]
    assert [s.live_topic for s in (pg, up, ice, kf)] == [None, None, None, "o"]
    assert [s.reset_check(DSN, "t", [0], 5) for s in (pg, up, kf)] == [None, None, None]
    check = ice.reset_check(DSN, "t", [0, 1], 5)  # built, not run: it reads the table
    assert check is not None and callable(check)


def test_a_postgresql_pipeline_loads_neither_pyiceberg_nor_the_other_sinks() -> None:
    code = (
        "import sys\n"
        "import offsetflow.cli, offsetflow.ops, offsetflow.job.driver\n"
        "from offsetflow.config import parse_pipeline\n"
        "from offsetflow.ledger import Batch\n"
        "from offsetflow.sinks import sink_for\n"
        "cfg = parse_pipeline({'name': 'p', 'kafka': {'bootstrap_servers': 'k:9092'},\n"
        "    'source': {'topics': ['t']}, 'format': {'type': 'json', 'schema': {'a': 'string'}},\n"
        "    'sink': {'connection': 'postgresql://h/db', 'table': 'events'}}, 'p.yaml', {})\n"
        "s = sink_for(cfg)\n"
        "b = Batch(1, 'p', 'scheduled', 'running', (), 'events')\n"
        "assert s.external('x') is None and s.task_files('x', b, []) is None\n"
        "s.check_before_read(b); s.window_target(None); s.reset_check('x', 't', [0], 0)\n"
        "loaded = [m for m in sys.modules if m.startswith(('pyiceberg',\n"
        "          'offsetflow.sinks.iceberg'))]\n"
        "assert not loaded, loaded\n")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": f"{root / 'plugins'}:{root}"}, timeout=120)
    assert out.returncode == 0, out.stderr
