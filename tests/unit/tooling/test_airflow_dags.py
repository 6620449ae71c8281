"""Which file `airflow dags test` of a test project parses (tests/tooling/airflow_dags.py)."""

from __future__ import annotations

from pathlib import Path

from tests.tooling.airflow_dags import dag_file


def test_dag_file_finds_window_and_pipeline_dags_else_none(tmp_path: Path) -> None:
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "offsetflow_replay.py").write_text("")
    (tmp_path / "pipelines" / "orders.py").write_text("")
    env = {"AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path)}
    assert dag_file(env, "offsetflow_replay") == tmp_path / "offsetflow_replay.py"
    assert dag_file(env, "offsetflow_orders") == tmp_path / "pipelines" / "orders.py"
    # not there, not an OffsetFlow DAG, no folder: the whole folder is parsed
    assert dag_file(env, "offsetflow_backfill") is None
    assert dag_file(env, "my_dag") is None
    assert dag_file({}, "offsetflow_replay") is None
