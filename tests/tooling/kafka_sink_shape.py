"""What the Kafka sink's stage query (`parts_select_sql`) and the task's record builder
(`offsetflow.sinks.kafka.values`) read of a `KafkaSinkConfig`, settable field by field, for
tests that compare the two paths over many sink shapes without a whole pipeline config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KafkaSinkShape:
    value_format: str = "json"
    value_columns: tuple[str, ...] = ()
    key_column: str | None = None
    value_column: str = "value"
    headers: str = "carry"
    task_files_mode: int = 0o640
