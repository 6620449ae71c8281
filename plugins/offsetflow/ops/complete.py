"""`offsetflow complete`: the way out of a batch an external sink holds that can be neither
run nor abandoned.

The case: a run committed a batch in its Kafka topic or Iceberg table and died before the
ledger's COMMIT; then PostgreSQL crashed (the UNLOGGED stage and markers are emptied) and
retention deleted some of the batch's records. A re-run cannot stage the batch again (its
records are gone: DataLossError; the parts it could still read stay staged), and abandoning
it is refused (its ranges would be planned again and written twice). The sink's own record
is then the only truth left, and this completes the ledger from it, in the commit protocol's
order (`offsetflow.commit.protocol`):
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
    CommitSpec,
    ExternalSink,
    already_committed,
    fence_and_advance,
    lock_batch,
    move_stage_dead_letters,
    record_batch,
)
from offsetflow.config import PipelineConfig
from offsetflow.errors import BatchStateError
from offsetflow.ledger import Batch, Ledger, dead_letter_stage_table, lock_errors
from offsetflow.stage import lock_stage, table_exists

# the offsets of the batch Kafka no longer holds and no staged part holds ("": none)
Unreadable = Callable[[psycopg2.extensions.cursor, Batch], str]


def complete_from_sink(ledger: Ledger, batch_id: int, sink: ExternalSink, reason: str,
                       unreadable: Unreadable, split: int | None = None,
                       dead_letters: CommitSpec | None = None) -> CommitResult:
    """Steps 1-6 of the module docstring, in one ledger transaction. `split`: the config's
    `spark.max_offsets_per_task` (a refusal says to restore the batch's own first);
    `dead_letters`: where the bad records the staged parts hold go (step 5)."""
    try:
        with ledger.transaction() as cur, lock_errors(ledger.dsn, batch_id,
                                                      ledger.conn.get_backend_pid()):
            batch = lock_batch(cur, ledger, batch_id)  # 1
            if batch.status == "committed":
                return already_committed(batch)
            lock_stage(cur, batch_id)  # 2
            gone = unreadable(cur, batch)
            if not gone:
                raise BatchStateError(_runnable(cur, batch, split))
            if batch.moves_positions:  # 3
                fence_and_advance(cur, batch)
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
            if dead_letters is not None and table_exists(cur, dead_letter_stage_table(batch_id)):
                # the bad records the staged parts routed, with their values (the parts'
                # other dead letters are what the sink's record says: review s25 M2)
                move_stage_dead_letters(cur, batch, dead_letters, found)
            result = record_batch(cur, ledger, batch, found, 0, None)  # 5, 6
            read = sum(found.per_range.values()) if found.per_range else (
                found.rows + found.dead)
            cur.execute("UPDATE offsetflow.batches SET error = %s, records_read = %s "
                        "WHERE batch_id = %s",
                        (f"completed from its sink's record by offsetflow complete: {reason} "
                         f"(Kafka no longer holds {gone}, and its stage was lost; bad records "
                         f"of parts no run staged again are not in the dead-letter table)",
                         read, batch_id))
            return result
    finally:
        sink.close()


def unreadable_in(cfg: PipelineConfig) -> Unreadable:
    """Step 2's question for `cfg`'s Kafka cluster. A topic of the batch deleted, or deleted
    and recreated, since it was planned: all its records there are gone (a run refuses such
    a batch: review s25-complete2 H1). Otherwise the offsets Kafka no longer holds and no
    staged part holds (planning asks the same before abandoning: `deleted_before_read`),
    under the batch's own split: a run under another split would drop the stage, but one
    with the split restored finishes the batch from it (review s25-complete2 M1)."""
    from offsetflow.ops.runner import kafka_for
    from offsetflow.plan import changed_topics, deleted_before_read

    kafka = kafka_for(cfg)

    def unreadable(cur: psycopg2.extensions.cursor, batch: Batch) -> str:
        deleted, recreated = changed_topics(cur, kafka, batch)
        if deleted or recreated:
            return "; ".join([f"every record of topic {t} (deleted)" for t in deleted]
                             + [f"every record of topic {t} (deleted and recreated since "
                                f"the batch was planned)" for t in recreated])
        split = batch.split_offsets or cfg.spark.max_offsets_per_task
        return deleted_before_read(cur, batch, kafka, split)

    return unreadable


def _runnable(cur: psycopg2.extensions.cursor, batch: Batch, split: int | None) -> str:
    """The refusal when a re-run can still finish the batch."""
    cur.execute("SELECT count(*) FROM offsetflow.staged_parts WHERE batch_id = %s",
                (batch.batch_id,))
    row = cur.fetchone()
    parts = int(row[0]) if row else 0
    held = (f"its stage holds {parts} part(s) and Kafka still holds the records of the "
            f"others" if parts else "Kafka still holds all of its records")
    restore = (f" with spark.max_offsets_per_task restored to {batch.split_offsets} (the "
               f"batch's split; a run under {split} drops its stage)"
               if parts and split is not None and batch.split_offsets not in (None, split)
               else "")
    return (f"batch {batch.batch_id} is not completed from its sink: {held}. Run it again"
            f"{restore} (offsetflow run-batch --pipeline {batch.pipeline} --batch-id "
            f"{batch.batch_id}), which completes it with its dead letters")
