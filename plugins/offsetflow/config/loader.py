"""Pipeline configs (`include/pipelines/<name>.yaml`), validated on load.

Every error names the file and the dotted field, so a broken config is fixed in one go.
The model is in `config.schema`, parsing and its errors in `config.parse` (on
`config.fields`' field reader); this module reads files and finds pipelines. Callers import
from the package's face, `offsetflow.config`.
`${VAR}` / `${VAR:-default}` are resolved from the environment so secrets stay out of
the YAML; `PipelineConfig.redacted()` is what may be logged.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from offsetflow.config.document import compose, locate
from offsetflow.config.parse import Checked, check_pipeline
from offsetflow.config.schema import (
    NAME_RE,
    PipelineConfig,
)
from offsetflow.config.settings import pipelines_dir
from offsetflow.errors import ConfigError


def load_pipeline(path: str | Path, env: Mapping[str, str] | None = None) -> PipelineConfig:
    """The pipeline of a file; one ConfigError carrying every error of it (each with its
    line and column) when it is invalid."""
    checked = check_file(path, env)
    if checked.config is None:
        raise ConfigError.of(checked.errors)
    return checked.config


def check_file(path: str | Path, env: Mapping[str, str] | None = None, strict_env: bool = True,
               duplicate_keys: bool = False) -> Checked:
    """Every error (and warning) of a pipeline file, each with its line and column in the
    YAML. `strict_env=False`: an unset `${VAR}` is a warning (`check_pipeline`);
    `duplicate_keys`: a key written twice is an error (loading to run tolerates it, as YAML
    does: the last one wins)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        return Checked(None, (ConfigError(str(p), "<file>", f"cannot read: {e.strerror}"),), ())
    except UnicodeDecodeError as e:
        return Checked(None, (ConfigError(str(p), "<file>", f"cannot read: not UTF-8 text "
                                                            f"({e.reason})"),), ())
    try:
        doc = compose(text, str(p))
    except ConfigError as e:
        return Checked(None, (e,), ())
    checked = check_pipeline(doc.data, str(p), env, strict_env)
    errors = (*doc.duplicates, *checked.errors) if duplicate_keys else checked.errors
    for found in (*errors, *checked.warnings):
        locate(found, doc.root)
    return Checked(None if errors else checked.config, errors, checked.warnings)


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
