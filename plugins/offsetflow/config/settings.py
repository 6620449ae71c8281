"""Deployment settings, the Airflow way: an `[offsetflow]` section the provider declares
(`orchestration.provider_info`: `airflow config list` shows it), set in airflow.cfg, as
`AIRFLOW__OFFSETFLOW__<OPTION>` or in a Helm chart's `config:`. The older `OFFSETFLOW_*`
environment variables still win where they existed. Folders default relative to Airflow's
`[core] dags_folder` (an Astronomer-style project: `dags/` beside `include/`), never inside
the installed package; a folder that is missing is an error naming the option.

Airflow is imported only when neither variable gives the answer, so `offsetflow validate`
and the Spark tasks never load it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from offsetflow.errors import SettingError

SECTION = "offsetflow"


@dataclass(frozen=True)
class Setting:
    option: str
    description: str
    default: str  # shown in `airflow config list`; `{dags_folder}` is Airflow's
    example: str
    legacy_env: str | None = None  # an OFFSETFLOW_* variable that takes precedence

    @property
    def airflow_env(self) -> str:
        return f"AIRFLOW__{SECTION.upper()}__{self.option.upper()}"

    @property
    def where(self) -> str:
        """How a user names this setting in an error message."""
        legacy = f" or {self.legacy_env}" if self.legacy_env else ""
        return f"[{SECTION}] {self.option} (airflow.cfg, {self.airflow_env}{legacy})"


PIPELINES_FOLDER = Setting(
    "pipelines_folder", "The folder of pipeline YAML files (one file per pipeline).",
    "{dags_folder}/../include/pipelines", "/opt/airflow/include/pipelines",
    "OFFSETFLOW_PIPELINES_DIR")
PIPELINE_DAGS_FOLDER = Setting(
    "pipeline_dags_folder", "Where `offsetflow dags sync` writes one thin DAG file per "
    "pipeline; inside the dags_folder, so Airflow parses them.",
    "{dags_folder}/pipelines", "/opt/airflow/dags/pipelines")
GX_ROOT = Setting(
    "gx_root", "The folder holding the Great Expectations project (`gx/`) of the "
    "pipelines' quality suites.", "{dags_folder}/../include", "/opt/airflow/include",
    "OFFSETFLOW_GX_ROOT")
SPARK_CONN_ID = Setting(
    "spark_conn_id", "The Spark connection the operators submit batch jobs with.",
    "spark_default", "spark_cluster", "OFFSETFLOW_SPARK_CONN_ID")

SETTINGS = (PIPELINES_FOLDER, PIPELINE_DAGS_FOLDER, GX_ROOT, SPARK_CONN_ID)


def airflow_conf(section: str, option: str) -> str | None:
    """An Airflow option, from its environment variable or (importing Airflow) airflow.cfg."""
    env = os.environ.get(f"AIRFLOW__{section.upper()}__{option.upper()}")
    if env:
        return env
    try:
        from airflow.configuration import conf
    except ImportError:  # OffsetFlow's Spark side runs without Airflow
        return None
    value = conf.get(section, option, fallback=None)
    return str(value) if value else None


def dags_folder() -> Path:
    """Airflow's `[core] dags_folder` (Airflow's own default: $AIRFLOW_HOME/dags)."""
    value = airflow_conf("core", "dags_folder")
    if value:
        return Path(os.path.expanduser(value))
    home = os.environ.get("AIRFLOW_HOME") or "~/airflow"
    return Path(os.path.expanduser(home)) / "dags"


def value_of(setting: Setting) -> str:
    """The setting's value: its OFFSETFLOW_* variable, the [offsetflow] option, the default."""
    if setting.legacy_env and os.environ.get(setting.legacy_env):
        return os.environ[setting.legacy_env]
    value = airflow_conf(SECTION, setting.option) or setting.default
    # Airflow hands back the declared default as written once it loaded the provider's config
    if "{dags_folder}" in value:
        return value.replace("{dags_folder}", str(dags_folder()))
    return value


def folder(setting: Setting) -> Path:
    """A folder setting, resolved; a missing folder is an error naming the option."""
    path = Path(os.path.normpath(os.path.expanduser(value_of(setting))))
    if not path.is_dir():
        raise SettingError(f"{setting.where} is {path}, which is not a folder; create it, "
                           f"or set the option to where it is")
    return path


def pipelines_dir() -> Path:
    return folder(PIPELINES_FOLDER)


def gx_root() -> Path:
    return folder(GX_ROOT)


def spark_conn_id() -> str:
    return value_of(SPARK_CONN_ID)


def pipeline_dags_folder() -> Path:
    """Where pipeline DAG files go: made if missing, but only inside an existing folder (a
    typo must not create a tree Airflow never reads)."""
    path = Path(os.path.normpath(os.path.expanduser(value_of(PIPELINE_DAGS_FOLDER))))
    if not path.is_dir() and not path.parent.is_dir():
        raise SettingError(f"{PIPELINE_DAGS_FOLDER.where} is {path}, and its parent "
                           f"{path.parent} is not a folder either (is Airflow's [core] "
                           f"dags_folder right?)")
    return path


def provider_config() -> dict[str, object]:
    """The `config` section of `get_provider_info()`: what `airflow config list` shows."""
    return {SECTION: {
        "description": "OffsetFlow: where pipelines live and how batch jobs are submitted.",
        "options": {s.option: {
            "description": s.description + (f" {s.legacy_env}, when set, takes precedence."
                                            if s.legacy_env else ""),
            "version_added": "0.1.0", "type": "string", "example": s.example,
            "default": s.default} for s in SETTINGS}}}
