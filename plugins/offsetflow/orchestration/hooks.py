"""OffsetFlowHook: a pipeline's ledger and Kafka metadata from Airflow connection ids.

Like the providers' hooks it is built from connection ids (`postgres_conn_id` for the
ledger/sink database, `kafka_conn_id` for the brokers); both default to what the pipeline
config names (`sink.conn_id`, `kafka.conn_id`) or its literal settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from typing import Any

from airflow.sdk import BaseHook

from offsetflow.config import KafkaConfig, PipelineConfig, find_pipeline, parse_pipeline
from offsetflow.errors import ConfigError
from offsetflow.ledger import Ledger
from offsetflow.orchestration import assets, connections
from offsetflow.source import KafkaMetadata


class OffsetFlowHook(BaseHook):
    """Resolve a pipeline (by name from the pipelines folder, or an inline config dict) with
    its credentials from Airflow connections, and open its ledger and Kafka metadata.

    :param pipeline: pipeline name in the pipelines folder (or give ``config``)
    :param config: an inline pipeline config, the same mapping as a pipeline YAML
    :param postgres_conn_id: a ``postgres`` connection overriding the config's sink
    :param kafka_conn_id: a ``kafka`` connection overriding the config's brokers
    """

    conn_name_attr = "postgres_conn_id"
    default_conn_name = "offsetflow_postgres"
    conn_type = "postgres"
    hook_name = "OffsetFlow"

    def __init__(self, *, pipeline: str | None = None, config: Mapping[str, Any] | None = None,
                 postgres_conn_id: str | None = None, kafka_conn_id: str | None = None) -> None:
        super().__init__()
        if (pipeline is None) == (config is None):
            raise ConfigError("OffsetFlowHook", "pipeline",
                              "give exactly one of pipeline (a name) or config (a mapping)")
        self.pipeline = pipeline
        self.config = config
        self.postgres_conn_id = postgres_conn_id
        self.kafka_conn_id = kafka_conn_id

    def load_config(self) -> PipelineConfig:
        """The config as written (connections not resolved): safe to build a DAG from."""
        if self.config is not None:
            name = self.config.get("name", "inline")
            cfg = parse_pipeline(dict(self.config), f"<inline config {name}>")
        else:
            cfg = find_pipeline(str(self.pipeline))
        if self.kafka_conn_id:
            cfg = replace(cfg, kafka=KafkaConfig(conn_id=self.kafka_conn_id),
                          bootstrap_servers="")
        if self.postgres_conn_id:
            cfg = replace(cfg, sink=replace(cfg.sink, conn_id=self.postgres_conn_id,
                                            connection=""))
        return cfg

    @cached_property
    def pipeline_config(self) -> PipelineConfig:
        """The config with its connections resolved (password masked in task logs)."""
        return connections.resolve(self.load_config(), self.get_connection)

    def get_ledger(self) -> Ledger:
        return Ledger(self.pipeline_config.sink.connection)

    def get_kafka_metadata(self) -> KafkaMetadata:
        from offsetflow.ops import kafka_for

        return kafka_for(self.pipeline_config)

    def target_uri(self, table: str | None = None) -> str:
        return assets.target_uris(self.pipeline_config, table)

    def topic_uris(self) -> list[str]:
        cfg = self.pipeline_config
        return [assets.topic_uri(cfg.bootstrap_servers, t) for t in cfg.topics]

    def test_connection(self) -> tuple[bool, str]:
        """Open the ledger and list the pipeline's topics' partitions."""
        try:
            with self.get_ledger() as ledger:
                ledger.positions(self.pipeline_config.name)
            return True, "ledger reachable"
        except Exception as e:  # noqa: BLE001 - reported to the user, not raised
            return False, str(e)
