"""A sensor that waits until a pipeline has new committed offsets to read.

Deferrable as Airflow's `[operators] default_deferrable` says (as the providers' operators
are): then, after one immediate check, the wait moves to Airflow's triggerer
(`NewOffsetsTrigger`), so a pipeline that runs "when data arrives" holds no worker slot
while Kafka is quiet; `deferrable=False` pokes from the worker like a classic sensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from airflow.configuration import conf
from airflow.sdk import BaseSensorOperator, PokeReturnValue

from offsetflow.errors import ConfigError, WaitError
from offsetflow.orchestration.triggers import NewOffsetsTrigger, PipelineRef, check_pipeline


class OffsetFlowNewDataSensor(BaseSensorOperator):
    """Succeeds when `pipeline` has at least `min_offsets` offsets beyond its committed
    positions (Kafka's last stable offsets under read_committed: records of open
    transactions do not count). XCom: ``{"pending": n, "partitions": {"topic/p": n}}``.

    A pipeline with ``starting: latest`` that has never planned has no start yet, so
    nothing counts as new until its first run plans.

    The pipeline as the operators take it: `pipeline` (a name in the pipelines folder) or
    an inline `config`, and `postgres_conn_id`/`kafka_conn_id` overriding its connections.
    """

    template_fields: Sequence[str] = ("pipeline", "config", "postgres_conn_id",
                                      "kafka_conn_id")

    def __init__(self, *, pipeline: str | None = None, config: Mapping[str, Any] | None = None,
                 postgres_conn_id: str | None = None, kafka_conn_id: str | None = None,
                 min_offsets: int = 1, poke_interval: float = 30.0,
                 deferrable: bool = conf.getboolean("operators", "default_deferrable",
                                                    fallback=False),
                 **kwargs: Any) -> None:
        super().__init__(poke_interval=poke_interval, **kwargs)
        if min_offsets < 1:
            raise ValueError(f"min_offsets must be at least 1, got {min_offsets}")
        if (pipeline is None) == (config is None):
            raise ConfigError(type(self).__name__, "pipeline",
                              "give exactly one of pipeline (a name) or config (a mapping)")
        self.pipeline = pipeline
        self.config = dict(config) if config is not None else None
        self.postgres_conn_id = postgres_conn_id
        self.kafka_conn_id = kafka_conn_id
        self.min_offsets = min_offsets
        self.deferrable = deferrable

    @property
    def ref(self) -> PipelineRef:
        """Built when used: template fields are rendered by then."""
        return PipelineRef(self.pipeline, self.config, self.postgres_conn_id,
                           self.kafka_conn_id)

    def _result(self, pending: dict[str, int]) -> dict[str, Any]:
        return {"pending": sum(pending.values()), "partitions": pending}

    def poke(self, context: Any) -> PokeReturnValue:
        pending = check_pipeline(self.ref)
        done = sum(pending.values()) >= self.min_offsets
        self.log.info("pipeline %s: %d offsets waiting (need %d)", self.ref.name,
                      sum(pending.values()), self.min_offsets)
        return PokeReturnValue(is_done=done, xcom_value=self._result(pending) if done else None)

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        first = self.poke(context)
        if first.is_done:
            return first.xcom_value
        self.defer(
            trigger=NewOffsetsTrigger(**self.ref.kwargs(), poll_interval=self.poke_interval,
                                      min_offsets=self.min_offsets),
            method_name="execute_complete",
            timeout=timedelta(seconds=float(self.timeout)) if self.timeout else None,
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event.get("status") != "data":
            raise WaitError(f"waiting for new data of pipeline {self.ref.name} failed: "
                            f"{event.get('message', event)}")
        self.log.info("pipeline %s: %d offsets arrived: %s", self.ref.name, event["pending"],
                      event["partitions"])
        return {"pending": event["pending"], "partitions": event["partitions"]}
