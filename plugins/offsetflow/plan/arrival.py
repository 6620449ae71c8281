"""Has new data arrived for a pipeline? Pure: what the waiting sensor and trigger decide on.

A partition has new data when its latest offset (under read_committed, the last stable
offset: records of open or aborted transactions do not count) is beyond the pipeline's
committed position. Partitions without a position yet are judged like the planner does:
under `starting: latest` on the first plan there is nothing to read, otherwise everything
from the earliest offset is new.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from offsetflow.ranges import PartitionOffsets, TopicPartition

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


@dataclass(frozen=True)
class OpenBatchRetry:
    """When an event-driven run may start a pipeline's open batch. `state`: "live" (a run
    of it is alive: never started twice), "failed" (its last attempt failed) or "died"
    (left `running` by a run that is gone: a killed driver records no failure)."""
    batch_id: int
    attempts: int
    state: str
    wait_s: float  # 0: now; inf while a run of it is alive
    holders: tuple[str, ...] = ()  # live: the sessions holding its run lock
    running_s: float | None = None  # live: seconds since its attempt started


def open_batch_retry(batch_id: int, status: str, attempts: int, since_s: float | None,
                     holders: tuple[str, ...], base_s: float) -> OpenBatchRetry | None:
    """`holders`: the sessions holding the batch's run lock (a run is alive while any does).
    `since_s`: alive, seconds since its attempt started; failed, since its last failure;
    died, since its run was first seen gone (when a killed driver died is not recorded, and
    its attempt's start would put the wait of a long run's death in the past). None if not
    recorded: due now (never a wait that cannot end). None for a batch no wait applies to
    (planned, never run)."""
    if holders:
        return OpenBatchRetry(batch_id, attempts, "live", math.inf, holders, since_s)
    state = {"failed": "failed", "running": "died"}.get(status)
    if state is None:
        return None
    wait = 0.0 if since_s is None else retry_wait(attempts, since_s, base_s)
    return OpenBatchRetry(batch_id, attempts, state, wait)
