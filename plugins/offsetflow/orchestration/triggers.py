"""Deferrable waiting for new data: a trigger that fires when a pipeline's topics have
committed offsets beyond its ledger positions, run by Airflow's triggerer (no worker slot).

The check itself (`offsetflow.ops.runner.pending_for`: ledger positions, Kafka's last stable
offsets under read_committed) is blocking confluent-kafka/psycopg2 code, so it runs in a
thread. Brokers or PostgreSQL being away for a while is normal for a wait of hours: those
errors are logged and polled again; a config error ends the wait with an error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg2
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent
from confluent_kafka import KafkaException

from offsetflow.config import PipelineConfig
from offsetflow.errors import ConfigError, KafkaUnavailableError
from offsetflow.plan import OpenBatchRetry, describe

log = logging.getLogger(__name__)

TRANSIENT = (KafkaUnavailableError, KafkaException, psycopg2.OperationalError, OSError)


@dataclass(frozen=True)
class PipelineRef:
    """Which pipeline a wait is for, as the operators take it: a name in the pipelines folder
    or an inline config, and connection ids overriding the config's. Plain values, so a
    trigger serializes it for the triggerer."""
    pipeline: str | None = None
    config: Mapping[str, Any] | None = None
    postgres_conn_id: str | None = None
    kafka_conn_id: str | None = None

    @property
    def name(self) -> str:
        return self.pipeline or str((self.config or {}).get("name", "inline"))

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in (("pipeline", self.pipeline), ("config", self.config),
                                  ("postgres_conn_id", self.postgres_conn_id),
                                  ("kafka_conn_id", self.kafka_conn_id)) if v is not None}

    def resolve(self) -> PipelineConfig:
        """The config with its Airflow connections resolved (blocking)."""
        from offsetflow.orchestration.connections import resolve
        from offsetflow.orchestration.hooks import OffsetFlowHook

        # the hook applies the overrides; `resolve` asks the Task SDK, else (the triggerer,
        # the CLI) Airflow's secrets backends and metadata DB
        return resolve(OffsetFlowHook(
            pipeline=self.pipeline, config=dict(self.config) if self.config is not None
            else None, postgres_conn_id=self.postgres_conn_id,
            kafka_conn_id=self.kafka_conn_id).load_config())


def as_ref(pipeline: str | PipelineRef) -> PipelineRef:
    return PipelineRef(pipeline=pipeline) if isinstance(pipeline, str) else pipeline


def check_pipeline(pipeline: str | PipelineRef) -> dict[str, int]:
    """Offsets waiting per "topic/partition" (blocking: call it in a thread)."""
    from offsetflow.ops import pending_for

    # a pipeline may name Airflow connections (kafka.conn_id, sink.conn_id)
    return describe(pending_for(as_ref(pipeline).resolve()))


async def poll_pending(ref: PipelineRef, min_offsets: int, poll_interval: float,
                       log_prefix: str) -> dict[str, Any]:
    """Poll until at least `min_offsets` offsets wait; returns the event payload (an
    `error` payload for failures polling cannot fix)."""
    while True:
        try:
            pending = await asyncio.to_thread(check_pipeline, ref)
        except TRANSIENT as e:
            log.warning("%s: could not check for new data (%s); retrying in %.0f s",
                        log_prefix, e, poll_interval)
        except Exception as e:  # noqa: BLE001 - reported to the task, which raises it
            return {"status": "error", "pipeline": ref.name,
                    "message": f"{type(e).__name__}: {e}"}
        else:
            total = sum(pending.values())
            if total >= min_offsets:
                return {"status": "data", "pipeline": ref.name, "pending": total,
                        "partitions": pending}
            log.info("%s: %d offsets waiting (need %d); next check in %.0f s", log_prefix,
                     total, min_offsets, poll_interval)
        await asyncio.sleep(poll_interval)


# a run alive this long is named in a warning (once an hour): its lock may have outlived it
LIVE_WARN_S = 3600.0


@dataclass
class RetryMemory:
    """What one watcher remembers between polls: what it logged (once per batch, attempt and
    state) and when it first saw each attempt's run gone (its retry delay counts from then)."""
    told: set[tuple[int, int, str, int]] = field(default_factory=set)
    gone_since: dict[tuple[int, int], float] = field(default_factory=dict)


def open_batch_wait(ref: PipelineRef, base_s: float, memory: RetryMemory
                    ) -> OpenBatchRetry | None:
    """`runner.open_batch_wait` for a pipeline (blocking: call it in a thread)."""
    from offsetflow.ops import open_batch_wait as wait_for

    return wait_for(ref.resolve(), base_s, gone_since=memory.gone_since)


