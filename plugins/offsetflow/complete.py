"""`offsetflow complete`: the way out of a batch an external sink holds that can be neither
run nor abandoned.

The case: a run committed a batch in its Kafka topic or Iceberg table and died before the
ledger's COMMIT; then PostgreSQL crashed (the UNLOGGED stage and markers are emptied) and
retention deleted the batch's records. A re-run cannot stage the batch again (its records
are gone: DataLossError), and abandoning it is refused (its ranges would be planned again and
written twice). The sink's own record is then the only truth left, and this completes the
ledger from it, in the commit protocol's order (`offsetflow.commit`):
  1. lock the batch row (`lock_batch`); already committed -> nothing to do;
  2. refuse while the stage still holds parts: a re-run completes such a batch with its dead
     letters, which this would skip;
  3. fence and advance the positions, as a commit does;
  4. the sink's `find` only, never `write`: a batch the sink does not hold is refused;
  5. the batch recorded as committed, its error column saying how it was completed (dead
     letters it may have had were in the lost stage and are not in the dead-letter table);
  6. the stage dropped; COMMIT.
"""

from __future__ import annotations

from offsetflow.commit import (
    CommitResult,
    ExternalSink,
    _fence_and_advance,
    already_committed,
    lock_batch,
    record_batch,
)
from offsetflow.commit_locks import lock_errors
from offsetflow.errors import BatchStateError
from offsetflow.ledger import Ledger


def complete_from_sink(ledger: Ledger, batch_id: int, sink: ExternalSink,
                       reason: str) -> CommitResult:
    """Steps 1-6 of the module docstring, in one ledger transaction."""
    try:
        with ledger.transaction() as cur, lock_errors(ledger.dsn, batch_id,
                                                      ledger.conn.get_backend_pid()):
            batch = lock_batch(cur, ledger, batch_id)  # 1
            if batch.status == "committed":
                return already_committed(batch)
            cur.execute("SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s",
                        (batch_id,))
            row = cur.fetchone()
            if row and int(row[0]):  # 2
                raise BatchStateError(
                    f"batch {batch_id} is not completed from its sink: its stage still holds "
                    f"{int(row[0])} part(s). Run it again, which completes it with its dead "
                    f"letters: offsetflow run-batch --pipeline {batch.pipeline} --batch-id "
                    f"{batch_id}")
            if batch.moves_positions:  # 3
                _fence_and_advance(cur, batch)
            found = sink.find(cur, batch)  # 4
            if found is None:
                raise BatchStateError(
                    f"batch {batch_id} is not completed: its sink does not hold it, so "
                    f"nothing of it was written there. Run it (offsetflow run-batch "
                    f"--pipeline {batch.pipeline} --batch-id {batch_id}), or, if its records "
                    f"are gone from Kafka, abandon it (offsetflow abandon --batch-id "
                    f"{batch_id} --reason '...')")
            result = record_batch(cur, ledger, batch, found, 0, None)  # 5, 6
            cur.execute("UPDATE offsetflow.batches SET error = %s WHERE batch_id = %s",
                        (f"completed from its sink's record by offsetflow complete: {reason} "
                         f"(its stage and Kafka records were gone; dead letters it may have "
                         f"had are not in the dead-letter table)", batch_id))
            return result
    finally:
        sink.close()
