"""The Batch record: one row of `offsetflow.batches` with its ranges, as the ledger reads
it (`offsetflow.ledger.store`). No I/O here, so pure modules (the sinks' rules, planning's
checks) can take a Batch without the PostgreSQL adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from offsetflow.ranges import OffsetRange

OPEN_STATUSES = ("planned", "running", "failed")
KINDS = ("scheduled", "backfill", "replay")


@dataclass(frozen=True)
class Batch:
    batch_id: int
    pipeline: str
    kind: str
    status: str
    ranges: tuple[OffsetRange, ...]
    target_table: str
    moves_positions: bool = True
    config_fingerprint: str | None = None
    started_by: str = "unknown"
    params: dict[str, Any] = field(default_factory=dict)
    planned_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0
    records_read: int | None = None
    rows_written: int | None = None
    bad_records: int | None = None
    error: str | None = None
    quality: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    split_offsets: int | None = None  # its ranges' split into Spark parts; None before 0003
    # batch timings (0011, `offsetflow.ledger.timing`); None on batches planned before it
    due_at: datetime | None = None
    due_source: str | None = None
    staged_at: datetime | None = None
    committed_at: datetime | None = None
    stats: dict[str, Any] | None = None
    # registry formats, once committed: {"readers": {topic: id}, "writers": {topic: {id:
    # [partition, first offset]}}} (migration 0013)
    schemas: dict[str, Any] | None = None

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_STATUSES

    @property
    def audit_id(self) -> int | None:
        """The audited window (`offsetflow.ops.audit`) this batch stages, if any."""
        audit = self.params.get("audit")
        return int(audit["audit_id"]) if isinstance(audit, dict) else None

    def dead_letters_into(self, table: str) -> str:
        """Where this batch's dead letters go: the pipeline's `table`, or the shadow of it
        an audited window writes instead (published with the rows)."""
        audit = self.params.get("audit")
        if isinstance(audit, dict) and audit.get("shadow_dead_letter_table"):
            return str(audit["shadow_dead_letter_table"])
        return table

    @property
    def offset_span(self) -> int:
        return sum(r.span for r in self.ranges)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "batch_id", "pipeline", "kind", "status", "target_table", "moves_positions",
            "started_by", "params", "attempts", "records_read", "rows_written", "bad_records",
            "error", "quality", "timings", "due_source", "stats", "schemas")}
        for k in ("planned_at", "started_at", "finished_at", "due_at", "staged_at",
                  "committed_at"):
            v = getattr(self, k)
            d[k] = v.isoformat() if v else None
        d["ranges"] = [r.to_dict() for r in self.ranges]
        return d
