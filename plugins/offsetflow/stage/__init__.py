"""Step 2 in the Spark tasks: each task's part of the batch's stage and its marker,
written in one transaction, so a retried task never stages twice; and the driver's reads
and resets of those parts.
"""

from __future__ import annotations

from offsetflow.stage.bad_records import BadBuffer, BadRows
from offsetflow.stage.form import stage_form
from offsetflow.stage.layout import Marker
from offsetflow.stage.markers import (
    bad_record_summary,
    staged_per_range,
    staged_rows,
    staged_schema_ids,
    task_bad_records,
)
from offsetflow.stage.metrics import TaskClock
from offsetflow.stage.packing import Packing, pack, task_count
from offsetflow.stage.part import SubrangeBad, note_schema_ids, stage_rows
from offsetflow.stage.payload import binary_encoder, csv_bytes
from offsetflow.stage.reset import (
    check_layout,
    check_markers,
    claim_pack_tasks,
    forget_parts,
    layout_of,
    lock_stage,
    stage_generation,
    table_exists,
)

__all__ = [
    "BadBuffer",
    "BadRows",
    "Marker",
    "Packing",
    "SubrangeBad",
    "TaskClock",
    "bad_record_summary",
    "binary_encoder",
    "check_layout",
    "check_markers",
    "claim_pack_tasks",
    "csv_bytes",
    "forget_parts",
    "layout_of",
    "lock_stage",
    "pack",
    "stage_form",
    "stage_generation",
    "note_schema_ids",
    "stage_rows",
    "staged_per_range",
    "staged_schema_ids",
    "staged_rows",
    "table_exists",
    "task_bad_records",
    "task_count",
]
