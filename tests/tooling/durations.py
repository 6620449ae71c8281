"""Record how long each test file took in a `make test` run, for the scheduler's longest-first
order (tests/tooling/xdist_groups.py): `python -m tests.tooling.durations
.stack/test-results/parallel.xml` writes tests/tooling/durations.json. Re-record after adding
or speeding up a slow file; a stale record only costs some wall time, never a result."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.tooling.xdist_groups import DURATIONS


def file_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test file (setup + call + teardown of its tests) in a JUnit file."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = module_path(case.get("classname", ""))
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0))
    return seconds


def module_path(classname: str) -> str:
    """`tests.x.test_y` or `tests.x.test_y.TestClass` -> `tests/x/test_y.py` (the longest
    prefix that is a file under the repository root, the current directory)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if Path(path).is_file():
            return path
    return "/".join(parts) + ".py"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    seconds: dict[str, float] = {}
    for junit in argv:
        for path, s in file_seconds(Path(junit)).items():
            seconds[path] = seconds.get(path, 0.0) + s
    DURATIONS.write_text(json.dumps(
        {"files": {p: round(s, 1) for p, s in sorted(seconds.items())}}, indent=1) + "\n")
    print(f"[durations] {len(seconds)} files, {sum(seconds.values()):.0f} s -> {DURATIONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
