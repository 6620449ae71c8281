"""The Spark conf OffsetFlow gives a pipeline's executors when nobody else sets it (pure: no
I/O, no Spark).

A pipeline without a transform gets C1-only executor JVMs (`-XX:TieredStopAtLevel=1`). Its
executor JVM only hands its Python tasks a few sub-range ids and takes back their counts
(the tasks read Kafka, build and write everything), so in a JVM that lives for a few
batches HotSpot's C2 compiler was most of its CPU: 9.0-9.3 core-s per executor a session on
the local cluster, 4.6-5.3 with C1 only (docs/performance.md). A transform's executors run
Spark SQL, whose hot loops C1 alone would slow, so they keep the JVM's default.

Only -XX:TieredStopAtLevel=1: the measured gain is its alone. -XX:CICompilerCount=1 caps
how many methods compile at once, not how much is compiled; it would slow the warm-up of
an executor with many cores, and a JDK 8 executor (Spark 3.5 still supports one) refuses to
start with it while tiered compilation is on. Garbage-collector flags are the user's.
"""

from __future__ import annotations

from collections.abc import Collection

from offsetflow.config import PipelineConfig

EXECUTOR_JAVA_OPTIONS = "spark.executor.extraJavaOptions"
C1_ONLY = "-XX:TieredStopAtLevel=1"


def default_conf(cfg: PipelineConfig, launcher_keys: Collection[str] = ()) -> dict[str, str]:
    """The entries to put under the pipeline's own `spark.conf` when its session is built.
    A key the pipeline's `spark.conf` sets, or the launcher did (`launcher_keys`: the conf
    spark-submit started the driver with, its `--conf` and spark-defaults.conf), is theirs,
    whatever its value: an empty string is how a user turns a default off. None with
    `spark.launch: connect`: the server's executors are already running."""
    if cfg.spark.launch == "connect" or cfg.transform:
        return {}
    return {k: v for k, v in {EXECUTOR_JAVA_OPTIONS: C1_ONLY}.items()
            if k not in cfg.spark.conf and k not in launcher_keys}
