-- The ledger's identity (one row, created once): an external sink that keeps its own record
-- of a batch's commit (the Kafka topic sink's offset metadata and group) names the ledger
-- with it, so two ledgers (staging and prod, or a ledger recreated from scratch) running a
-- pipeline of the same name against one cluster never take each other's records. Not a
-- secret: a random id. A restored dump keeps it (the same ledger) but rewinds positions and
-- batch ids: the Kafka sink refuses a batch whose group holds a commit of this ledger above
-- its from_offset that the ledger does not know (sink_kafka_form.refuse_group_ahead).
CREATE TABLE offsetflow.ledger_identity (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    installation_id text        NOT NULL,
    -- batches numbered below this may have been written before the identity existed; their
    -- sink records may be in the older format (no ledger id), which is looked up for them only
    first_batch_id  bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
INSERT INTO offsetflow.ledger_identity (installation_id, first_batch_id)
SELECT replace(gen_random_uuid()::text, '-', ''), s.last_value + 1
  FROM offsetflow.batches_batch_id_seq s;
