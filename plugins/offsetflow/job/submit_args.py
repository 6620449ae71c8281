"""spark-submit arguments for running a batch on a cluster (pure: no Airflow, no Spark).

Two shapes are covered. A client-mode submit (Spark standalone, or YARN/managed Spark in
client mode) whose executors get their Python environment as an archive: the pipeline's
`spark.conf` names `spark.archives` and a relative `spark.pyspark.python`. And a Kubernetes
cluster-mode submit of the image built from include/docker/Dockerfile.spark, where driver and
executors run the image's Python and the pipelines are baked into the image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# where include/docker/Dockerfile.spark puts the project in the image
IMAGE_ROOT = "/opt/offsetflow"
IMAGE_JOB = f"local://{IMAGE_ROOT}/spark_jobs/run_batch.py"
IMAGE_PIPELINES = f"{IMAGE_ROOT}/include/pipelines"


def submit_conf(conf: Mapping[str, str], driver_python: str) -> dict[str, str]:
    """The pipeline's Spark conf for spark-submit. A relative `spark.pyspark.python` names an
    interpreter inside a shipped archive (`./environment/bin/python`), which exists only in
    the executors' work directories; spark-submit would start a client-mode driver with it
    too (it prefers that conf over PYSPARK_DRIVER_PYTHON) and fail, so the driver gets
    `driver_python` unless the conf names one or says cluster deploy mode."""
    out = {str(k): str(v) for k, v in conf.items()}
    py = out.get("spark.pyspark.python", "")
    if (py and not py.startswith("/") and "spark.pyspark.driver.python" not in out
            and out.get("spark.submit.deployMode", "client") != "cluster"):
        out["spark.pyspark.driver.python"] = driver_python
    return out


@dataclass(frozen=True)
class KubernetesSubmit:
    """A batch as a Spark application on Kubernetes, cluster deploy mode."""

    api_server: str  # https://host:port of the Kubernetes API
    image: str  # built from include/docker/Dockerfile.spark
    namespace: str = "offsetflow"
    service_account: str = "spark"
    executors: int = 2
    executor_cores: int = 1
    executor_memory: str = "2g"
    driver_memory: str = "1g"
    # Kubernetes secret (name, key) that holds the PostgreSQL DSN: the driver reads it from
    # OFFSETFLOW_PG_DSN, which the pipeline's sink.connection names as ${OFFSETFLOW_PG_DSN}
    dsn_secret: tuple[str, str] = ("offsetflow-postgres", "dsn")
    extra_conf: Mapping[str, str] = field(default_factory=dict)

    def master(self) -> str:
        if not self.api_server.startswith(("https://", "http://")):
            raise ValueError(f"api_server must be an http(s) URL, got {self.api_server!r}")
        return f"k8s://{self.api_server}"

    def conf(self) -> dict[str, str]:
        name, key = self.dsn_secret
        return {
            "spark.kubernetes.container.image": self.image,
            "spark.kubernetes.namespace": self.namespace,
            "spark.kubernetes.authenticate.driver.serviceAccountName": self.service_account,
            "spark.executor.instances": str(self.executors),
            "spark.executor.cores": str(self.executor_cores),
            "spark.executor.memory": self.executor_memory,
            "spark.driver.memory": self.driver_memory,
            # the image's own Python, on the driver and the executors
            "spark.pyspark.python": "python3",
            "spark.pyspark.driver.python": "python3",
            "spark.kubernetes.driver.secretKeyRef.OFFSETFLOW_PG_DSN": f"{name}:{key}",
            "spark.kubernetes.driverEnv.OFFSETFLOW_PIPELINES_DIR": IMAGE_PIPELINES,
            # spark-submit returns when the batch ends, with its exit status
            "spark.kubernetes.submission.waitAppCompletion": "true",
            **{str(k): str(v) for k, v in self.extra_conf.items()},
        }

    def args(self, pipeline: str, batch_ids: Sequence[int]) -> list[str]:
        """The full spark-submit argument list (without the binary)."""
        if not batch_ids:
            raise ValueError("at least one batch id is needed")
        out = ["--master", self.master(), "--deploy-mode", "cluster",
               "--name", f"offsetflow-{pipeline}"]
        for k, v in self.conf().items():
            out += ["--conf", f"{k}={v}"]
        return [*out, IMAGE_JOB, "--pipeline-file", f"{IMAGE_PIPELINES}/{pipeline}.yaml",
                "--batch-id", ",".join(str(b) for b in batch_ids)]
