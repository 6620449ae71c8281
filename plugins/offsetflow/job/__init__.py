"""The Spark driver: read a planned batch in Spark tasks, stage it, gate it on quality
and commit it; the Spark session (local, spark-submit's, or Spark Connect).
"""

from __future__ import annotations

from offsetflow.job.driver import RunReport, committed_report, run_batch
from offsetflow.job.spark_session import build_spark, drop_session
from offsetflow.job.submit_args import submit_conf

__all__ = [
    "RunReport",
    "build_spark",
    "committed_report",
    "drop_session",
    "run_batch",
    "submit_conf",
]
