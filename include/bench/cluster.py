"""The bench's run on the local Spark standalone cluster (issue 16)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from engines import ROOT

STACK = ["bash", str(ROOT / "include" / "stack" / "stack.sh")]
# the engines that run their job on the cluster, each against the same job on local[2]:
# the PostgreSQL sink (issue 16) and the Kafka sink (issue 32)
# (the Kafka sink's default stages on a cluster and writes task files on local[2]: each
# cluster engine is set against the same path on local[2])
CLUSTER_ENGINES = {"offsetflow-cluster": "offsetflow-local",
                   "offsetflow-kafka-cluster": "offsetflow-kafka-stage",
                   "offsetflow-kafka-cluster-files": "offsetflow-kafka"}


CLUSTER_DIR = ROOT / ".stack" / "spark-cluster"


def cluster_was_up() -> bool:
    return (CLUSTER_DIR / "master" / "pid").exists()


def cluster_pids() -> list[int]:
    """The master's and the workers' JVMs (stack.sh's pid files): a cluster engine's extra
    roots, so its executors and their Python workers count in its CPU and memory (they are
    the workers' children, not the driver's), the daemons' own time as `spark_jvm`."""
    pids = []
    for f in sorted(CLUSTER_DIR.glob("*/pid")):
        try:
            pids.append(int(f.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def start_cluster(metrics_dir: Path) -> dict[str, Any]:
    """The Spark standalone cluster (and its packed executor environment) running; the ctx
    keys the cluster engines (CLUSTER_ENGINES) need. Two 1-core executors: the same two cores as
    local[2], so the ratio shows what separate executor processes cost."""
    subprocess.run([*STACK, "spark-env"], check=True)
    subprocess.run([*STACK, "spark-cluster-start"], check=True)
    archive = os.environ.get("OFFSETFLOW_SPARK_ENV_ARCHIVE",
                             str(ROOT / ".stack" / "spark-env" / "offsetflow-env.tar.gz"))
    conf = {"spark.archives": f"{archive}#environment",
            "spark.pyspark.python": "./environment/bin/python",
            "spark.executor.cores": "1", "spark.executor.memory": "512m",
            "spark.cores.max": "2", "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.executorEnv.OFFSETFLOW_TASK_METRICS_DIR": str(metrics_dir)}
    return {"cluster_master": os.environ.get("OFFSETFLOW_SPARK_MASTER_URL",
                                             "spark://127.0.0.1:17077"),
            "cluster_conf": conf}
