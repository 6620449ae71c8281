"""DAG builders: one scheduled DAG per pipeline, the backfill DAG and the replay DAG.

The DAG files in `dags/` only call these. Tasks are thin: planning and checks call
`offsetflow.orchestration.tasks`; the Spark job is started by the apache-spark provider's
SparkSubmitOperator, so the Airflow Spark connection decides local mode or a cluster, or,
for a pipeline with `spark.launch: connect`, runs in the task on a warm Spark Connect server.
Retries are safe everywhere: a batch's id and ranges are fixed when it is planned.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import DAG, Param, get_current_context, task

from offsetflow.config import PipelineConfig, load_pipeline, pipelines_dir
from offsetflow.orchestration import tasks
from offsetflow.spark_app import application_path
from offsetflow.submit_args import submit_conf

# inside the package, so an installed OffsetFlow (wheel) finds it too
SPARK_JOB = application_path()
SPARK_CONN_ID = os.environ.get("OFFSETFLOW_SPARK_CONN_ID", "spark_default")
START = datetime(2026, 1, 1)
TAGS = ["offsetflow"]


def _started_by() -> str:
    ctx = get_current_context()
    run = ctx.get("dag_run")
    return f"airflow:{ctx['dag'].dag_id}:{getattr(run, 'run_id', '?')}"


def _spark_env() -> dict[str, str]:
    """Non-secret environment for spark-submit: the venv first on PATH (spark-submit needs
    it) and where pipelines live. Secrets (DSNs, passwords) are not put here: the hook
    may turn env_vars into Spark conf on a cluster. In local/client mode the job inherits
    the worker's environment; on a cluster provide them with Spark's secret mechanisms."""
    keep = ("PATH", "JAVA_HOME", "PYSPARK_PYTHON", "OFFSETFLOW_PIPELINES_DIR", "SPARK_HOME")
    return {k: os.environ[k] for k in keep if k in os.environ}


def spark_submit(task_id: str, pipeline_file: str, batch_ids_template: str,
                 cfg: PipelineConfig | None = None) -> SparkSubmitOperator:
    return SparkSubmitOperator(
        task_id=task_id,
        application=SPARK_JOB,
        conn_id=SPARK_CONN_ID,
        name=f"offsetflow-{cfg.name if cfg else 'window'}",
        application_args=["--pipeline-file", pipeline_file, "--batch-id", batch_ids_template],
        # a shipped environment (spark.archives) keeps a client-mode driver on this Python
        conf=submit_conf(cfg.spark.conf, sys.executable) if cfg else {},
        env_vars=_spark_env(),
        spark_binary="spark-submit",
    )


def pipeline_dag(cfg: PipelineConfig) -> DAG:
    default_args: dict[str, Any] = {"retries": cfg.retries, "retry_delay": timedelta(seconds=30)}
    if cfg.pool:
        default_args["pool"] = cfg.pool
    with DAG(
        dag_id=f"offsetflow_{cfg.name}",
        description=cfg.description or f"OffsetFlow micro-batches of pipeline {cfg.name}",
        schedule=cfg.schedule,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        default_args=default_args,
        tags=[*TAGS, "scheduled"],
        doc_md=f"Plans a batch of `{cfg.source_file}`, reads it with Spark, commits it "
               f"exactly once. Empty batches skip the Spark job.",
    ) as dag:
        name = cfg.name

        @task(task_id="plan")
        def plan() -> int | None:
            return tasks.plan_task(name, _started_by())

        @task.short_circuit(task_id="has_batch")
        def has_batch(batch_id: int | None) -> bool:
            return batch_id is not None

        @task(task_id="publish")
        def publish(batch_id: int) -> dict[str, Any]:
            return tasks.publish_task(name, batch_id)

        batch_id = plan()
        if cfg.spark.launch == "connect":
            @task(task_id="run_batch")
            def run_connect(batch_id: int) -> list[str]:
                return tasks.connect_run_task(name, batch_id)

            run: Any = run_connect(batch_id)  # type: ignore[arg-type]
        else:
            run = spark_submit("run_batch", cfg.source_file,
                               "{{ ti.xcom_pull(task_ids='plan') }}", cfg)
        has_batch(batch_id) >> run >> publish(batch_id)  # type: ignore[arg-type]
    return dag


def pipeline_dag_for_file(dag_file: str) -> DAG:
    """Build the DAG of the pipeline whose YAML has the DAG file's name; a broken config
    raises its ConfigError here, so Airflow shows it as this file's import error."""
    name = Path(dag_file).stem
    return pipeline_dag(load_pipeline(pipelines_dir() / f"{name}.yaml"))


def _pipeline_names() -> list[str]:
    return sorted(p.stem for p in pipelines_dir().glob("*.yaml"))


