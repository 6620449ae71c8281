"""The slowest tests of a `make test` run, across its phases (the parallel one on several
pytest-xdist workers and the serial one), from the JUnit files each phase writes, and the
run's wall time: `python -m tests.tooling.slowest SECONDS FILE...`."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
    wall, files = float(argv[0]), argv[1:]
    cases: list[tuple[float, str]] = []
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for f in files:
        try:
            root = ET.parse(f).getroot()
        except (OSError, ET.ParseError) as e:
            print(f"[test] no results in {f}: {e}")
            continue
        for suite in root.iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        for tc in root.iter("testcase"):
            name = f"{tc.get('classname', '').replace('.', '/')}.py::{tc.get('name')}"
            cases.append((float(tc.get("time", 0)), name))
    cases.sort(reverse=True)
    print("\n[test] the 25 slowest tests of the run (setup + call + teardown):")
    for t, name in cases[:25]:
        print(f"{t:8.2f}s  {name}")
    print(f"[test] {counts['tests']} tests, {counts['failures']} failed, {counts['errors']} "
          f"errors, {counts['skipped']} skipped; {sum(t for t, _ in cases):.0f} s of test "
          f"time in {wall:.0f} s ({wall / 60:.1f} min) of wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
