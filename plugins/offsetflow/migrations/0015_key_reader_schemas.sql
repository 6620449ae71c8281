-- Avro keys (format.key: {type: avro}): the key reader schema ids a batch's first run
-- resolved (topic -> id of its `<topic>-key` subject's latest, null: each key is read with
-- its writer schema), pinned for every later run of the batch as `reader_schemas` pins the
-- values' (0013): a key schema version registered between a failed run and its retry would
-- otherwise fill the key columns of the retry's rows differently from the first run's.
-- Cleared with `reader_schemas` when the batch adopts a changed config.
ALTER TABLE offsetflow.batches ADD COLUMN key_reader_schemas jsonb;
