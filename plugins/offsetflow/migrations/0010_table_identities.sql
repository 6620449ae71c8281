-- The Iceberg table each pipeline's batches live in (issue 28): a table dropped, renamed,
-- replaced (dropped and created again), registered from older metadata, or reached through
-- another catalog, namespace or table name was taken for the pipeline's table, and the next
-- run wrote an empty new one while the committed history stayed behind. The sink records the
-- table's identity when it first creates or uses it, checks it before anything is written
-- (and before maintenance acts), and moves it on in each batch's commit transaction. Only
-- `offsetflow adopt-table` records another table for a pipeline (`history` keeps the earlier
-- ones with the operator's reason). Not named iceberg_tables: pyiceberg's SQL catalog keeps
-- its tables in an unqualified `iceberg_tables`, which a role named offsetflow (search_path
-- "$user", public) would resolve to this schema's.
CREATE TABLE offsetflow.table_identities (
    pipeline             text        NOT NULL,
    -- '' the pipeline's own table (sink.table); else the table a backfill named
    target               text        NOT NULL,
    identifier           text        NOT NULL,  -- namespace.table, where it was found last
    catalog              text        NOT NULL,  -- type, name and where it lives; no secrets
    -- NULL: the next run takes the table it finds or creates (adopt-table of no table)
    table_uuid           text,
    location             text,
    -- the table's metadata after the ledger's last commit into it (the file to register
    -- again if the table is dropped), its last-sequence-number (never lower in the same
    -- table's later metadata) and the snapshot of that batch
    metadata_location    text,
    last_sequence_number bigint,
    last_snapshot_id     bigint,
    last_batch_id        bigint,   -- NULL: no batch committed into it yet
    recorded_at          timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),
    history              jsonb       NOT NULL DEFAULT '[]',
    PRIMARY KEY (pipeline, target)
);
