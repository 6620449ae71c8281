"""Pipeline configs (`include/pipelines/<name>.yaml`), validated on load.

Every error names the file and the dotted field, so a broken config is fixed in one go.
The model is in config_schema, parsing and its errors in config_parse (on config_fields'
field reader); this module reads files and finds pipelines, and re-exports them so callers
import from one place.
`${VAR}` / `${VAR:-default}` are resolved from the environment so secrets stay out of
the YAML; `PipelineConfig.redacted()` is what may be logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from offsetflow.config_fields import resolve_env, validate_identifier, validate_table_name
from offsetflow.config_parse import parse_pipeline
from offsetflow.config_schema import (
    DECIMAL_RE,
    DEFAULT_MAX_OFFSETS_PER_TASK,
    DOTTED_RE,
    ENV_RE,
    FIELD_TYPES,
    FORBIDDEN_CLIENT_KEYS,
    IDENT_RE,
    ISOLATION_LEVELS,
    NAME_RE,
    RESERVED_COLUMNS,
    SECRET_HINTS,
    TOMBSTONE_POLICIES,
    TOPIC_RE,
    V1_DEFAULT_MAX_OFFSETS_PER_TASK,
    ConfigDrift,
    KafkaConfig,
    PipelineConfig,
    SinkConfig,
    SparkConfig,
    StartingPolicy,
    config_drift,
    connect_address,
    default_tombstones,
    redact_dsn,
    redact_value,
    split_table_name,
)
from offsetflow.errors import ConfigError

__all__ = [
    "DECIMAL_RE", "DEFAULT_MAX_OFFSETS_PER_TASK", "DOTTED_RE", "ENV_RE", "FIELD_TYPES",
    "FORBIDDEN_CLIENT_KEYS", "IDENT_RE", "ISOLATION_LEVELS", "NAME_RE", "RESERVED_COLUMNS",
    "SECRET_HINTS", "TOMBSTONE_POLICIES", "TOPIC_RE", "V1_DEFAULT_MAX_OFFSETS_PER_TASK",
    "ConfigDrift", "KafkaConfig", "PipelineConfig", "SinkConfig", "SparkConfig",
    "StartingPolicy", "config_drift", "connect_address", "default_tombstones",
    "find_pipeline", "load_pipeline", "parse_pipeline", "pipelines_dir", "redact_dsn",
    "redact_value", "resolve_env", "split_table_name", "validate_identifier",
    "validate_table_name",
]


def load_pipeline(path: str | Path, env: Mapping[str, str] | None = None) -> PipelineConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(str(p), "<file>", f"cannot read: {e.strerror}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(str(p), "<yaml>", f"not valid YAML: {e}") from e
    return parse_pipeline(raw, str(p), env)


def pipelines_dir() -> Path:
    return Path(os.environ.get("OFFSETFLOW_PIPELINES_DIR")
                or Path(__file__).resolve().parents[2] / "include" / "pipelines")


def find_pipeline(name: str, directory: Path | None = None) -> PipelineConfig:
    """Load the pipeline called `name` from the pipelines folder (file stem or `name:`)."""
    d = directory or pipelines_dir()
    if not NAME_RE.match(name):
        raise ConfigError(str(d), "pipeline", f"{name!r} is not a valid pipeline name")
    direct = d / f"{name}.yaml"
    if direct.exists():
        return load_pipeline(direct)
    for f in sorted(d.glob("*.y*ml")):
        cfg = load_pipeline(f)
        if cfg.name == name:
            return cfg
    raise ConfigError(str(d), "pipeline", f"no pipeline named {name!r} in {d}")
