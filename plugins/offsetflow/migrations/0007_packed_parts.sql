-- Packing small sub-ranges into tasks (offsetflow.stage.packing): a stage part of the fused path
-- reads a group of sub-ranges of the batch's split. The group each part stands for follows
-- from the split and the task count a batch is packed into, recorded on its first run (NULL:
-- not packed, part k is sub-range k), so every attempt of the batch draws the same parts.
ALTER TABLE offsetflow.batches ADD COLUMN pack_tasks integer;
-- the sub-ranges (indices into the split) a part's task read; NULL: a marker written before
-- this migration, or one of the transform path, where parts are Spark's partitions
ALTER TABLE offsetflow.staged_parts ADD COLUMN subranges integer[];
