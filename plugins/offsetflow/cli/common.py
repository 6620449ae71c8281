"""What every `offsetflow` command reads from its arguments: the pipeline and the ledger's
PostgreSQL DSN."""

from __future__ import annotations

import argparse
import os

from offsetflow.config import PipelineConfig, find_pipeline, load_pipeline
from offsetflow.errors import ConfigError


def pipeline_of(args: argparse.Namespace) -> PipelineConfig:
    from offsetflow.orchestration.connections import resolve

    if getattr(args, "pipeline_file", None):
        return resolve(load_pipeline(args.pipeline_file))
    return resolve(find_pipeline(args.pipeline))


def dsn_of(args: argparse.Namespace, cfg: PipelineConfig | None = None) -> str:
    dsn = getattr(args, "dsn", None) or (cfg.sink.connection if cfg else None) \
        or os.environ.get("OFFSETFLOW_PG_DSN")
    if not dsn:
        raise ConfigError("environment", "OFFSETFLOW_PG_DSN",
                          "no PostgreSQL DSN: set OFFSETFLOW_PG_DSN or sink.connection")
    return dsn
