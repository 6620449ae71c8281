"""OffsetFlow operators for your own DAGs: plan -> run batch -> publish.

    from offsetflow.orchestration.operators import offsetflow_pipeline_tasks

    with DAG("my_dag", schedule="*/5 * * * *", ...):
        offsetflow_pipeline_tasks(pipeline="orders")

Each operator takes a pipeline name (include/pipelines) or an inline `config` mapping, and
optional connection ids overriding the config's. The YAML-generated, backfill and replay
DAGs are built from these same operators. The work itself is in
`offsetflow.orchestration.tasks` (no Airflow there).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.providers.standard.operators.python import ShortCircuitOperator
from airflow.sdk import Asset, AssetAlias, BaseOperator, TaskGroup
from airflow.sdk.exceptions import AirflowSkipException

from offsetflow.config import PipelineConfig
from offsetflow.config import spark_conn_id as config_spark_conn_id
from offsetflow.errors import BatchStateError, RequestError
from offsetflow.job import submit_conf
from offsetflow.ledger import Due
from offsetflow.orchestration import assets, connections, tasks
from offsetflow.orchestration.hooks import OffsetFlowHook

# the Spark application file the operators submit, inside the package, so an installed
# OffsetFlow (wheel) finds it too (`offsetflow/spark_app/run_batch.py`)
SPARK_JOB = str(Path(__file__).resolve().parents[1] / "spark_app" / "run_batch.py")
PIPELINE_FIELDS = ("pipeline", "config", "postgres_conn_id", "kafka_conn_id")


def started_by(context: Mapping[str, Any]) -> str:
    run = context.get("dag_run")
    return f"airflow:{context['dag'].dag_id}:{getattr(run, 'run_id', '?')}"


def due_time(context: Mapping[str, Any]) -> Due:
    """When the batch a task plans is due (its scheduling delay runs from here): a scheduled
    run's data interval end (its logical date, run_after as fallbacks); for a run someone or
    something triggered (manual, asset, another DAG: the backfill and replay DAGs' runs) the
    trigger's time (run_after); for a run of Airflow's own backfill, which walks past
    intervals, when the run started. No run (a test's context): the plan's own time."""
    run = context.get("dag_run")
    if run is None:
        return Due(None, "plan")
    kind = str(getattr(getattr(run, "run_type", None), "value", getattr(run, "run_type", "")))
    order: tuple[str, ...]
    if kind == "scheduled":
        order = ("data_interval_end", "logical_date", "run_after")
        source = "schedule"
    elif kind == "backfill":
        order = ("start_date", "run_after")
        source = "trigger"
    else:
        order = ("run_after", "start_date", "logical_date")
        source = "trigger"
    for name in order:
        at = getattr(run, name, None)
        if isinstance(at, datetime):
            return Due(at if at.tzinfo else at.replace(tzinfo=UTC), source)
    return Due(None, "plan")


def batch_id_list(value: Any) -> list[int]:
    """Batch ids from XCom or a rendered template: 7, "7", [7, 8], "[7, 8]", "7,8"; None,
    "None" and "" mean no batch (nothing new to read)."""
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, str):
        text = value.strip()
        if text in ("", "None", "null", "[]"):
            return []
        if text.startswith("["):
            value = json.loads(text)
        else:
            value = [p for p in text.split(",") if p.strip()]
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise RequestError(f"not batch ids: {value!r}") from None


class _PipelineOperator(BaseOperator):
    """Shared: which pipeline, and connections overriding its config's."""

    def __init__(self, *, pipeline: str | None = None, config: Mapping[str, Any] | None = None,
                 postgres_conn_id: str | None = None, kafka_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.config = dict(config) if config is not None else None
        self.postgres_conn_id = postgres_conn_id
        self.kafka_conn_id = kafka_conn_id

    @property
    def hook(self) -> OffsetFlowHook:
        return OffsetFlowHook(pipeline=self.pipeline, config=self.config,
                              postgres_conn_id=self.postgres_conn_id,
                              kafka_conn_id=self.kafka_conn_id)


class OffsetFlowPlanOperator(_PipelineOperator):
    """Plan the pipeline's next batch (or re-use its open one); returns its id, or None when
    there is nothing new to read. Safe to retry: the batch's ranges are fixed here."""

    template_fields: Sequence[str] = PIPELINE_FIELDS
    ui_color = "#e8f4fa"

    def execute(self, context: Any) -> int | None:
        return tasks.plan_task(self.hook.pipeline_config, started_by(context),
                               due_time(context))


class OffsetFlowRunBatchOperator(SparkSubmitOperator):
    """Read, stage and commit planned batches with Spark: spark-submit (the Spark connection
    decides local or cluster; client mode) or, with `spark.launch: connect`, in this task on
    the warm Spark Connect server. Skips when `batch_ids` is empty.

    Credentials from Airflow connections reach the driver in an environment variable of the
    spark-submit process only (see offsetflow.orchestration.connections)."""

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, *PIPELINE_FIELDS,
                                      "batch_ids", "launch")
    ui_color = "#fdf2e0"

    def __init__(self, *, pipeline: str | None = None, config: Mapping[str, Any] | None = None,
                 batch_ids: Any = "{{ ti.xcom_pull(task_ids='plan') }}",
                 launch: str | None = None, postgres_conn_id: str | None = None,
                 kafka_conn_id: str | None = None, spark_conn_id: str | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("application", str(SPARK_JOB))
        kwargs.setdefault("spark_binary", "spark-submit")
        # [offsetflow] spark_conn_id unless the DAG names one
        super().__init__(conn_id=spark_conn_id or config_spark_conn_id(), **kwargs)
        self.pipeline = pipeline
        self.config = dict(config) if config is not None else None
        self.batch_ids = batch_ids
        self.launch = launch
        self.postgres_conn_id = postgres_conn_id
        self.kafka_conn_id = kafka_conn_id

    def execute(self, context: Any) -> Any:
        ids = batch_id_list(self.batch_ids)
        hook = OffsetFlowHook(pipeline=self.pipeline, config=self.config,
                              postgres_conn_id=self.postgres_conn_id,
                              kafka_conn_id=self.kafka_conn_id)
        if not ids:
            _skip_unless_a_batch_is_open(hook, self.batch_ids)
        cfg = hook.pipeline_config
        self._offsetflow_run = (cfg, ids)  # for lineage
        return tasks.observed_run(cfg, ids, lambda: self._execute(cfg, hook, ids, context))

    def _execute(self, cfg: PipelineConfig, hook: OffsetFlowHook, ids: list[int],
                 context: Any) -> Any:
        if (self.launch or cfg.spark.launch) == "connect":
            return tasks.connect_run_task(cfg, ids)
        with _pipeline_file(cfg, self.config) as path:
            self.application_args, self.conf, self.name, self.env_vars = submit_args(
                cfg, path, ids, dict(self.conf or {}))
            with _process_env(connections.handover_env(cfg, hook.get_connection)):
                return super().execute(context)


    # -- OpenLineage (the provider calls these; lineage sits where the work is done) --------
    def _lineage(self, complete: bool) -> Any:
        from airflow.providers.openlineage.extractors import OperatorLineage

        from offsetflow.orchestration.observe import batch_lineage

        try:
            run = getattr(self, "_offsetflow_run", None)
            if run is None:  # on start: before execute
                run = (OffsetFlowHook(pipeline=self.pipeline, config=self.config,
                                      postgres_conn_id=self.postgres_conn_id,
                                      kafka_conn_id=self.kafka_conn_id).pipeline_config,
                       batch_id_list(self.batch_ids))
            cfg, ids = run
            return batch_lineage(cfg, ids, complete) if ids else OperatorLineage()
        except Exception as e:  # noqa: BLE001 - lineage must never fail the run
            self.log.warning("no OpenLineage facets for this run: %s", e)
            return OperatorLineage()

    def get_openlineage_facets_on_start(self) -> Any:
        return self._lineage(complete=False)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        return self._lineage(complete=True)

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> Any:
        return self._lineage(complete=False)


def _skip_unless_a_batch_is_open(hook: OffsetFlowHook, rendered: Any) -> None:
    """No batch ids means nothing to read, but only if the pipeline has no open batch: ids
    that did not arrive (a plan task id other than the template's, a TaskGroup prefix,
    do_xcom_push=False) must fail loudly, not skip every run while the batch stays open."""
    cfg = hook.pipeline_config
    with hook.get_ledger() as ledger, ledger.transaction() as cur:
        open_batch = ledger.open_batch(cur, cfg.name)
    if open_batch is not None:
        raise BatchStateError(
            f"no batch ids reached this task (batch_ids rendered as {rendered!r}) but batch "
            f"{open_batch.batch_id} of pipeline {cfg.name} is {open_batch.status}: make "
            f"batch_ids pull the plan task's XCom (e.g. batch_ids=plan.output; a TaskGroup "
            f"prefixes task ids)")
    raise AirflowSkipException("no batch to run")


def submit_args(cfg: PipelineConfig, pipeline_file: str, batch_ids: list[int],
                conf: dict[str, Any]) -> tuple[list[str], dict[str, Any], str, dict[str, str]]:
    """The one place spark-submit's arguments are built: application args, Spark conf,
    application name and the non-secret environment."""
    args = ["--pipeline-file", pipeline_file, "--batch-id", ",".join(map(str, batch_ids))]
    # a shipped environment (spark.archives) keeps a client-mode driver on this Python
    spark_conf = submit_conf({**cfg.spark.conf, **conf}, sys.executable)
    return args, spark_conf, f"offsetflow-{cfg.name}", spark_env()


def spark_env() -> dict[str, str]:
    """Non-secret environment for spark-submit: the venv first on PATH (spark-submit needs
    it) and where pipelines live. Secrets never go here: the hook turns env_vars into Spark
    conf on YARN/Kubernetes."""
    keep = ("PATH", "JAVA_HOME", "PYSPARK_PYTHON", "OFFSETFLOW_PIPELINES_DIR", "SPARK_HOME")
    return {k: os.environ[k] for k in keep if k in os.environ}


@contextlib.contextmanager
def _process_env(extra: Mapping[str, str]) -> Iterator[None]:
    """Set variables only while spark-submit starts (it copies os.environ into the child)."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _pipeline_file(cfg: PipelineConfig, inline: Mapping[str, Any] | None) -> Iterator[str]:
    """The YAML the driver loads: the pipeline's own file, or an inline config written to a
    0600 temporary file removed after the run."""
    if inline is None:
        yield cfg.source_file
        return
    fd, path = tempfile.mkstemp(prefix=f"offsetflow-{cfg.name}-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(dict(inline), f)
        yield path
    finally:
        os.unlink(path)


class OffsetFlowPublishOperator(_PipelineOperator):
    """Check the batches committed, log their figures, send their stats and emit one Asset
    event per batch for its target table (`postgres://host:port/db/schema/table`) with
    extras: batch_id, kind, ranges, rows_written. Events go through an AssetAlias: the
    table's URI needs the connection, which is read at run time, not while the DAG file is
    parsed. Lineage is the run task's (where the batches are read and written)."""

    template_fields: Sequence[str] = (*PIPELINE_FIELDS, "batch_ids")
    ui_color = "#e6f5e6"

    def __init__(self, *, batch_ids: Any = "{{ ti.xcom_pull(task_ids='plan') }}",
                 asset_alias: str | None = None, pipeline: str | None = None,
                 config: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        name = pipeline or (config or {}).get("name") or "pipeline"
        alias = AssetAlias(asset_alias or assets.alias_name(
            name if "{{" not in str(name) else "window"))
        kwargs.setdefault("outlets", [alias])
        super().__init__(pipeline=pipeline, config=config, **kwargs)
        self.batch_ids = batch_ids
        self.alias = alias

    def execute(self, context: Any) -> dict[str, Any]:
        cfg = self.hook.pipeline_config
        out = tasks.publish_task(cfg, batch_id_list(self.batch_ids))
        for fig in out["batches"]:
            if fig.get("audit_id") is not None:  # in a shadow: nothing is live until publish
                self.log.info("batch %s is staged for audit %s; no asset event until it is "
                              "published", fig["batch_id"], fig["audit_id"])
                continue
            uri = assets.target_uris(cfg, fig["target_table"])  # a table, or a topic
            context["outlet_events"][self.alias].add(
                Asset(uri), extra=assets.batch_extra(cfg, fig))
            self.log.info("asset event %s: batch %s (%s)", uri, fig["batch_id"], fig["kind"])
        return out


class PipelineTasks(NamedTuple):
    plan: OffsetFlowPlanOperator
    has_batch: ShortCircuitOperator
    run_batch: OffsetFlowRunBatchOperator
    publish: OffsetFlowPublishOperator


def topic_inlets(cfg: PipelineConfig) -> list[Asset]:
    """Kafka topics as inlets, when the brokers are known without reading a connection."""
    if not cfg.bootstrap_servers or cfg.topic_pattern is not None:
        return []
    return [Asset(assets.topic_uri(cfg.bootstrap_servers, t)) for t in cfg.topics]


def offsetflow_pipeline_tasks(*, pipeline: str | None = None,
                              config: Mapping[str, Any] | None = None,
                              group_id: str | None = None,
                              postgres_conn_id: str | None = None,
                              kafka_conn_id: str | None = None,
                              launch: str | None = None) -> PipelineTasks:
    """plan >> has_batch >> run_batch >> publish for one pipeline, in the current DAG (in a
    TaskGroup when `group_id` is given). An empty plan skips Spark and publish."""
    common: dict[str, Any] = {"pipeline": pipeline, "config": config,
                              "postgres_conn_id": postgres_conn_id,
                              "kafka_conn_id": kafka_conn_id}
    cfg = OffsetFlowHook(**common).load_config()
    ctx = TaskGroup(group_id) if group_id else contextlib.nullcontext()
    with ctx:
        plan = OffsetFlowPlanOperator(task_id="plan", inlets=topic_inlets(cfg), **common)
        xcom = f"{{{{ ti.xcom_pull(task_ids='{plan.task_id}') }}}}"
        has_batch = ShortCircuitOperator(
            task_id="has_batch", python_callable=lambda batch_id: batch_id is not None,
            op_args=[plan.output])
        run = OffsetFlowRunBatchOperator(task_id="run_batch", batch_ids=xcom, launch=launch,
                                         **common)
        # publish only reads the ledger: retrying it is always safe, and a failed publish
        # would otherwise leave a committed batch without its Asset event, lineage and stats
        publish = OffsetFlowPublishOperator(task_id="publish", batch_ids=xcom, retries=2,
                                            asset_alias=assets.alias_name(cfg.name), **common)
        plan >> has_batch >> run >> publish
    return PipelineTasks(plan, has_batch, run, publish)
