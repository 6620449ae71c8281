"""DAG integrity: every DAG file imports, every pipeline has its DAG, and a broken config
is an import error of its own file that names the file and field."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def dagbag(folder: Path):  # noqa: ANN201
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(folder))


def test_project_dags_import_cleanly_and_each_pipeline_has_its_dag() -> None:
    bag = dagbag(ROOT / "dags")
    assert bag.import_errors == {}
    names = sorted(p.stem for p in (ROOT / "include" / "pipelines").glob("*.yaml"))
    assert names
    for name in names:
        dag = bag.dags.get(f"offsetflow_{name}")
        assert dag is not None, f"pipeline {name} has no DAG; run `offsetflow dags sync`"
        assert dag.max_active_runs == 1
        assert {t.task_id for t in dag.tasks} == {"plan", "has_batch", "run_batch", "publish"}
        run = dag.get_task("run_batch")
        assert type(run).__name__ == "OffsetFlowRunBatchOperator"
        assert "SparkSubmitOperator" in {c.__name__ for c in type(run).__mro__}
        assert "application_args" in run.template_fields
    for example in ("orders_to_warehouse", "orders_report"):  # dags/examples: manual, paused
        dag = bag.dags[example]
        assert dag.is_paused_upon_creation
        assert type(dag.timetable).__name__ in ("NullTimetable", "AssetTriggeredTimetable")
    for window in ("offsetflow_backfill", "offsetflow_replay"):
        dag = bag.dags[window]
        assert dag.schedule is None if hasattr(dag, "schedule") else True
        assert {"pipeline", "from_offset", "until_offset", "dry_run"} <= set(dag.params.keys())


def test_broken_config_is_an_import_error_of_its_own_file(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    pipelines = tmp_path / "pipelines"
    dags = tmp_path / "dags"
    pipelines.mkdir()
    (dags / "pipelines").mkdir(parents=True)
    good = yaml.safe_load((ROOT / "include/pipelines/orders.yaml").read_text())
    (pipelines / "good.yaml").write_text(yaml.safe_dump({**good, "name": "good"}))
    broken = {**good, "name": "broken", "sink": {"table": "orders", "mode": "upsert"}}
    (pipelines / "broken.yaml").write_text(yaml.safe_dump(broken))
    monkeypatch.setenv("OFFSETFLOW_PIPELINES_DIR", str(pipelines))
    from offsetflow.cli import main

    assert main(["dags", "sync", "--dags-dir", str(dags / "pipelines")]) == 0
    assert {p.name for p in (dags / "pipelines").iterdir()} == {"good.py", "broken.py"}
    shutil.copy(ROOT / "dags" / "offsetflow_replay.py", dags)
    bag = dagbag(dags)
    assert "offsetflow_good" in bag.dag_ids and "offsetflow_replay" in bag.dag_ids
    assert list(bag.import_errors) == [os.path.join(str(dags), "pipelines", "broken.py")]
    err = next(iter(bag.import_errors.values()))
    assert "broken.yaml: sink.key: upsert mode needs a key" in err
