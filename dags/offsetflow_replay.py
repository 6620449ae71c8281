"""Airflow DAG: replay of a committed range (UI form, `offsetflow replay`, REST API conf)."""

from offsetflow.orchestration.dags import window_dag

dag = window_dag("replay")
