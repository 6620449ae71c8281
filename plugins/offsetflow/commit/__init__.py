"""Step 3: the commit protocol, one PostgreSQL transaction that moves the staged rows into
the target, advances each position from its fence and marks the batch committed.
"""

from __future__ import annotations

from offsetflow.commit.audit import (
    OPEN_AUDIT_STATUSES,
    Audit,
    diff_window,
    live_only_columns,
    publish_shadow,
    shadow_name,
    table_exists,
    window_digest,
)
from offsetflow.commit.dead_letters import Coordinate, dead_letters_from, route_quality_failures
from offsetflow.commit.incarnations import (
    RangeIncarnation,
    delete_window_dead_letters,
    unknown_rows_error,
    window_incarnations,
)
from offsetflow.commit.partwise import PartwiseCommit
from offsetflow.commit.protocol import (
    already_committed,
    check_fence,
    commit_batch,
    fence_and_advance,
    lock_batch,
    record_batch,
    sink_holds,
)
from offsetflow.commit.rows import TOMBSTONE_ERROR, move_stage_dead_letters
from offsetflow.commit.spec import CommitResult, CommitSpec, ExternalSink, Moved, PartwiseSink
from offsetflow.commit.tables import (
    LINEAGE_COLUMN,
    TOPIC_ID_COLUMN,
    create_stage_tables,
    ensure_dead_letter,
    ensure_target,
    pg_type,
)
from offsetflow.commit.upsert import (
    WINNERS,
    newer_or_same,
    not_deleted,
    remember_deletions,
    stage_winners,
)

__all__ = [
    "Audit",
    "OPEN_AUDIT_STATUSES",
    "diff_window",
    "live_only_columns",
    "publish_shadow",
    "shadow_name",
    "table_exists",
    "window_digest",
    "CommitResult",
    "CommitSpec",
    "Coordinate",
    "ExternalSink",
    "LINEAGE_COLUMN",
    "Moved",
    "PartwiseCommit",
    "PartwiseSink",
    "RangeIncarnation",
    "TOMBSTONE_ERROR",
    "TOPIC_ID_COLUMN",
    "WINNERS",
    "already_committed",
    "check_fence",
    "commit_batch",
    "create_stage_tables",
    "dead_letters_from",
    "delete_window_dead_letters",
    "ensure_dead_letter",
    "ensure_target",
    "fence_and_advance",
    "lock_batch",
    "move_stage_dead_letters",
    "newer_or_same",
    "not_deleted",
    "pg_type",
    "record_batch",
    "remember_deletions",
    "route_quality_failures",
    "sink_holds",
    "stage_winners",
    "unknown_rows_error",
    "window_incarnations",
]
