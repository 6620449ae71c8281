-- The Kafka sink's output schema (issue 30, sink.value_format: avro): the registry schema
-- id a batch's first commit attempt registered (or found) under its subject, pinned for
-- every later attempt, so a retry writes the same schema id even when a new version was
-- registered in between. Its own table, written in its own short transaction before any
-- record is produced: the commit transaction holds the batch row locked (FOR UPDATE), and
-- a pin written there would be lost with a failed attempt. No foreign key to batches for
-- the same reason (its KEY SHARE lock would wait for that row lock).
CREATE TABLE IF NOT EXISTS offsetflow.output_schemas (
    batch_id   bigint PRIMARY KEY,
    subject    text NOT NULL,
    schema_id  integer NOT NULL,
    pinned_at  timestamptz NOT NULL DEFAULT now()
);
