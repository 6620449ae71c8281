"""Pipeline configs (`include/pipelines/<name>.yaml`): parsed, validated on load, and
the model every other package reads. Pure: no I/O beyond reading the file.
"""

from __future__ import annotations

from offsetflow.config.fields import validate_table_name
from offsetflow.config.iceberg_sink import (
    SUMMARY_BATCH,
    SUMMARY_PIPELINE,
    IcebergConfig,
    SortField,
    catalog_properties,
    check_summary_ranges,
    layout_drift,
    resolve_identifier,
    snapshot_summary,
    summary_batch,
)
from offsetflow.config.json_schema import pipeline_json_schema
from offsetflow.config.loader import check_file, find_pipeline, load_pipeline
from offsetflow.config.parse import Checked, check_pipeline, parse_pipeline
from offsetflow.config.schema import (
    DECIMAL_RE,
    FORBIDDEN_CLIENT_KEYS,
    IDENT_RE,
    NAME_RE,
    RESERVED_COLUMNS,
    TOPIC_RE,
    TYPED_FORMATS,
    KafkaConfig,
    KafkaSinkConfig,
    PipelineConfig,
    StartingPolicy,
    config_drift,
    connect_address,
    redact_dsn,
    redact_value,
    split_table_name,
)
from offsetflow.config.settings import (
    SETTINGS,
    Setting,
    airflow_conf,
    gx_root,
    pipeline_dags_folder,
    pipelines_dir,
    provider_config,
    spark_conn_id,
)

__all__ = [
    "Checked",
    "DECIMAL_RE",
    "FORBIDDEN_CLIENT_KEYS",
    "IDENT_RE",
    "IcebergConfig",
    "KafkaConfig",
    "KafkaSinkConfig",
    "NAME_RE",
    "PipelineConfig",
    "RESERVED_COLUMNS",
    "SETTINGS",
    "SUMMARY_BATCH",
    "SUMMARY_PIPELINE",
    "Setting",
    "SortField",
    "StartingPolicy",
    "TOPIC_RE",
    "TYPED_FORMATS",
    "airflow_conf",
    "catalog_properties",
    "check_file",
    "check_pipeline",
    "check_summary_ranges",
    "config_drift",
    "connect_address",
    "find_pipeline",
    "gx_root",
    "layout_drift",
    "load_pipeline",
    "parse_pipeline",
    "pipeline_dags_folder",
    "pipeline_json_schema",
    "pipelines_dir",
    "provider_config",
    "redact_dsn",
    "redact_value",
    "resolve_identifier",
    "snapshot_summary",
    "spark_conn_id",
    "split_table_name",
    "summary_batch",
    "validate_table_name",
]
