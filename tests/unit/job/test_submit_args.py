"""spark-submit argument sets for clusters, without a cluster (issue 16 item 5): the shipped
environment's driver interpreter in client mode, Kubernetes cluster mode with the project's
image, and a managed Spark (YARN) through the apache-spark provider's connection fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from offsetflow.job import submit_conf
from offsetflow.job.submit_args import IMAGE_JOB, KubernetesSubmit

ROOT = Path(__file__).resolve().parents[3]
ARCHIVE = {"spark.archives": "/opt/envs/offsetflow-env.tar.gz#environment",
           "spark.pyspark.python": "./environment/bin/python"}


def test_client_mode_driver_keeps_its_own_python_when_executors_get_an_archive() -> None:
    conf = submit_conf(ARCHIVE, "/srv/airflow/venv/bin/python")
    assert conf["spark.pyspark.driver.python"] == "/srv/airflow/venv/bin/python"
    assert conf["spark.pyspark.python"] == "./environment/bin/python"


@pytest.mark.parametrize("conf", [
    {},  # nothing shipped: spark-submit's own choice stands
    {"spark.pyspark.python": "/usr/bin/python3"},  # an interpreter the nodes have
    {**ARCHIVE, "spark.pyspark.driver.python": "/opt/py/bin/python"},  # the user's choice
    {**ARCHIVE, "spark.submit.deployMode": "cluster"},  # the driver runs beside executors
])
def test_driver_python_left_alone(conf: dict[str, str]) -> None:
    assert submit_conf(conf, "/venv/bin/python") == conf


def kube() -> KubernetesSubmit:
    return KubernetesSubmit(api_server="https://kube.example:6443",
                            image="registry.example/offsetflow-spark:4.2.0")


def test_kubernetes_argument_set() -> None:
    args = kube().args("orders", [41, 42])
    assert args[:6] == ["--master", "k8s://https://kube.example:6443", "--deploy-mode",
                        "cluster", "--name", "offsetflow-orders"]
    conf = dict(a.split("=", 1) for a in args[7:-5:2])
    assert args[6:-5:2] == ["--conf"] * len(conf)
    assert conf["spark.kubernetes.container.image"] == "registry.example/offsetflow-spark:4.2.0"
    assert conf["spark.kubernetes.namespace"] == "offsetflow"
    assert conf["spark.kubernetes.authenticate.driver.serviceAccountName"] == "spark"
    assert conf["spark.kubernetes.driver.secretKeyRef.OFFSETFLOW_PG_DSN"] == \
        "offsetflow-postgres:dsn"
    assert conf["spark.executor.instances"] == "2"
    assert "spark.archives" not in conf  # the image carries offsetflow and its libraries
    assert args[-5:] == [IMAGE_JOB, "--pipeline-file",
                         "/opt/offsetflow/include/pipelines/orders.yaml", "--batch-id", "41,42"]


def test_kubernetes_paths_exist_in_the_image() -> None:
    """The job and the pipelines the arguments name are copied to those paths."""
    dockerfile = (ROOT / "include" / "docker" / "Dockerfile.spark").read_text()
    assert "COPY spark_jobs /opt/offsetflow/spark_jobs" in dockerfile
    assert "COPY include/pipelines /opt/offsetflow/include/pipelines" in dockerfile
    assert IMAGE_JOB == "local:///opt/offsetflow/spark_jobs/run_batch.py"


@pytest.mark.parametrize("bad", ["kube.example:6443", "k8s://https://kube.example"])
def test_kubernetes_api_server_must_be_a_url(bad: str) -> None:
    with pytest.raises(ValueError, match="api_server"):
        KubernetesSubmit(api_server=bad, image="x").args("orders", [1])


def _hook_command(monkeypatch: pytest.MonkeyPatch, conn: dict[str, Any],
                  conf: dict[str, str]) -> list[str]:
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    monkeypatch.setenv("AIRFLOW_CONN_OFFSETFLOW_SPARK_TEST", json.dumps(conn))
    hook = SparkSubmitHook(conn_id="offsetflow_spark_test", conf=conf, name="offsetflow-orders",
                           application_args=["--pipeline-file", "/p/orders.yaml",
                                             "--batch-id", "7"])
    return hook._build_spark_submit_command("/repo/spark_jobs/run_batch.py")


def test_standalone_connection_client_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the cluster test's Airflow run uses: spark_default at a standalone master."""
    cmd = _hook_command(monkeypatch, {"conn_type": "spark", "host": "spark://127.0.0.1",
                                      "port": 7077, "extra": {"deploy-mode": "client"}},
                        submit_conf(ARCHIVE, "/venv/bin/python"))
    assert cmd[cmd.index("--master") + 1] == "spark://127.0.0.1:7077"
    assert cmd[cmd.index("--deploy-mode") + 1] == "client"
    assert "spark.archives=/opt/envs/offsetflow-env.tar.gz#environment" in cmd
    assert "spark.pyspark.driver.python=/venv/bin/python" in cmd


def test_managed_spark_on_yarn_connection_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """A managed Spark (EMR, Dataproc, HDInsight: YARN) through the provider's connection
    fields: master `yarn`, queue, deploy mode, spark-binary."""
    cmd = _hook_command(monkeypatch, {"conn_type": "spark", "host": "yarn",
                                      "extra": {"queue": "ingest", "deploy-mode": "cluster",
                                                "spark-binary": "spark-submit"}},
                        {**ARCHIVE, "spark.submit.deployMode": "cluster"})
    assert cmd[0] == "spark-submit"
    assert cmd[cmd.index("--master") + 1] == "yarn"
    assert cmd[cmd.index("--queue") + 1] == "ingest"
    assert cmd[cmd.index("--deploy-mode") + 1] == "cluster"
    assert "spark.pyspark.python=./environment/bin/python" in cmd
    assert not any(a.startswith("spark.pyspark.driver.python") for a in cmd)
    assert cmd[-5:] == ["/repo/spark_jobs/run_batch.py", "--pipeline-file", "/p/orders.yaml",
                        "--batch-id", "7"]
