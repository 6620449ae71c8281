"""`python -m include.soak` (from the repo root): see the package docstring."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the workload, fault injectors and checker are test tooling (tests/tooling), not shipped;
# Spark workers and job processes find them through PYTHONPATH
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

import include.soak as package  # noqa: E402 - after the sys.path line
from include.soak.faults import FAULTS  # noqa: E402
from include.soak.run import Soak  # noqa: E402
from include.soak.sinks import SINKS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m include.soak", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sinks", type=lambda v: [s for s in v.split(",") if s],
                    default=list(SINKS), help=f"comma-separated, of: {','.join(SINKS)}")
    ap.add_argument("--minutes", type=float, default=10.0, help="per sink")
    ap.add_argument("--cycles", type=int, default=0, help="stop after N cycles (0: by time)")
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--faults", type=lambda v: [f for f in v.split(",") if f],
                    default=list(FAULTS), help=f"comma-separated subset of: {','.join(FAULTS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("offsetflow.ops.runner").setLevel(logging.WARNING)
    args = ap.parse_args()
    for what, given, known in (("--sinks", args.sinks, SINKS), ("--faults", args.faults, FAULTS)):
        unknown = sorted(set(given) - set(known))
        if unknown or not given:
            ap.error(f"{what}: unknown {unknown}; choose from {','.join(known)}")
    verdicts = {}
    for kind in args.sinks:
        try:
            ok, figures = Soak(args, SINKS[kind]).run()
        except Exception:  # the next sink still runs; this one failed
            logging.exception("soak of the %s sink broke off", kind)
            verdicts[kind] = False
            continue
        print(json.dumps(figures, indent=2), flush=True)
        verdicts[kind] = ok
        print(f"SOAK {kind}: {figures['verdict']}", flush=True)
    print("SOAK", " ".join(f"{k}={'OK' if v else 'FAILED'}" for k, v in verdicts.items()))
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