def _window_params(kind: str) -> dict[str, Param]:
    names = _pipeline_names()
    params: dict[str, Param] = {
        # `examples` (not `enum`): a pipeline added after the DAG was parsed is still
        # accepted; plan_window refuses unknown names with a clear message
        "pipeline": Param(names[0] if names else "", type="string", examples=names,
                          minLength=1, title="Pipeline",
                          description="Pipeline from include/pipelines"),
        "topic": Param(None, type=["null", "string"], title="Topic",
                       description="Needed only when the pipeline reads several topics"),
        "partitions": Param(None, type=["null", "string"], title="Partitions",
                            description="Comma-separated partition numbers; empty = all"),
        "from_offset": Param(None, type=["null", "integer"], minimum=0, title="From offset",
                             description="Inclusive; same for every chosen partition"),
        "until_offset": Param(None, type=["null", "integer"], minimum=0, title="Until offset",
                              description="Exclusive"),
        "from_offsets": Param(None, type=["null", "object"], title="From offsets per partition",
                              description='JSON like {"0": 100, "1": 250}'),
        "until_offsets": Param(None, type=["null", "object"], title="Until offsets per partition"),
        "from_timestamp": Param(None, type=["null", "string"], title="From time",
                                description="ISO-8601 with zone, instead of offsets"),
        "until_timestamp": Param(None, type=["null", "string"], title="Until time"),
        "records_per_batch": Param(100_000, type="integer", minimum=1,
                                   title="Offsets per batch"),
        "dry_run": Param(False, type="boolean", title="Dry run",
                         description="Only report the ranges and what is gone from Kafka"),
    }
    if kind == "backfill":
        params["target_table"] = Param(None, type=["null", "string"], title="Target table",
                                       description="Empty: the pipeline's own sink; or a side "
                                                   "table like backfill.orders_2026")
    return params


def window_dag(kind: str) -> DAG:
    """The manual backfill or replay DAG: form -> checks -> ordinary batches -> Spark."""
    with DAG(
        dag_id=f"offsetflow_{kind}",
        description=f"OffsetFlow {kind}: a window of offsets as ordinary ledger batches",
        schedule=None,
        start_date=START,
        catchup=False,
        max_active_runs=1,
        params=_window_params(kind),
        tags=[*TAGS, kind],
        render_template_as_native_obj=False,
        doc_md=(f"Cuts the window into batches of kind `{kind}` and runs them in order. Never "
                f"moves the pipeline's live position; rows the window produced before are "
                f"replaced, not duplicated."),
    ) as dag:

        @task(task_id="plan_window", retries=0)
        def plan_window() -> dict[str, Any]:
            ctx = get_current_context()
            conf = dict(ctx["params"])
            run = ctx.get("dag_run")
            run_conf = getattr(run, "conf", None) if run is not None else None
            if run_conf:
                conf.update(dict(run_conf))
            return tasks.window_task(kind, conf, _started_by())

        @task.short_circuit(task_id="has_batches")
        def has_batches(planned: dict[str, Any]) -> bool:
            return bool(planned["batch_ids"])

        @task.branch(task_id="choose_launch")
        def choose_launch(planned: dict[str, Any]) -> str:
            from offsetflow.config import find_pipeline

            cfg = find_pipeline(planned["report"]["pipeline"])
            return "run_batches_connect" if cfg.spark.launch == "connect" else "pipeline_file"

        @task(task_id="pipeline_file")
        def pipeline_file(planned: dict[str, Any]) -> str:
            from offsetflow.config import find_pipeline

            return find_pipeline(planned["report"]["pipeline"]).source_file

        @task(task_id="run_batches_connect")
        def run_connect(planned: dict[str, Any]) -> list[str]:
            return tasks.connect_run_task(planned["report"]["pipeline"], planned["batch_ids"])

        # runs after whichever launch ran; a failed run still fails the DAG run
        @task(task_id="publish", trigger_rule="none_failed_min_one_success")
        def publish(planned: dict[str, Any]) -> dict[str, Any]:
            return tasks.publish_task(planned["report"]["pipeline"], planned["batch_ids"])

        planned = plan_window()
        branch = choose_launch(planned)  # type: ignore[arg-type]
        pf = pipeline_file(planned)  # type: ignore[arg-type]
        run = spark_submit("run_batches", "{{ ti.xcom_pull(task_ids='pipeline_file') }}",
                           "{{ ti.xcom_pull(task_ids='plan_window')['batch_ids'] | join(',') }}")
        done = publish(planned)  # type: ignore[arg-type]
        has_batches(planned) >> branch  # type: ignore[arg-type]
        branch >> pf >> run >> done
        branch >> run_connect(planned) >> done  # type: ignore[arg-type]
    return dag
