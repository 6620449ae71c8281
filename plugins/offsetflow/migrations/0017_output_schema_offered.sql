-- A pinned output schema id (migration 0016) is the batch's only for what it was
-- registered for: `offered` is a digest of the registry URL (no credentials; an id means
-- nothing in another registry), the subject and the schema text the attempt offered. An
-- attempt that offers another (the batch adopted a changed config with
-- --accept-config-change, a transform's columns changed, another registry) registers its
-- own and pins it again: nothing of the batch is in Kafka then (a Kafka commit is found
-- before a pin is read), and the old schema would drop the new columns or null renamed ones.
-- NULL: a pin made before this column, kept as it is.
ALTER TABLE offsetflow.output_schemas ADD COLUMN IF NOT EXISTS offered text;
