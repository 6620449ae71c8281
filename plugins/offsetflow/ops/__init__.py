"""Operator verbs without Airflow: run until caught up, backfill and replay, status,
reset positions, complete a batch an external sink holds.
"""

from __future__ import annotations

from offsetflow.ops.audit import (
    audit_pipeline,
    discard_audit,
    format_audit,
    publish_audit,
    show_audit,
)
from offsetflow.ops.backfill import plan_window, run_batches, submit_window
from offsetflow.ops.complete import complete_from_sink, unreadable_in
from offsetflow.ops.positions import reset_positions
from offsetflow.ops.runner import (
    CycleResult,
    kafka_for,
    open_batch_wait,
    pending_for,
    plan_only,
    run_until_caught_up,
)
from offsetflow.ops.status import (
    STATUS_REGISTRY_TIMEOUT_S,
    Unread,
    format_status,
    pipeline_status,
    schema_summary,
    unread_now,
    with_schema_versions,
)

__all__ = [
    "STATUS_REGISTRY_TIMEOUT_S",
    "CycleResult",
    "Unread",
    "audit_pipeline",
    "discard_audit",
    "format_audit",
    "publish_audit",
    "show_audit",
    "complete_from_sink",
    "format_status",
    "kafka_for",
    "open_batch_wait",
    "pending_for",
    "pipeline_status",
    "plan_only",
    "plan_window",
    "reset_positions",
    "run_batches",
    "run_until_caught_up",
    "schema_summary",
    "submit_window",
    "unread_now",
    "unreadable_in",
    "with_schema_versions",
]
