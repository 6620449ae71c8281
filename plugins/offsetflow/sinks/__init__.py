"""Where a batch's rows go: the sink a pipeline's commit writes through (PostgreSQL,
Apache Iceberg, a Kafka topic), all behind one interface (`Sink`, chosen by `sink_for`).
"""

from __future__ import annotations

from offsetflow.sinks.base import Sink
from offsetflow.sinks.postgres import PostgresSink
from offsetflow.sinks.registry import external_sink, sink_for, task_data_files

__all__ = [
    "PostgresSink",
    "Sink",
    "external_sink",
    "sink_for",
    "task_data_files",
]
