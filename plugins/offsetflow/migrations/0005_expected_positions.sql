-- The committed position each range of a batch expects to find at commit time (the fence).
-- Usually the range's from_offset; under `data_loss: continue` a range starts at the new
-- earliest offset while the position still holds the old one, so the fence compares the
-- position with this value instead. NULL (batches planned before 0005, backfills, replays):
-- the range's from_offset.
ALTER TABLE offsetflow.batch_ranges ADD COLUMN expected_position bigint;
