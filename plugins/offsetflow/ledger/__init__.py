"""The ledger: the PostgreSQL tables that are the single system of record for batches,
their ranges and the committed positions; its sessions, locks, identity and migrations.
"""

from __future__ import annotations

from offsetflow.ledger.batch import OPEN_STATUSES, Batch
from offsetflow.ledger.identity import (
    LedgerIdentity,
    adopt_identity,
    ledger_identity,
    new_identity,
)
from offsetflow.ledger.locks import lock_errors, lock_timeout_s
from offsetflow.ledger.migrate import refuse_newer_ledger
from offsetflow.ledger.run_lock import hold_run_lock, run_holders
from offsetflow.ledger.session import connect
from offsetflow.ledger.store import (
    Ledger,
    dead_letter_stage_table,
    qualified,
    stage_part_table,
    stage_table,
)
from offsetflow.ledger.task_files import (
    drop_committed_task_files,
    drop_named_task_files,
    ledger_files_glob,
    sweep_task_files,
    task_file_entries,
)
from offsetflow.ledger.timing import Due, batch_stats

__all__ = [
    "Batch",
    "Due",
    "Ledger",
    "LedgerIdentity",
    "OPEN_STATUSES",
    "adopt_identity",
    "batch_stats",
    "connect",
    "dead_letter_stage_table",
    "drop_committed_task_files",
    "drop_named_task_files",
    "ledger_files_glob",
    "sweep_task_files",
    "task_file_entries",
    "hold_run_lock",
    "ledger_identity",
    "lock_errors",
    "lock_timeout_s",
    "new_identity",
    "qualified",
    "refuse_newer_ledger",
    "run_holders",
    "stage_part_table",
    "stage_table",
]
