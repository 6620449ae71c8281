"""Which `Sink` a pipeline writes through: the one place that looks at the config's sink
kind (`sink.type`). Everything else asks the sink it is given."""

from __future__ import annotations

from collections.abc import Sequence

from offsetflow.commit import CommitSpec, ExternalSink
from offsetflow.config import PipelineConfig
from offsetflow.extras import require
from offsetflow.sinks.base import Sink
from offsetflow.sinks.postgres import PostgresSink


def sink_for(cfg: PipelineConfig) -> Sink:
    """The pipeline's sink. Iceberg's and Kafka's packages are imported only for a
    pipeline that writes there (a PostgreSQL pipeline never loads pyiceberg); pyiceberg is
    the `iceberg` extra, so its absence is a MissingExtraError here, before anything is
    planned or read (the sink's own imports of it are inside its functions)."""
    if cfg.sink.kafka is not None:
        from offsetflow.sinks.kafka import KafkaPipelineSink

        return KafkaPipelineSink(cfg)
    if cfg.sink.iceberg is not None:
        require("iceberg", f"{cfg.source_file}: sink.type: iceberg (pipeline {cfg.name})")
        from offsetflow.sinks.iceberg import IcebergPipelineSink

        return IcebergPipelineSink(cfg)
    return PostgresSink(cfg)


def external_sink(cfg: PipelineConfig, dsn: str,
                  columns: Sequence[tuple[str, str]] | None = None,
                  spec: CommitSpec | None = None) -> ExternalSink | None:
    """`sink_for(cfg).external(...)`: the pipeline's external sink for one commit attempt
    (`dsn`: the ledger's), None for the PostgreSQL sink, whose step 4 runs in the ledger's
    own transaction. Without `columns` (a check made before anything is read:
    `commit.sink_holds`) the row shape is not checked and nothing can be written."""
    return sink_for(cfg).external(dsn, columns, spec)


def task_data_files(cfg: PipelineConfig) -> bool:
    """`sink_for(cfg).tasks_write_files`: whether the Spark tasks write the batch's rows as
    the sink's data files themselves (`offsetflow.sinks.iceberg.tasks`), so the driver
    commits files it never reads: an Iceberg append without a transform or a quality
    suite."""
    return sink_for(cfg).tasks_write_files
