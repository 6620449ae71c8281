"""How pytest-xdist hands test files to its workers in `make test`.

`--dist loadfile`: a file's tests on one worker, so its module fixtures stay single. Two
changes to xdist's own scheduling:

- Files that share a session fixture too costly to have twice (one `airflow standalone`,
  tests/integration/orchestration/conftest.py; the 3-broker Kafka cluster) are one work unit,
  so one worker runs them one after the other.
- Work units start longest first, by the seconds each file took in a recorded run
  (tests/tooling/durations.json; `python -m tests.tooling.durations FILE.xml` records it).
  xdist's default order is by number of tests, which starts the many quick unit-test files
  first and leaves a 150-second file with two tests to the end, where it runs alone while
  the other workers wait. Longest first keeps the tail short (LPT scheduling)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

DURATIONS = Path(__file__).with_name("durations.json")
# seconds per test assumed for a file the recorded run does not know (a new file)
UNKNOWN_SECONDS_PER_TEST = 5.0

# test file (as in a node id, from the repository root) -> the group it runs in
GROUPS = {
    **{f"tests/integration/orchestration/{name}": "airflow-standalone"
       for name in ("test_ui_window_forms.py", "test_rest_api.py", "test_public_api.py")},
    # the 3-broker Kafka cluster (tests/tooling/cluster.py): one file kills its leaders while
    # another counts its in-sync replicas, and it stops after the last test that uses it
    # (`kafka3`, tests/integration/conftest.py), under a file another worker might still be
    # running: one after the other, on one worker, sharing one start
    **{path: "kafka-cluster" for path in (
        "tests/integration/source/test_cluster_kafka.py",
        "tests/integration/sinks/kafka/test_sink_kafka_cluster.py")},
}


def recorded_durations(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds per test file of a recorded run; empty (count order) when there is none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.get("files", {}).items()}


def longest_first(workqueue: dict[str, dict[str, bool]],
                  durations: dict[str, float]) -> list[str]:
    """The work units (scopes) ordered by expected seconds, longest first. A unit's expected
    time is the sum over its files of the recorded seconds, or UNKNOWN_SECONDS_PER_TEST per
    test for a file the record does not hold."""
    def expected(scope: str) -> float:
        per_file: dict[str, int] = {}
        for nodeid in workqueue[scope]:
            path = nodeid.split("::", 1)[0]
            per_file[path] = per_file.get(path, 0) + 1
        return sum(durations.get(path, UNKNOWN_SECONDS_PER_TEST * n)
                   for path, n in per_file.items())

    return sorted(workqueue, key=lambda scope: -expected(scope))


class LoadFileGroupScheduling(LoadFileScheduling):
    """`--dist loadfile`, but the files of one group in GROUPS are one work unit, and the
    units start longest first."""

    ordered = False

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return GROUPS.get(path, path)

    def _assign_work_unit(self, node: Any) -> None:
        if not self.ordered:  # the first assignment: the work queue is complete
            self.ordered = True
            queue: OrderedDict[str, dict[str, bool]] = self.workqueue  # type: ignore[has-type]
            order = longest_first(queue, recorded_durations())
            self.workqueue = OrderedDict((scope, queue[scope]) for scope in order)
        super()._assign_work_unit(node)


def make_scheduler(config: Any, log: Any) -> LoadFileGroupScheduling | None:
    """The scheduler for `--dist loadfile`; None (xdist's own) for other modes."""
    if config.getvalue("dist") != "loadfile":
        return None
    return LoadFileGroupScheduling(config, log)
