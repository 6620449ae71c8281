"""spark-submit entry point: read, stage and commit one or more planned batches.

    spark-submit .../offsetflow/spark_app/run_batch.py --pipeline orders --batch-id 42

Thin on purpose: it parses arguments and calls the CLI's `run-batch`. The Spark master
(local, standalone, YARN, Kubernetes) comes from spark-submit, not from here.
"""

from __future__ import annotations

import sys

from offsetflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["run-batch", *sys.argv[1:]]))
