-- Kafka topic ids: a topic deleted and recreated under the same name gets a new id, and its
-- offsets start again at 0. Positions remember the id they belong to, so planning can refuse
-- to continue from a position of the old topic instead of silently skipping or re-reading.
ALTER TABLE offsetflow.batch_ranges ADD COLUMN topic_id text;
ALTER TABLE offsetflow.positions ADD COLUMN topic_id text;
