-- The split of a batch's ranges into Spark parts (spark.max_offsets_per_task when it was
-- planned or last run). Kept apart from config_fingerprint: a changed split changes how the
-- batch is staged (so earlier attempts' parts are dropped), not what it writes, so it needs no
-- --accept-config-change. NULL for batches planned before this migration (their fingerprint
-- has the split hashed in; see offsetflow.config.loader.config_drift).
ALTER TABLE offsetflow.batches ADD COLUMN split_offsets bigint;
