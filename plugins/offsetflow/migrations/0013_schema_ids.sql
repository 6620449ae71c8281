-- Schema evolution (issue 30): which registry schema ids each batch read. A task records in
-- its part's marker, per topic/partition, each writer schema id of the rows it staged with
-- the first offset of that id (read from the 5-byte header of the staged value); the commit
-- records in the batch row, in its own transaction, each topic's reader schema id and the
-- writer ids of all parts. `offsetflow status` and the lag page show them per batch; the
-- driver checks a batch's schema changes against them before anything is committed.
ALTER TABLE offsetflow.staged_parts ADD COLUMN schema_ids jsonb;
ALTER TABLE offsetflow.batches ADD COLUMN schemas jsonb;
-- The reader schema ids a batch's first run resolved (topic -> id, null: the writer's),
-- pinned for every later run of the batch: a version registered between a failed run and
-- its retry neither changes the columns nor mixes with the stage the first run left.
-- Cleared when the batch adopts a changed config (its stage is dropped then too).
ALTER TABLE offsetflow.batches ADD COLUMN reader_schemas jsonb;
