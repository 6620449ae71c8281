"""Airflow DAG (scheduled) of include/pipelines/orders.yaml. One thin file per pipeline,
so a broken config shows up as this file's import error and hides no other pipeline's DAG.
Create one for a new pipeline with `offsetflow dags sync`."""

from offsetflow.orchestration.dags import pipeline_dag_for_file

dag = pipeline_dag_for_file(__file__)
