"""Step 1: planning a batch's OffsetRanges under the pipeline's lock, the pure planner
behind it, adaptive batch sizing (Spark's PID rate estimator), backfill/replay requests and
whether new data has arrived.
"""

from __future__ import annotations

from offsetflow.plan.arrival import OpenBatchRetry, describe, open_batch_retry, pending_offsets
from offsetflow.plan.planner import cut_window
from offsetflow.plan.planning import (
    PlanOutcome,
    changed_topics,
    check_batch_topics,
    deleted_before_read,
    plan_next,
)
from offsetflow.plan.rate import (
    Observation,
    PidState,
    RateDecision,
    decide_rate,
    observe,
    pid_update,
)
from offsetflow.plan.requests import (
    WindowRequest,
    check_backfill_window,
    check_replay_window,
    gone_from_kafka,
    parse_request,
    resolve_window,
    window_ranges,
)

__all__ = [
    "Observation",
    "OpenBatchRetry",
    "PidState",
    "PlanOutcome",
    "RateDecision",
    "WindowRequest",
    "changed_topics",
    "check_backfill_window",
    "check_batch_topics",
    "check_replay_window",
    "cut_window",
    "decide_rate",
    "deleted_before_read",
    "describe",
    "gone_from_kafka",
    "observe",
    "open_batch_retry",
    "parse_request",
    "pending_offsets",
    "pid_update",
    "plan_next",
    "resolve_window",
    "window_ranges",
]
