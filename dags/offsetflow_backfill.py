"""Airflow DAG: manual backfill from the UI (Params form) or with a run conf."""

from offsetflow.orchestration.dags import window_dag

dag = window_dag("backfill")
