"""Waiting without a worker slot (issue 20 item 4): the deferrable sensor defers to
`NewOffsetsTrigger`, which stays quiet while the pipeline's positions are current (and while
records sit in an open transaction: read_committed) and fires once committed records arrive.
Real Kafka and PostgreSQL; the trigger's blocking calls run in threads."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from confluent_kafka import Producer

from offsetflow.errors import WaitError
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import SCHEMA, produce_plain, query, record


@pytest.fixture
def waiting_pipeline(tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any,
                     unique: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A pipeline (starting: latest) whose first plan put its positions at the log end,
    after 6 records were already in the topic: nothing is waiting."""
    from offsetflow.config import find_pipeline

    topic = make_topic("wait", 2)
    produce_plain(kafka_bootstrap, topic, 6, f"old-{unique}", 2)
    name = f"wait_{unique}"
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    (pipelines / f"{name}.yaml").write_text(yaml.safe_dump({
        "name": name, "schedule": None,
        "kafka": {"bootstrap_servers": kafka_bootstrap},
        "source": {"topics": [topic], "starting": "latest"},
        "format": {"type": "json", "schema": dict(SCHEMA)},
        "sink": {"connection": pg_dsn, "table": f"wait_{unique}"}}))
    monkeypatch.setenv("OFFSETFLOW_PIPELINES_DIR", str(pipelines))
    cfg = find_pipeline(name)
    assert plan_only(cfg, pg_dsn).batch is None  # first plan: positions at the end
    return {"name": name, "topic": topic, "file": pipelines / f"{name}.yaml"}


async def _until(task: asyncio.Task[Any], seconds: float) -> bool:
    """Whether `task` finished within `seconds` (it keeps running otherwise)."""
    done, _ = await asyncio.wait({task}, timeout=seconds)
    return bool(done)


async def _first_event(trigger: Any) -> Any:
    async for event in trigger.run():
        return event
    raise AssertionError("the trigger ended without an event")


def test_trigger_fires_only_for_committed_records_beyond_positions(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, unique: str) -> None:
    from offsetflow.orchestration.triggers import NewOffsetsTrigger

    topic = waiting_pipeline["topic"]
    trigger = NewOffsetsTrigger(pipeline=waiting_pipeline["name"], poll_interval=0.5)
    producer = Producer({"bootstrap.servers": kafka_bootstrap,
                         "transactional.id": f"wait-{unique}"})
    producer.init_transactions(30)

    async def scenario() -> Any:
        task = asyncio.ensure_future(_first_event(trigger))
        # windows of 4 polls (0.5 s): a trigger that fires wrongly fires at its next poll
        assert not await _until(task, 2), "fired although the positions are current"
        producer.begin_transaction()
        for i in range(3):
            rec = record(f"new-{unique}-{i}", i)
            producer.produce(topic, json.dumps(rec).encode(), partition=i % 2)
        producer.flush(30)  # in the log, but not committed: beyond the last stable offset
        assert not await _until(task, 2), "fired for records of an open transaction"
        producer.commit_transaction(30)
        t = time.monotonic()
        assert await _until(task, 30), "did not fire after committed records arrived"
        return task.result(), time.monotonic() - t

    event, waited = asyncio.run(scenario())
    payload = event.payload
    assert payload["status"] == "data" and payload["pipeline"] == waiting_pipeline["name"]
    # 3 records plus the transaction's commit markers (one per partition it wrote to)
    assert payload["pending"] == 5, payload
    assert payload["partitions"] == {f"{topic}/0": 3, f"{topic}/1": 2}
    assert waited < 10


def test_sensor_defers_then_completes_with_what_arrived(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, unique: str) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    from offsetflow.orchestration.sensors import OffsetFlowNewDataSensor
    from offsetflow.orchestration.triggers import NewOffsetsTrigger

    sensor = OffsetFlowNewDataSensor(task_id="wait", pipeline=waiting_pipeline["name"],
                                     poke_interval=0.5, min_offsets=4, timeout=600,
                                     deferrable=True)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    assert deferred.value.method_name == "execute_complete"
    # what the triggerer gets: the serialized form, rebuilt
    path, kwargs = deferred.value.trigger.serialize()
    assert path == "offsetflow.orchestration.triggers.NewOffsetsTrigger"
    trigger = NewOffsetsTrigger(**kwargs)

    async def scenario() -> Any:
        task = asyncio.ensure_future(_first_event(trigger))
        assert not await _until(task, 2)  # 4 polls
        produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 3, f"a-{unique}", 2)
        assert not await _until(task, 2), "fired below min_offsets"
        produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 1, f"b-{unique}", 2,
                      start_seq=3)
        assert await _until(task, 30)
        return task.result()

    event = asyncio.run(scenario())
    out = sensor.execute_complete({}, event.payload)
    assert out["pending"] == 4
    # data already waiting: no deferral at all
    assert sensor.execute({})["pending"] == 4


