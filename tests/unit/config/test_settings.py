"""The [offsetflow] deployment settings: OFFSETFLOW_* variables first, then Airflow's option
(AIRFLOW__OFFSETFLOW__*), then defaults relative to Airflow's dags_folder; a missing folder
is an error naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from offsetflow.config import (
    SETTINGS,
    gx_root,
    pipeline_dags_folder,
    pipelines_dir,
    provider_config,
    spark_conn_id,
)
from offsetflow.errors import SettingError

VARS = ("OFFSETFLOW_PIPELINES_DIR", "OFFSETFLOW_GX_ROOT", "OFFSETFLOW_SPARK_CONN_ID",
        "AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER", "AIRFLOW__OFFSETFLOW__GX_ROOT",
        "AIRFLOW__OFFSETFLOW__SPARK_CONN_ID", "AIRFLOW__OFFSETFLOW__PIPELINE_DAGS_FOLDER")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An Astronomer-style project: dags/ beside include/pipelines/."""
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    (tmp_path / "dags").mkdir()
    (tmp_path / "include" / "pipelines").mkdir(parents=True)
    monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(tmp_path / "dags"))
    return tmp_path


def test_defaults_are_relative_to_airflows_dags_folder(project: Path) -> None:
    assert pipelines_dir() == project / "include" / "pipelines"
    assert gx_root() == project / "include"
    assert pipeline_dags_folder() == project / "dags" / "pipelines"
    assert spark_conn_id() == "spark_default"


def test_airflow_options_and_the_older_variables(project: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    other = project / "elsewhere"
    other.mkdir()
    monkeypatch.setenv("AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER", str(other))
    monkeypatch.setenv("AIRFLOW__OFFSETFLOW__SPARK_CONN_ID", "spark_cluster")
    assert pipelines_dir() == other
    assert spark_conn_id() == "spark_cluster"
    monkeypatch.setenv("OFFSETFLOW_PIPELINES_DIR", str(project / "include" / "pipelines"))
    assert pipelines_dir() == project / "include" / "pipelines"  # the older variable wins
    # Airflow hands back a declared default as written: {dags_folder} is still resolved
    monkeypatch.delenv("OFFSETFLOW_PIPELINES_DIR")
    monkeypatch.setenv("AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER", "{dags_folder}/../include")
    assert pipelines_dir() == project / "include"


def test_a_missing_folder_names_the_option_and_how_to_set_it(
        project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER", str(project / "nope"))
    with pytest.raises(SettingError) as e:
        pipelines_dir()
    msg = str(e.value)
    assert "[offsetflow] pipelines_folder" in msg and "AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER" in msg
    assert "OFFSETFLOW_PIPELINES_DIR" in msg and str(project / "nope") in msg
    # the DAG files' folder may be made, but only inside an existing folder
    monkeypatch.setenv("AIRFLOW__OFFSETFLOW__PIPELINE_DAGS_FOLDER", str(project / "x" / "y"))
    with pytest.raises(SettingError, match=r"\[offsetflow\] pipeline_dags_folder"):
        pipeline_dags_folder()


def test_the_provider_declares_every_setting_with_a_description_and_default() -> None:
    section = provider_config()["offsetflow"]
    assert isinstance(section, dict)
    options = section["options"]
    assert set(options) == {s.option for s in SETTINGS}
    for name, opt in options.items():
        assert opt["description"] and opt["default"] and opt["example"], name
        assert opt["type"] == "string" and opt["version_added"]
