"""A Kafka topic as a sink: one producer transaction per batch with the source offsets,
fenced by producer epoch; what a staged row becomes as a record, and the marks a batch
leaves in the topic's group.
"""

from __future__ import annotations

from offsetflow.sinks.kafka.mark import output_topic, replay_target
from offsetflow.sinks.kafka.pipeline import KafkaPipelineSink
from offsetflow.sinks.kafka.sink import KafkaTopicSink

__all__ = [
    "KafkaPipelineSink",
    "KafkaTopicSink",
    "output_topic",
    "replay_target",
]
