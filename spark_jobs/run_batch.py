"""spark-submit entry point kept for existing commands and docs:

    spark-submit spark_jobs/run_batch.py --pipeline orders --batch-id 42

The real file is `offsetflow/spark_app/run_batch.py` inside the package (what the operators
submit, installed or not); this one only forwards to the same CLI command.
"""

from __future__ import annotations

import sys

from offsetflow.cli import main

if __name__ == "__main__":
    sys.exit(main(["run-batch", *sys.argv[1:]]))
