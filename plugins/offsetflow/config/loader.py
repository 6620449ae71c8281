"""Pipeline configs (`include/pipelines/<name>.yaml`), validated on load.

Every error names the file and the dotted field, so a broken config is fixed in one go.
The model is in `config.schema`, parsing and its errors in `config.parse` (on
`config.fields`' field reader); this module reads files and finds pipelines. Callers import
from the package's face, `offsetflow.config`.
`${VAR}` / `${VAR:-default}` are resolved from the environment so secrets stay out of
the YAML; `PipelineConfig.redacted()` is what may be logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from offsetflow.config.parse import parse_pipeline
from offsetflow.config.schema import (
    NAME_RE,
    PipelineConfig,
)
from offsetflow.errors import ConfigError


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
                or Path(__file__).resolve().parents[3] / "include" / "pipelines")


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
