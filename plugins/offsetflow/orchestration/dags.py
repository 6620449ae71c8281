"""DAG builders: one scheduled DAG per pipeline, the backfill DAG and the replay DAG.

The DAG files in `dags/` only call these, and these only use the public operators of
`offsetflow.orchestration.operators` (the same ones a user's own DAG uses): plan ->
run batch (spark-submit through the apache-spark provider, so the Airflow Spark connection
decides local mode or a cluster, or a warm Spark Connect server for `spark.launch:
connect`) -> publish (checks the commit, emits the target table's Asset event).
Retries are safe everywhere: a batch's id and ranges are fixed when it is planned.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Param, get_current_context, task

from offsetflow.config import PipelineConfig, load_pipeline, pipelines_dir
from offsetflow.orchestration import assets, tasks
from offsetflow.orchestration.connections import resolve
from offsetflow.orchestration.operators import (
    OffsetFlowPublishOperator,
    OffsetFlowRunBatchOperator,
    due_time,
    offsetflow_pipeline_tasks,
    started_by,
)

START = datetime(2026, 1, 1)
TAGS = ["offsetflow"]


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
        offsetflow_pipeline_tasks(pipeline=cfg.name)
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
        "allow_duplicates": Param(False, type="boolean", title="Allow duplicates",
                                  description="Kafka sink: write the window again into a "
                                              "replay_topic that already holds it"),
        "audit": Param(False, type="boolean", title="Audit before publish",
                       description="Write the window beside the live data (a shadow "
                                   "table, an Iceberg branch); see its diff with "
                                   "`offsetflow audit show BATCH`, then publish or discard "
                                   "it (PostgreSQL and Iceberg sinks, append mode)"),
    }
    if kind == "backfill":
        params["target_table"] = Param(None, type=["null", "string"], title="Target table",
                                       description="Empty: the pipeline's own sink; or a side "
                                                   "table like backfill.orders_2026")
    return params


def window_dag(kind: str) -> DAG:
    from offsetflow.config import find_pipeline

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
            return tasks.window_task(kind, conf, started_by(ctx),
                                     load=lambda name: resolve(find_pipeline(name)),
                                     due=due_time(ctx))

        @task.short_circuit(task_id="has_batches")
        def has_batches(planned: dict[str, Any]) -> bool:
            return bool(planned["batch_ids"])

        pulled = "ti.xcom_pull(task_ids='plan_window')"
        pipeline = f"{{{{ {pulled}['report']['pipeline'] }}}}"
        ids = f"{{{{ {pulled}['batch_ids'] | join(',') }}}}"
        planned = plan_window()
        run = OffsetFlowRunBatchOperator(task_id="run_batches", pipeline=pipeline,
                                         batch_ids=ids)
        done = OffsetFlowPublishOperator(task_id="publish", pipeline=pipeline, batch_ids=ids,
                                         asset_alias=assets.alias_name(kind))
        has_batches(planned) >> run >> done  # type: ignore[arg-type]
    return dag
