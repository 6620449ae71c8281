"""Where a batch's rows go: the sink a pipeline's commit writes through (PostgreSQL,
Apache Iceberg, a Kafka topic), all behind one interface.
"""

from __future__ import annotations

from offsetflow.sinks.registry import external_sink, task_data_files

__all__ = [
    "external_sink",
    "task_data_files",
]
