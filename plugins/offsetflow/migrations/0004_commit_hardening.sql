-- Stage markers live and die with the staged rows they describe. The stage tables are
-- UNLOGGED (no WAL on the append fast path); crash recovery (`pg_ctl stop -m immediate`, a
-- killed backend) empties every unlogged table, and a promoted replica starts with them
-- empty. A logged marker would survive its rows and tell the next run "staged" for data that
-- is gone. Unlogged too, both vanish together and the next run re-stages from Kafka.
ALTER TABLE offsetflow.staged_parts SET UNLOGGED;

-- Keys that an upsert tombstone deleted, with the tombstone's coordinates. A deleted key leaves
-- no row behind, so without this a replay of an older window that set the key would bring it
-- back; with it, a record only re-creates a deleted key if it is at the same or a later offset
-- of the tombstone's partition (the upsert rule, offsetflow/upsert.py).
CREATE TABLE offsetflow.deleted_keys (
    target_table text        NOT NULL,
    key          jsonb       NOT NULL,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    "offset"     bigint      NOT NULL,
    "timestamp"  timestamptz,
    batch_id     bigint      NOT NULL,
    PRIMARY KEY (target_table, key)
);