def test_sensor_and_trigger_take_an_inline_config_and_connection_ids(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, unique: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the operators do (issue 29 item 4): an inline `config=` (a DAG with no pipelines
    folder) and a `kafka_conn_id` overriding its brokers, carried through the trigger's
    serialized form to the triggerer."""
    from airflow.sdk.exceptions import TaskDeferred

    from offsetflow.orchestration.sensors import OffsetFlowNewDataSensor
    from offsetflow.orchestration.triggers import NewOffsetsTrigger

    raw = yaml.safe_load(waiting_pipeline["file"].read_text())
    raw["kafka"] = {"bootstrap_servers": "127.0.0.1:1"}  # the connection must win
    conn_id = f"wait_kafka_{unique}"
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(
        {"conn_type": "kafka", "extra": {"bootstrap.servers": kafka_bootstrap}}))
    monkeypatch.setenv("OFFSETFLOW_PIPELINES_DIR", "/nonexistent")  # no folder needed
    sensor = OffsetFlowNewDataSensor(task_id="wait", config=raw, kafka_conn_id=conn_id,
                                     poke_interval=0.5, min_offsets=2, deferrable=True)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    _, kwargs = deferred.value.trigger.serialize()
    assert kwargs["config"] == raw and kwargs["kafka_conn_id"] == conn_id
    assert "pipeline" not in kwargs
    trigger = NewOffsetsTrigger(**kwargs)
    produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 2, f"c-{unique}", 2)
    event = asyncio.run(asyncio.wait_for(_first_event(trigger), 30))
    assert event.payload["status"] == "data", event.payload
    assert event.payload["pipeline"] == waiting_pipeline["name"]
    assert sensor.execute_complete({}, event.payload)["pending"] == 2


def test_broken_pipeline_ends_the_wait_with_a_clear_error(
        waiting_pipeline: dict[str, Any]) -> None:
    from offsetflow.orchestration.sensors import OffsetFlowNewDataSensor
    from offsetflow.orchestration.triggers import NewOffsetsTrigger

    trigger = NewOffsetsTrigger(pipeline="no_such_pipeline", poll_interval=0.5)
    event = asyncio.run(asyncio.wait_for(_first_event(trigger), 30))
    assert event.payload["status"] == "error"
    sensor = OffsetFlowNewDataSensor(task_id="wait", pipeline="no_such_pipeline")
    with pytest.raises(WaitError, match="no_such_pipeline"):
        sensor.execute_complete({}, event.payload)


WAIT_DAG = '''
from datetime import datetime

from airflow.sdk import DAG

from offsetflow.orchestration.sensors import OffsetFlowNewDataSensor

with DAG(dag_id="{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    OffsetFlowNewDataSensor(task_id="wait", pipeline="{pipeline}", min_offsets=3,
                            poke_interval=1, timeout=300, deferrable=True)
'''


@pytest.mark.slow  # a real `airflow dags test`, which runs the deferred trigger itself
def test_sensor_in_a_dag_run_defers_and_resumes_when_records_arrive(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, unique: str,
        tmp_path: Path) -> None:
    import os
    import threading

    from tests.tooling.airflow_dags import run_airflow

    dag_id = f"offsetflow_dagtest_wait_{unique}"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{dag_id}.py").write_text(WAIT_DAG.format(dag_id=dag_id,
                                                       pipeline=waiting_pipeline["name"]))
    log_file = tmp_path / "dags-test.log"
    log_file.touch()
    env = {**os.environ, "AIRFLOW__CORE__DAGS_FOLDER": str(dags)}
    result: list[int] = []
    run = threading.Thread(target=lambda: result.append(run_airflow(
        ["airflow", "dags", "test", dag_id, "--dagfile-path", str(dags / f"{dag_id}.py")],
        env, log_file, timeout=480)), daemon=True)
    run.start()
    deadline = time.monotonic() + 240
    while "deferred" not in log_file.read_text().lower():
        assert run.is_alive(), log_file.read_text()[-4000:]
        assert time.monotonic() < deadline, "the sensor never deferred"
        time.sleep(0.5)
    # the trigger polls every second: three polls without data must not end the run
    run.join(timeout=3)
    assert run.is_alive(), "the run ended although no data arrived"
    produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 3, f"d-{unique}", 2)
    run.join(timeout=240)
    assert not run.is_alive() and result, "the run did not end after the data arrived"
    rc = result[0]
    text = log_file.read_text()
    assert rc == 0, text[-4000:]
    assert "3 offsets arrived" in text, text[-4000:]
    assert "state=success" in text or "success" in text.lower()


def test_event_trigger_restarted_at_once_does_not_fire_again_at_once(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, unique: str) -> None:
    """An AssetWatcher's trigger is restarted by the triggerer right after it fires; the data
    it fired for is still waiting (the run it started has not committed yet), so a restart
    that checked at once would flood asset events and queued runs about once a second."""
    from offsetflow.orchestration.triggers import NewOffsetsEventTrigger

    produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 3, f"ev-{unique}", 2)

    async def scenario() -> tuple[bool, bool]:
        first = NewOffsetsEventTrigger(pipeline=waiting_pipeline["name"], poll_interval=5)
        fired = await _until(asyncio.ensure_future(_first_event(first)), 30)
        again = asyncio.ensure_future(_first_event(
            NewOffsetsEventTrigger(pipeline=waiting_pipeline["name"], poll_interval=5)))
        refired_at_once = await _until(again, 3)  # a check at once fires in well under 1 s
        fired_later = await _until(again, 20)  # still waiting data: fires after the pause
        return fired, refired_at_once or not fired_later

    fired, flood = asyncio.run(scenario())
    assert fired, "the watcher never fired for waiting data"
    assert not flood, "a restarted watcher fired again at once (or never again)"


def test_event_trigger_waits_longer_after_each_failure_of_the_open_batch(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, pg_dsn: str,
        unique: str) -> None:
    """An open batch that failed counts as waiting data. A batch failing for good (records
    deleted, a broken config) made a watcher start a failing run every poll interval until
    someone abandoned it; now the retry waits the poll interval doubled per failure."""
    import psycopg2

    from offsetflow.config import find_pipeline
    from offsetflow.orchestration.triggers import NewOffsetsEventTrigger

    produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 3, f"fl-{unique}", 2)
    batch = plan_only(find_pipeline(waiting_pipeline["name"]), pg_dsn).batch
    assert batch is not None

    def set_failed(ago_s: float) -> None:
        with psycopg2.connect(pg_dsn) as conn, conn.cursor() as cur:
            cur.execute("""UPDATE offsetflow.batches SET status = 'failed', attempts = 3,
                                  error = 'test: failed for good',
                                  finished_at = now() - make_interval(secs => %s)
                            WHERE batch_id = %s""", (ago_s, batch.batch_id))
        conn.close()

    set_failed(0)  # three failures: the next retry 2 s x 2^2 = 8 s after the last

    async def scenario() -> tuple[bool, bool]:
        watcher = asyncio.ensure_future(_first_event(
            NewOffsetsEventTrigger(pipeline=waiting_pipeline["name"], poll_interval=2)))
        early = await _until(watcher, 6)  # polls at 2, 4, 6 s: one interval or two
        set_failed(3600)  # the delay has passed
        later = await _until(watcher, 15)
        return early, later

    early, later = asyncio.run(scenario())
    assert not early, "the watcher retried a batch that failed 3 times after one interval"
    assert later, "the watcher never retried the failed batch once its delay had passed"


@pytest.mark.slow  # three `offsetflow run-batch` processes (Spark Connect clients), killed
def test_event_trigger_waits_for_a_live_run_and_backs_off_a_batch_whose_driver_was_killed(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, pg_dsn: str, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spark_connect_url: str) -> None:
    """A batch whose driver is killed (kill -9, the kernel's OOM killer) stays `running` in
    the ledger. While its run is alive the watcher must start no second run of it, and names
    the sessions holding its run lock (a warning once it ran long: a lock can outlive its
    run); once the driver is gone it is retried, after the poll interval doubled per attempt
    like a failed batch, counted from when the watcher saw it gone (a batch whose driver
    dies every time ran a dying run every poll interval; counted from the attempt's start,
    a run that died late was retried at once)."""
    import logging
    import re

    from offsetflow.config import find_pipeline
    from offsetflow.ledger import Ledger
    from offsetflow.orchestration import triggers
    from offsetflow.orchestration.triggers import NewOffsetsEventTrigger
    from tests.tooling import chaos

    # the watcher's poll interval: a retry waits it doubled per attempt (2, 4, 8 s); the
    # windows below are these multiples of it, and the waits for an event end when it fires
    poll = 2.0
    monkeypatch.setattr(triggers, "LIVE_WARN_S", 2 * poll)
    warned: list[str] = []  # Airflow's logging set-up keeps these from pytest's caplog
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: warned.append(r.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(triggers.log, "handlers", [*triggers.log.handlers, handler])

    name = waiting_pipeline["name"]
    produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 3, f"kd-{unique}", 2)
    batch = plan_only(find_pipeline(name), pg_dsn).batch
    assert batch is not None
    log = tmp_path / "job.log"

    def state() -> tuple[str, int]:
        with Ledger(pg_dsn) as ledger:
            b = ledger.get_batch(batch.batch_id)
        return b.status, b.attempts

    def attempt_age_s() -> float:
        """Seconds since the batch's attempt started, by the ledger database's clock (the
        clock the retry delay counted from the attempt's start would use)."""
        age = query(pg_dsn, "SELECT extract(epoch FROM now() - started_at) FROM "
                            "offsetflow.batches WHERE batch_id = %s", (batch.batch_id,))[0][0]
        return float(age)

    def at_its_commit(since: Any) -> list[int]:
        """The backends opened since `since` (the database's clock) that wait at the
        commit's fencing step for the positions `hold_positions` holds."""
        return [pid for pid, in query(
            pg_dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = 'offsetflow' "
                    "AND wait_event_type = 'Lock' AND datname = current_database() AND "
                    f"backend_start >= %s AND {chaos.BLOCKED_BY_CHAOS}", (since,))]

    # each attempt's driver is a thin client of the warm Spark Connect server (no JVM of
    # its own), killed once it waits at its commit: its tasks have all ended, and the
    # driver's death is what the ledger and the watcher see (docs/development.md)
    connect_file = chaos.connect_file(waiting_pipeline["file"], spark_connect_url)
    started: dict[int, Any] = {}

    def start_run(attempt: int) -> Any:
        since = query(pg_dsn, "SELECT now()")[0][0]
        proc = chaos.run_batch_process(connect_file, batch.batch_id, log)
        chaos.wait_for(lambda: (state() == ("running", attempt) and bool(at_its_commit(since)))
                       or proc.poll() is not None,
                       300, f"attempt {attempt} to mark the batch running and wait to commit")
        assert proc.poll() is None, log.read_text()[-4000:]
        started[proc.pid] = since
        return proc

    def kill(proc: Any) -> None:
        """kill -9 of the driver. Its commit's backend, in a lock wait, reads nothing from
        the client and would outlive it holding the batch's row until the positions are
        free (the next attempt could not mark the batch running): ended with
        pg_terminate_backend, the way out the watcher's warning names. The run lock's idle
        connection ends with the client by itself, which is what the watcher looks at."""
        chaos.kill(proc)
        for pid in at_its_commit(started[proc.pid]):
            query(pg_dsn, "SELECT pg_terminate_backend(%s)", (pid,))

    def watcher() -> Any:
        return asyncio.ensure_future(_first_event(
            NewOffsetsEventTrigger(pipeline=name, poll_interval=poll)))

    # the commit waits on the held positions: every run stays alive until it is killed
    with chaos.hold_positions(pg_dsn, name):
        first = start_run(1)

        async def while_alive() -> bool:
            return await _until(watcher(), 4 * poll)  # polls past LIVE_WARN_S: the warning

        try:
            fired_while_alive = asyncio.run(while_alive())
        finally:
            kill(first)
        assert not fired_while_alive, \
            "the watcher started a second run of a batch whose run is alive"
        named = [m for m in warned if "pg_terminate_backend" in m]
        assert named and re.search(r"held, by: pid \d+ \(client", named[0]), warned
        second = start_run(2)
        kill(second)
        third = start_run(3)
        # it dies later than its retry delay (2 s x 2^2 = 8 s) after its start
        chaos.wait_for(lambda: attempt_age_s() > 4 * poll + 2 * poll, 120,
                       "attempt 3 to outlive its retry delay")
        kill(third)
    assert state() == ("running", 3)  # nothing marks a killed run failed

    async def after_kills() -> tuple[bool, bool]:
        task = watcher()
        # three attempts: 2 s x 2^2 = 8 s after the watcher saw the last one gone (at its
        # first poll, one interval in): not before 10 s; one interval, or the delay counted
        # from the attempt's start, would fire at 2-4 s
        early = await _until(task, 3.5 * poll)
        later = await _until(task, 30)
        return early, later

    early, later = asyncio.run(after_kills())
    assert not early, ("the watcher retried a batch whose driver was killed 3 times after "
                       "one interval")
    assert later, "the watcher never retried the batch whose driver was killed"
    assert state() == ("running", 3)


def test_event_trigger_holds_back_a_failed_batch_while_another_attempt_is_alive(
        waiting_pipeline: dict[str, Any], kafka_bootstrap: str, pg_dsn: str, unique: str,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt can fail while an earlier one still runs (a retry started by hand or by
    Airflow beside a run it lost track of): the batch is then `failed`, and its retry delay
    may be long past, but a run of it is alive. The watcher must start no run of it until
    that run is gone, then retry it at once (its delay counted from the failure)."""
    import logging

    import psycopg2

    from offsetflow.config import find_pipeline, parse_pipeline
    from offsetflow.errors import BatchStateError
    from offsetflow.job import run_batch
    from offsetflow.ledger import Ledger
    from offsetflow.orchestration import triggers
    from offsetflow.orchestration.triggers import NewOffsetsEventTrigger
    from tests.tooling import chaos

    warned: list[str] = []  # Airflow's logging set-up keeps these from pytest's caplog
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: warned.append(r.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(triggers.log, "handlers", [*triggers.log.handlers, handler])

    # upsert: its run holds no lock on the batch row until its commit, so another attempt
    # can record itself meanwhile (an append's commit holds it from the first part on)
    name, file = waiting_pipeline["name"], waiting_pipeline["file"]
    raw = yaml.safe_load(file.read_text())
    raw["sink"].update({"mode": "upsert", "key": ["event_id"]})
    file.write_text(yaml.safe_dump(raw))
    produce_plain(kafka_bootstrap, waiting_pipeline["topic"], 3, f"fa-{unique}", 2)
    batch = plan_only(find_pipeline(name), pg_dsn).batch
    assert batch is not None

    def state() -> tuple[str, int]:
        with Ledger(pg_dsn) as ledger:
            b = ledger.get_batch(batch.batch_id)
        return b.status, b.attempts

    # attempt 1 stays alive: its tasks wait to write their markers
    hold = psycopg2.connect(pg_dsn, application_name="offsetflow-chaos")
    first = None
    try:
        with hold.cursor() as cur:
            cur.execute("LOCK TABLE offsetflow.staged_parts IN SHARE ROW EXCLUSIVE MODE")
        log = tmp_path / "job.log"
        first = chaos.run_batch_process(file, batch.batch_id, log)
        chaos.wait_for(lambda: chaos.commit_waiting(pg_dsn) or first.poll() is not None,
                       300, "attempt 1 to stage")
        assert first.poll() is None, log.read_text()[-4000:]
        assert state() == ("running", 1)
        # attempt 2 fails while attempt 1 lives (here: a changed config, refused)
        changed = {**raw, "sink": {**raw["sink"], "table": f"other_{unique}"}}
        with pytest.raises(BatchStateError, match="config changed"):
            run_batch(None, parse_pipeline(changed, str(file), {}),  # type: ignore[arg-type]
                      batch.batch_id, pg_dsn)
        assert state() == ("failed", 2)

        async def while_alive() -> bool:
            # two attempts: 2 s x 2 = 4 s after the failure, long past at the end
            return await _until(asyncio.ensure_future(_first_event(
                NewOffsetsEventTrigger(pipeline=name, poll_interval=2))), 9)

        fired_while_alive = asyncio.run(while_alive())
    finally:
        if first is not None:
            chaos.kill(first)
        hold.rollback()
        hold.close()
    assert not fired_while_alive, ("the watcher started a run of a failed batch while "
                                   "another attempt of it is alive")
    assert not [m for m in warned if "retries it in" in m], warned
    assert state() == ("failed", 2)

    async def after_kill() -> bool:
        return await _until(asyncio.ensure_future(_first_event(
            NewOffsetsEventTrigger(pipeline=name, poll_interval=2))), 15)

    assert asyncio.run(after_kill()), \
        "the watcher never retried the failed batch once its other attempt was gone"
