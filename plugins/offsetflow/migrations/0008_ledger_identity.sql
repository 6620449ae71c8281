-- The ledger's identity (one row, created once): an external sink that keeps its own record
-- of a batch's commit (the Kafka topic sink's offset metadata and group) names the ledger
-- with it, so two ledgers (staging and prod, or a ledger recreated from scratch) running a
-- pipeline of the same name against one cluster never take each other's records. Not a
-- secret: a random id. A restored dump keeps it (the same ledger) but rewinds positions and
-- batch ids: the Kafka sink refuses a batch whose group holds a commit of this ledger above
-- its from_offset that the ledger does not know (sink_kafka_mark.refuse_group_ahead).
-- A copy keeps it too: home_* record where it was made (the database's name and, where
-- readable, the server's system identifier); elsewhere it is refused until the operator
-- says which it is (offsetflow db new-identity: a copy; db adopt-identity: the same ledger).
CREATE TABLE offsetflow.ledger_identity (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    installation_id text        NOT NULL,
    -- batches numbered below this may have been written before the identity existed; their
    -- sink records may be in the older format (no ledger id), which is looked up for them only
    first_batch_id  bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    home_database   text        NOT NULL DEFAULT current_database(),
    -- NULL: pg_control_system() was not executable for the ledger's role
    home_system_id  text
);
INSERT INTO offsetflow.ledger_identity (installation_id, first_batch_id, home_system_id)
SELECT replace(gen_random_uuid()::text, '-', ''),
       -- the id the sequence hands out next (a fresh one, is_called false: last_value)
       CASE WHEN s.is_called THEN s.last_value + 1 ELSE s.last_value END,
       CASE WHEN has_function_privilege('pg_catalog.pg_control_system()', 'EXECUTE')
            THEN (SELECT system_identifier::text FROM pg_catalog.pg_control_system()) END
  FROM offsetflow.batches_batch_id_seq s;
