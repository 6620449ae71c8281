"""Create or update the expectation suites of the shipped pipelines with GX's own API, and
give every suite of the project its Checkpoint (set-up time, once; batches only run it).

    .venv/bin/python include/quality/create_suites.py

Suites are stored in the GX project under include/gx (expectations/<suite>.json) and can be
edited there or with GX as usual; a pipeline names its suite under `quality.suite`. After
adding or editing a suite, run this again so its Checkpoint (checkpoints/offsetflow_<suite>)
exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import great_expectations as gx
import great_expectations.expectations as gxe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins"))
from offsetflow.job.quality import configure_project  # noqa: E402


def main() -> int:
    root = Path(os.environ.get("OFFSETFLOW_GX_ROOT") or Path(__file__).resolve().parents[1])
    ctx = gx.get_context(mode="file", project_root_dir=str(root))
    ctx.suites.add_or_update(gx.ExpectationSuite(name="orders", expectations=[
        gxe.ExpectColumnValuesToNotBeNull(column="order_id"),
        gxe.ExpectColumnValuesToBeBetween(column="amount", min_value=0, max_value=100_000),
        gxe.ExpectColumnValuesToBeBetween(column="quantity", min_value=1, max_value=1000),
    ]))
    checkpoints = configure_project(ctx)
    print(f"checkpoints in {root / 'gx' / 'checkpoints'}: {checkpoints}")
    print(f"suites in {root / 'gx' / 'expectations'}: {[s.name for s in ctx.suites.all()]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
