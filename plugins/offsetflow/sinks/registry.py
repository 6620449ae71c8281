"""Which `ExternalSink` a pipeline's commit writes through: None for the PostgreSQL sink,
whose step 4 runs in the ledger's own transaction."""

from __future__ import annotations

from collections.abc import Sequence

from offsetflow.commit import CommitSpec, ExternalSink
from offsetflow.config import PipelineConfig


def external_sink(cfg: PipelineConfig, dsn: str,
                  columns: Sequence[tuple[str, str]] | None = None,
                  spec: CommitSpec | None = None) -> ExternalSink | None:
    """The pipeline's external sink for one commit attempt (`dsn`: the ledger's). Without
    `columns` (a check made before anything is read: `commit.sink_holds`) the row shape is
    not checked and nothing can be written."""
    spec = spec or CommitSpec(columns=())
    if cfg.sink.kafka is not None:
        from offsetflow.sinks.kafka import KafkaTopicSink

        return KafkaTopicSink(cfg, columns, spec)
    if cfg.sink.iceberg is not None:
        from offsetflow.sinks.iceberg import IcebergSink

        return IcebergSink(cfg.sink.iceberg, cfg.sink.connection or dsn, spec,
                           tuple(columns or ()), cfg.sink.table)
    return None


def task_data_files(cfg: PipelineConfig) -> bool:
    """Whether the Spark tasks write the batch's rows as the sink's data files themselves
    (`offsetflow.sinks.iceberg.tasks`), so the driver commits files it never reads: an
    Iceberg append without a transform or a quality suite. Those two (and `mode: upsert`)
    read the batch's rows from the PostgreSQL stage, so they stage there as before."""
    return (cfg.sink.iceberg is not None and cfg.sink.mode == "append"
            and not cfg.transform and not cfg.quality_suite)
