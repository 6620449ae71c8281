"""Has new data arrived for a pipeline? Pure: what the waiting sensor and trigger decide on.

A partition has new data when its latest offset (under read_committed, the last stable
offset: records of open or aborted transactions do not count) is beyond the pipeline's
committed position. Partitions without a position yet are judged like the planner does:
under `starting: latest` on the first plan there is nothing to read, otherwise everything
from the earliest offset is new.
"""

from __future__ import annotations

from collections.abc import Mapping

from offsetflow.planner import PartitionOffsets
from offsetflow.ranges import TopicPartition

# a failed batch's retry by an event-driven run waits at most this long: a batch failing
# for good runs 4 times an hour, and a pipeline back from an outage waits at most this
RETRY_CAP_S = 900.0


def pending_offsets(committed: Mapping[TopicPartition, int],
                    offsets: Mapping[TopicPartition, PartitionOffsets],
                    starting_kind: str) -> dict[TopicPartition, int]:
    """Offsets waiting to be read per partition (only partitions with some)."""
    first_plan = not committed
    out: dict[TopicPartition, int] = {}
    for tp, off in sorted(offsets.items()):
        if tp in committed:
            start = max(committed[tp], off.earliest)
        elif first_plan and starting_kind == "latest":
            start = off.latest
        else:
            start = off.earliest
        if off.latest > start:
            out[tp] = off.latest - start
    return out


def describe(pending: Mapping[TopicPartition, int]) -> dict[str, int]:
    """JSON-able form for trigger events and XCom: {"topic/partition": offsets}."""
    return {f"{t}/{p}": n for (t, p), n in sorted(pending.items())}


def retry_wait(attempts: int, since_failed_s: float, base_s: float,
               cap_s: float = RETRY_CAP_S) -> float:
    """Seconds until an event-driven run should retry an open batch that failed after
    `attempts` attempts (every try counts, Airflow task retries too), its last failure
    `since_failed_s` ago: `base_s` doubled per attempt after the first, at most `cap_s`. A
    batch failing for good (its records deleted, a broken config) then starts a failing run
    every 15 minutes, not every poll interval."""
    if attempts <= 0:
        return 0.0
    delay = min(base_s * 2.0 ** min(attempts - 1, 30), cap_s)
    return max(0.0, delay - max(since_failed_s, 0.0))
