"""The Spark session a run of the job uses: a local one, spark-submit's, or the pipeline's
own session on a warm Spark Connect server, kept for the pipeline's next run.

Split out of `offsetflow.job.driver`, which asks for the session (`build_spark`) and ends its use
(`drop_session`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from offsetflow.config import PipelineConfig, connect_address
from offsetflow.errors import ConfigError, SparkUnavailableError
from offsetflow.job import connect_session
from offsetflow.job.executor_conf import default_conf

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

# Arrow batches Spark hands a Python task (the DataFrame path's writer) are cut at 10,000
# rows by default and not by bytes: with 1 MB records that is 10 GB per batch, past Arrow's
# 2 GiB array limit. Spark 4 can cut them by bytes too (spark.conf of a pipeline overrides).
ARROW_MAX_BYTES_PER_BATCH = 64 << 20


def _arrow_conf() -> dict[str, str]:
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        return {}
    return {"spark.sql.execution.arrow.maxBytesPerBatch": str(ARROW_MAX_BYTES_PER_BATCH)}


def build_spark(cfg: PipelineConfig, app_name: str) -> SparkSession:
    """A SparkSession for the pipeline: spark-submit's if running under it, a warm Spark
    Connect server when `spark.launch: connect`, else a local one from `spark.master`."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if cfg.spark.launch == "connect":
        return _connect_session(cfg)
    # under spark-submit (which starts the Python driver with a gateway) the master comes
    # from spark-submit / the Airflow Spark connection, never from the pipeline config
    launcher_keys: frozenset[str] = frozenset()
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        launcher_keys = _launcher_keys()
    else:
        builder = builder.master(cfg.spark.master)
        # executors run the interpreter the driver names in PYSPARK_PYTHON, and pyspark reads
        # only that variable, not spark.pyspark.python: a pipeline that ships its environment
        # (spark.archives) would otherwise have its executors run this process's Python,
        # which a cluster node does not have (spark-submit does this step itself)
        executor_python = cfg.spark.conf.get("spark.pyspark.python")
        if executor_python:
            os.environ["PYSPARK_PYTHON"] = executor_python
    builder = (builder.config("spark.sql.session.timeZone", "UTC")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "8"))
    log4j = os.environ.get("OFFSETFLOW_SPARK_LOG4J")  # console.setup_logging: quiet console
    if log4j and "spark.driver.extraJavaOptions" not in cfg.spark.conf:
        builder = builder.config("spark.driver.extraJavaOptions",
                                 f"-Dlog4j2.configurationFile=file:{log4j}")
    # executors are launched from the SparkContext's conf, so a builder setting reaches them
    # under spark-submit too (tests/integration/job/test_cluster_spark.py)
    for k, v in {**_arrow_conf(), **default_conf(cfg, launcher_keys), **cfg.spark.conf}.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("OFFSETFLOW_SPARK_LOG_LEVEL", "WARN"))
    return spark


def _launcher_keys() -> frozenset[str]:
    """The keys of the conf spark-submit started this driver with (its --conf, the Spark
    installation's spark-defaults.conf): a builder setting would replace them, so OffsetFlow's
    defaults leave them alone. Joins spark-submit's gateway, which getOrCreate does anyway."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()
    return frozenset(k for k, _ in SparkConf().getAll())


def tasks_here(cfg: PipelineConfig, spark: Any) -> bool:
    """Whether the session's tasks run on this host: a local master (`local[...]`,
    `local-cluster[...]`: one host's processes), not a cluster's, and not a Spark Connect
    server's, which may run elsewhere. Asked of the running session: under spark-submit the
    master comes from spark-submit, not from the pipeline."""
    if cfg.spark.launch == "connect":
        return False
    return str(spark.sparkContext.master).startswith("local")


def _connect_session(cfg: PipelineConfig) -> SparkSession:
    """A session on the warm Spark Connect server. Reachability is checked first: the
    client itself retries an absent server for minutes before it says anything."""
    url = cfg.spark.connect_url
    host, port = connect_address(url)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        raise SparkUnavailableError(
            f"no Spark Connect server at sc://{host}:{port} (spark.connect_url of "
            f"{cfg.source_file}, spark.launch: connect): {e}. Start one (locally: "
            f"include/stack/stack.sh connect-start) or use spark.launch: submit") from e
    spark = _pipeline_session(cfg, url)
    # set by every run: the session outlives it, and the pipeline's config may have changed
    for k, v in {**_arrow_conf(), **cfg.spark.conf}.items():
        try:
            spark.conf.set(k, v)
        except Exception as e:  # noqa: BLE001 - pyspark raises several kinds here
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(cfg.source_file, f"spark.conf.{k}",
                              f"cannot be set on a running Spark Connect server ({first}); "
                              f"set it when the server is started") from e
    return spark  # type: ignore[no-any-return]


def _pipeline_session(cfg: PipelineConfig, url: str) -> Any:
    """The pipeline's own session on the server (connect_session): reopened by every run,
    so its Python workers stay warm and the server starts no new ones per run. Its first
    call sets the time zone, which also tells whether the server closed that id before.
    Built without the builder, whose create() makes calls (and registers the session as
    the process's default) before a closed id can be told and dropped."""
    from pyspark.sql.connect.session import SparkSession as RemoteSession

    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"  # as the builder does: no local Spark
    if connect_session.names_session(url):
        candidates = [url]
    else:
        candidates = [connect_session.with_session_id(url, connect_session.session_id(
            cfg.name, url, g)) for g in range(connect_session.MAX_GENERATIONS)]
        candidates.append(url)  # every id closed: a session of this run's own
    for i, candidate in enumerate(candidates):
        spark = RemoteSession(connection=candidate)
        try:
            spark.conf.set("spark.sql.session.timeZone", "UTC")
        except Exception as e:  # noqa: BLE001 - pyspark raises several kinds here
            drop_session(spark)
            if i + 1 < len(candidates) and connect_session.is_closed_session(e):
                continue
            raise
        if candidate is candidates[-1] and len(candidates) > 1:
            log.warning("pipeline %s: the server closed its %d session ids; this run uses a "
                        "session of its own", cfg.name, connect_session.MAX_GENERATIONS)
        log.info("pipeline %s: Spark Connect session %s", cfg.name, spark.session_id)
        RemoteSession._set_default_and_active_session(spark)  # unless the process has one
        return spark
    raise AssertionError("unreachable: the last candidate returns or raises")


def drop_session(spark: Any) -> None:
    """End this process's use of a Spark session. A Spark Connect session stays on the
    server for the pipeline's next run (only the client is closed); a local one stops."""
    if hasattr(spark, "release_session_on_close"):  # pyspark.sql.connect.session
        spark.release_session_on_close = False
    spark.stop()
