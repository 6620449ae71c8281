-- Stage markers live and die with the staged rows they describe. The stage tables are
-- UNLOGGED (no WAL on the append fast path); crash recovery (`pg_ctl stop -m immediate`, a
-- killed backend) empties every unlogged table, and a promoted replica starts with them
-- empty. A logged marker would survive its rows and tell the next run "staged" for data that
-- is gone. Unlogged too, both vanish together and the next run re-stages from Kafka.
ALTER TABLE offsetflow.staged_parts SET UNLOGGED;

-- Keys that an upsert tombstone deleted, with the tombstone's coordinates. A deleted key leaves
-- no row behind, so without this a replay of an older window that set the key would bring it
-- back; with it, a record only re-creates a deleted key if it is newer by the upsert rule
-- (offsetflow/commit/upsert.py). `target_table` is canonical (`schema.table`); `key` is the key
-- columns as a JSON array, rendered in a UTC session; `_offsetflow_topic_id` is the Kafka
-- topic id of the tombstone's topic incarnation, as on upsert targets.
CREATE TABLE offsetflow.deleted_keys (
    target_table          text        NOT NULL,
    key                   jsonb       NOT NULL,
    topic                 text        NOT NULL,
    partition             integer     NOT NULL,
    "offset"              bigint      NOT NULL,
    "timestamp"           timestamptz,
    _offsetflow_topic_id  text,
    batch_id              bigint      NOT NULL,
    PRIMARY KEY (target_table, key)
);

-- The order of a topic's incarnations (deleted and recreated under the same name, offsets
-- start again at 0): the first batch that read an incarnation. Topic ids themselves are
-- random. NULL for an id no batch recorded.
CREATE INDEX batch_ranges_topic_id_idx ON offsetflow.batch_ranges (topic, topic_id, batch_id);
CREATE FUNCTION offsetflow.topic_epoch(p_topic text, p_topic_id text) RETURNS bigint
    LANGUAGE sql STABLE AS
    $$ SELECT min(batch_id) FROM offsetflow.batch_ranges
        WHERE topic = p_topic AND topic_id = p_topic_id $$;

-- The transform path's staging layout (Spark's partition count of the transform's output,
-- which numbers the stage parts): an attempt whose layout differs drops earlier staging
-- rather than skipping parts numbered the old way (offsetflow.commit.protocol.claim_stage_layout).
ALTER TABLE offsetflow.batches ADD COLUMN stage_layout text;
