"""The Kafka topic sink behind the pipeline's `Sink` interface: step 4 is `KafkaTopicSink`
(one producer transaction per batch); a replay or backfill goes only to the side topic
(`sink.replay_topic`), since Kafka cannot delete what the live topic holds."""

from __future__ import annotations

from collections.abc import Sequence

from offsetflow.commit import CommitSpec
from offsetflow.config import KafkaSinkConfig, PipelineConfig
from offsetflow.errors import RequestError
from offsetflow.ledger import Batch
from offsetflow.sinks.base import Sink
from offsetflow.sinks.kafka.mark import output_topic, replay_target
from offsetflow.sinks.kafka.sink import KafkaTopicSink


class KafkaPipelineSink(Sink):
    """`sink.type: kafka`."""

    def __init__(self, cfg: PipelineConfig) -> None:
        super().__init__(cfg)
        assert cfg.sink.kafka is not None
        self.kafka: KafkaSinkConfig = cfg.sink.kafka

    # -- the run ---------------------------------------------------------------------------
    def check_before_read(self, batch: Batch) -> None:
        """A replay or backfill without a side topic is refused before anything is read,
        not at the commit (`output_topic`)."""
        output_topic(self.kafka, batch, self.cfg.source_file)

    def external(self, dsn: str, columns: Sequence[tuple[str, str]] | None = None,
                 spec: CommitSpec | None = None) -> KafkaTopicSink:
        return KafkaTopicSink(self.cfg, columns, spec or CommitSpec(columns=()))

    # -- backfill and replay ---------------------------------------------------------------
    def check_window_target(self, kind: str, target_table: str | None) -> None:
        """Only ever into the side topic: never a table, never the live topic."""
        cfg = self.cfg
        if target_table is not None:
            raise RequestError(f"pipeline {cfg.name} writes to Kafka topic {self.kafka.topic}; "
                               f"a {kind} goes to its sink.replay_topic, not to a table "
                               f"(target_table)")
        if self.kafka.replay_topic is None:
            raise RequestError(f"a {kind} of pipeline {cfg.name} would write its records to "
                               f"the live output topic {self.kafka.topic} a second time "
                               f"(Kafka cannot delete them); name a side topic in "
                               f"sink.replay_topic of {cfg.source_file}")

    def writes_live_output(self, target_table: str | None) -> bool:
        """Never: a backfill writes the side topic (`check_window_target`)."""
        return False

    def window_target(self, target_table: str | None) -> str:
        """The side topic the batch writes to, not the live one (`kafka:<topic>`)."""
        return target_table or replay_target(self.kafka, self.cfg.sink.table)

    # -- repairs ---------------------------------------------------------------------------
    def complete_from(self, dsn: str, batch: Batch) -> KafkaTopicSink:
        return self.external(dsn)

    @property
    def live_topic(self) -> str | None:
        return self.kafka.topic
