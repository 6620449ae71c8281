"""Step 1: planning a batch's OffsetRanges under the pipeline's lock, the pure planner
behind it, backfill/replay requests and whether new data has arrived.
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
    "OpenBatchRetry",
    "PlanOutcome",
    "WindowRequest",
    "changed_topics",
    "check_backfill_window",
    "check_batch_topics",
    "check_replay_window",
    "cut_window",
    "deleted_before_read",
    "describe",
    "gone_from_kafka",
    "open_batch_retry",
    "parse_request",
    "pending_offsets",
    "plan_next",
    "resolve_window",
    "window_ranges",
]
