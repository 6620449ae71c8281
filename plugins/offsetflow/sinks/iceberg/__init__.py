"""Apache Iceberg as a sink: one snapshot per batch carrying the batch id, committed inside
the ledger transaction; task-side data files, upsert by key, and table upkeep.
"""

from __future__ import annotations

from offsetflow.sinks.iceberg.maint import (
    refuse_rows_beyond,
    sweep_after_retry,
    sweep_batch_orphans,
)
from offsetflow.sinks.iceberg.pipeline import IcebergPipelineSink
from offsetflow.sinks.iceberg.sink import IcebergSink
from offsetflow.sinks.iceberg.tasks import TaskFiles

__all__ = [
    "IcebergPipelineSink",
    "IcebergSink",
    "TaskFiles",
    "refuse_rows_beyond",
    "sweep_after_retry",
    "sweep_batch_orphans",
]