async def retry_due(ref: PipelineRef, poll_interval: float, memory: RetryMemory) -> bool:
    """Whether the pipeline's waiting data may start a run now: not while a run of its open
    batch is alive, nor while that batch failed, or was left `running` by a run that is
    gone, less than its retry delay ago (`arrival.retry_wait`); said in the log once per
    batch, attempt count and state. A run alive for over LIVE_WARN_S is named (the sessions
    holding its lock) once an hour, with the way out. A check that fails for another reason
    than an outage lets the run start: the run then says what is wrong."""
    pipeline = ref.name
    try:
        retry = await asyncio.to_thread(open_batch_wait, ref, poll_interval, memory)
    except TRANSIENT as e:
        log.warning("pipeline %s: could not read its open batch (%s); checking again in "
                    "%.0f s", pipeline, e, poll_interval)
        return False
    except Exception as e:  # noqa: BLE001 - the run reports it with its context
        log.error("pipeline %s: checking its open batch failed (%s: %s); starting the run",
                  pipeline, type(e).__name__, e)
        return True
    if retry is None or retry.wait_s <= 0:
        return True
    hours = int((retry.running_s or 0.0) // LIVE_WARN_S) if retry.state == "live" else 0
    key = (retry.batch_id, retry.attempts, retry.state, hours)
    if key in memory.told:
        return False
    memory.told.add(key)
    if retry.state == "live" and hours:
        log.warning("pipeline %s: open batch %d has been running for %.0f min (attempt %d) and "
                    "the watcher starts no second run while its run lock is held, by: %s. If "
                    "that run is gone (a connection pooler in transaction mode keeps session "
                    "locks: the ledger needs a direct or session-pooled connection), end the "
                    "session with SELECT pg_terminate_backend(<pid>), or retry the batch now "
                    "with a manual DAG run or `offsetflow run-batch`", pipeline,
                    retry.batch_id, (retry.running_s or 0.0) / 60, retry.attempts,
                    "; ".join(retry.holders))
    elif retry.state == "live":
        log.info("pipeline %s: open batch %d is being run (attempt %d; its run is alive: %s);"
                 " the watcher starts no second run of it", pipeline, retry.batch_id,
                 retry.attempts, "; ".join(retry.holders))
    else:
        what = ("failed" if retry.state == "failed" else
                "was left running by a run that is gone (its driver was killed, or stopped "
                "without recording a failure, or lost its database connection)")
        log.warning("pipeline %s: open batch %d %s (attempt %d); the next event-driven "
                    "run retries it in %.0f s (the wait doubles per attempt, at most 15 "
                    "min). A manual DAG run or `offsetflow run-batch` retries it now; "
                    "`offsetflow abandon` drops it", pipeline, retry.batch_id, what,
                    retry.attempts, retry.wait_s)
    return False


class NewOffsetsTrigger(BaseTrigger):
    """Fires once when a pipeline has at least `min_offsets` committed offsets to read. The
    pipeline as the operators take it: `pipeline` (a name) or an inline `config`, and
    `postgres_conn_id`/`kafka_conn_id` overriding the config's connections."""

    def __init__(self, *, pipeline: str | None = None, config: Mapping[str, Any] | None = None,
                 postgres_conn_id: str | None = None, kafka_conn_id: str | None = None,
                 poll_interval: float = 30.0, min_offsets: int = 1) -> None:
        super().__init__()
        if (pipeline is None) == (config is None):
            raise ConfigError(type(self).__name__, "pipeline",
                              "give exactly one of pipeline (a name) or config (a mapping)")
        self.ref = PipelineRef(pipeline, dict(config) if config is not None else None,
                               postgres_conn_id, kafka_conn_id)
        self.pipeline = self.ref.name
        self.poll_interval = float(poll_interval)
        self.min_offsets = int(min_offsets)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {**self.ref.kwargs(), "poll_interval": self.poll_interval,
                 "min_offsets": self.min_offsets})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        payload = await poll_pending(self.ref, self.min_offsets, self.poll_interval,
                                     f"pipeline {self.pipeline}")
        yield TriggerEvent(payload)


class NewOffsetsEventTrigger(NewOffsetsTrigger, BaseEventTrigger):
    """The same check for event-driven scheduling: an `AssetWatcher` on an Asset that a
    pipeline DAG is scheduled on starts a run "when data arrives". Error payloads are not
    emitted as events (they would start runs); they are logged and polled again. An open
    batch counts as waiting data, but starts no run while a run of it is alive, and one
    that failed (or whose driver died) only after its retry delay (`retry_due`): a batch
    failing for good would otherwise start a failing run every poll interval until someone
    abandons it."""

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # The triggerer restarts a watcher's trigger as soon as it fires. Checking at once
        # would fire again about every second on the same waiting data while the run it
        # started is still reading (an asset event, and a queued run, each time): a
        # restarted watcher waits one poll interval first.
        await asyncio.sleep(self.poll_interval)
        memory = RetryMemory()
        while True:
            payload = await poll_pending(self.ref, self.min_offsets, self.poll_interval,
                                         f"pipeline {self.pipeline} (asset watcher)")
            if payload["status"] == "data":
                if await retry_due(self.ref, self.poll_interval, memory):
                    yield TriggerEvent(payload)
                    return
                await asyncio.sleep(self.poll_interval)
                continue
            log.error("pipeline %s: %s; checking again in %.0f s", self.pipeline,
                      payload["message"], self.poll_interval)
            await asyncio.sleep(self.poll_interval)
