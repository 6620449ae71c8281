"""The Spark application file the operators submit, shipped inside the package.

An installed OffsetFlow (wheel, `pip install .`) has no repo around it, so spark-submit gets
this package's `run_batch.py`. It lives in a folder of its own because Python puts a script's
folder first on sys.path: next to the other modules, `offsetflow/requests.py` would shadow
the `requests` library in the Spark driver.
"""

from __future__ import annotations

from pathlib import Path


def application_path() -> str:
    """Absolute path of the file to hand to spark-submit."""
    return str(Path(__file__).resolve().with_name("run_batch.py"))
