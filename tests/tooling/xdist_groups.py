"""Which test files pytest-xdist keeps on one worker together. `make test` runs
`--dist loadfile`: a file's tests on one worker, so its module fixtures stay single. Files
that share a session fixture too costly to have twice (one `airflow standalone`: ~40 s of
both cores to start, tests/integration/orchestration/conftest.py) are one work unit here, so
one worker runs them one after the other and starts that fixture once."""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

# test file (as in a node id, from the repository root) -> the group it runs in
GROUPS = {
    **{f"tests/integration/orchestration/{name}": "airflow-standalone"
       for name in ("test_ui_window_forms.py", "test_rest_api.py", "test_public_api.py")},
    # the 3-broker Kafka cluster (tests/tooling/cluster.py): one file kills its leaders while
    # another counts its in-sync replicas, and the file that started it stops it at its end,
    # under a file another worker is still running: one after the other, on one worker
    **{path: "kafka-cluster" for path in (
        "tests/integration/source/test_cluster_kafka.py",
        "tests/integration/sinks/kafka/test_sink_kafka_cluster.py")},
}


class LoadFileGroupScheduling(LoadFileScheduling):
    """`--dist loadfile`, but the files of one group in GROUPS are one work unit."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return GROUPS.get(path, path)


def make_scheduler(config: Any, log: Any) -> LoadFileGroupScheduling | None:
    """The scheduler for `--dist loadfile`; None (xdist's own) for other modes."""
    if config.getvalue("dist") != "loadfile":
        return None
    return LoadFileGroupScheduling(config, log)
