-- Batch timings (issue 31): when a batch was due, when its read/stage ended and when it
-- committed, and what follows from them (scheduling delay, processing time, total delay,
-- input and processing rate), like Spark's Streaming Statistics per batch.
-- due_at: the DAG run's data interval end (scheduled runs) or the trigger's time (manual
-- runs, Airflow backfills, OffsetFlow backfills and replays); the plan time for CLI runs.
-- due_source says which ('schedule', 'trigger', 'plan'). NULL on batches planned before 0011.
-- staged_at: the committing attempt's read+stage ended (every part staged; the driver reads
-- the ledger's clock then and the commit keeps it). committed_at: the database's clock just
-- before COMMIT (finished_at is the commit transaction's start, which a part-by-part commit
-- opens while the tasks still read). All on the ledger database's clock except due_at.
-- stats: the derived figures, computed in the commit transaction
-- (offsetflow.ledger.timing.batch_stats); NULL until the batch commits.
ALTER TABLE offsetflow.batches
    ADD COLUMN due_at       timestamptz,
    ADD COLUMN due_source   text,
    ADD COLUMN staged_at    timestamptz,
    ADD COLUMN committed_at timestamptz,
    ADD COLUMN stats        jsonb;
