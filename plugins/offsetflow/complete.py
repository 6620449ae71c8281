"""`offsetflow complete`: the way out of a batch an external sink holds that can be neither
run nor abandoned.

The case: a run committed a batch in its Kafka topic or Iceberg table and died before the
ledger's COMMIT; then PostgreSQL crashed (the UNLOGGED stage and markers are emptied) and
retention deleted some of the batch's records. A re-run cannot stage the batch again (its
records are gone: DataLossError; the parts it could still read stay staged), and abandoning
it is refused (its ranges would be planned again and written twice). The sink's own record
is then the only truth left, and this completes the ledger from it, in the commit protocol's
order (`offsetflow.commit`):
  1. lock the batch row (`lock_batch`); already committed -> nothing to do;
  2. lock the stage (`lock_stage`: a late task's part waits until the stage is dropped),
     then refuse while a re-run could still finish the batch: every offset Kafka no longer
     holds is in a staged part (`unreadable` says which are not). A re-run completes such a
     batch with its dead letters, which this would skip. A partial stage that cannot be
     finished is no reason to refuse (review s24-complete H1): it is dropped in step 6;
  3. fence and advance the positions, as a commit does;
  4. the sink's `find` only, never `write`, told that the stage is gone (the Kafka sink then
     takes its counts and its left-out records from the commit's offset metadata): a batch
     the sink does not hold is refused;
  5. the batch recorded as committed with the sink's counts, its error column saying how it
     was completed (bad records the tasks would have routed were in the lost stage or
     records and are not in the dead-letter table);
  6. the stage dropped (the generation bump refuses a zombie's marker); COMMIT.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg2.extensions

from offsetflow.commit import (
    CommitResult,
    ExternalSink,
    _fence_and_advance,
    already_committed,
    lock_batch,
    record_batch,
)
from offsetflow.commit_locks import lock_errors
from offsetflow.config_schema import PipelineConfig
from offsetflow.errors import BatchStateError
from offsetflow.ledger import Batch, Ledger
from offsetflow.stage_reset import lock_stage

# the offsets of the batch Kafka no longer holds and no staged part holds ("": none)
Unreadable = Callable[[psycopg2.extensions.cursor, Batch], str]


def complete_from_sink(ledger: Ledger, batch_id: int, sink: ExternalSink, reason: str,
                       unreadable: Unreadable) -> CommitResult:
    """Steps 1-6 of the module docstring, in one ledger transaction."""
    try:
        with ledger.transaction() as cur, lock_errors(ledger.dsn, batch_id,
                                                      ledger.conn.get_backend_pid()):
            batch = lock_batch(cur, ledger, batch_id)  # 1
            if batch.status == "committed":
                return already_committed(batch)
            lock_stage(cur, batch_id)  # 2
            gone = unreadable(cur, batch)
            if not gone:
                raise BatchStateError(_runnable(cur, batch))
            if batch.moves_positions:  # 3
                _fence_and_advance(cur, batch)
            completing = getattr(sink, "completing", None)
            if completing is not None:  # its counts from its own record, not the stage
                completing()
            found = sink.find(cur, batch)  # 4
            if found is None:
                raise BatchStateError(
                    f"batch {batch_id} is not completed: its sink does not hold it, so "
                    f"nothing of it was written there. Run it (offsetflow run-batch "
                    f"--pipeline {batch.pipeline} --batch-id {batch_id}), or, if its records "
                    f"are gone from Kafka, abandon it (offsetflow abandon --batch-id "
                    f"{batch_id} --reason '...')")
            result = record_batch(cur, ledger, batch, found, 0, None)  # 5, 6
            read = sum(found.per_range.values()) if found.per_range else (
                found.rows + found.dead)
            cur.execute("UPDATE offsetflow.batches SET error = %s, records_read = %s "
                        "WHERE batch_id = %s",
                        (f"completed from its sink's record by offsetflow complete: {reason} "
                         f"(Kafka no longer holds {gone}, and its stage was lost; bad records "
                         f"the tasks would have routed are not in the dead-letter table)",
                         read, batch_id))
            return result
    finally:
        sink.close()


def unreadable_in(cfg: PipelineConfig) -> Unreadable:
    """Step 2's question for `cfg`'s Kafka cluster (planning asks it before abandoning a
    batch: `_deleted_before_read`)."""
    from offsetflow.planning import _deleted_before_read
    from offsetflow.runner import kafka_for

    kafka = kafka_for(cfg)
    return lambda cur, batch: _deleted_before_read(cur, batch, kafka, cfg)


def _runnable(cur: psycopg2.extensions.cursor, batch: Batch) -> str:
    """The refusal when a re-run can still finish the batch."""
    cur.execute("SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s",
                (batch.batch_id,))
    row = cur.fetchone()
    parts = int(row[0]) if row else 0
    held = (f"its stage holds {parts} part(s) and Kafka still holds the records of the "
            f"others" if parts else "Kafka still holds all of its records")
    return (f"batch {batch.batch_id} is not completed from its sink: {held}. Run it again "
            f"(offsetflow run-batch --pipeline {batch.pipeline} --batch-id "
            f"{batch.batch_id}), which completes it with its dead letters")
