-- The ledger: batches, their ranges, committed positions and every change to them.
CREATE SCHEMA IF NOT EXISTS offsetflow;
CREATE SCHEMA IF NOT EXISTS offsetflow_stage;

CREATE TABLE offsetflow.batches (
    batch_id           bigserial PRIMARY KEY,
    pipeline           text        NOT NULL,
    kind               text        NOT NULL CHECK (kind IN ('scheduled', 'backfill', 'replay')),
    status             text        NOT NULL
                       CHECK (status IN ('planned', 'running', 'failed', 'committed', 'abandoned')),
    config_fingerprint text,
    target_table       text        NOT NULL,
    moves_positions    boolean     NOT NULL DEFAULT true,
    started_by         text        NOT NULL DEFAULT 'unknown',
    params             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    planned_at         timestamptz NOT NULL DEFAULT now(),
    started_at         timestamptz,
    finished_at        timestamptz,
    attempts           integer     NOT NULL DEFAULT 0,
    records_read       bigint,
    rows_written       bigint,
    bad_records        bigint,
    error              text,
    quality            jsonb,
    timings            jsonb
);
CREATE INDEX batches_pipeline_idx ON offsetflow.batches (pipeline, batch_id DESC);
-- At most one open scheduled batch per pipeline: a second planner cannot create an overlap.
CREATE UNIQUE INDEX batches_one_open_scheduled
    ON offsetflow.batches (pipeline)
    WHERE kind = 'scheduled' AND status IN ('planned', 'running', 'failed');

CREATE TABLE offsetflow.batch_ranges (
    batch_id     bigint  NOT NULL REFERENCES offsetflow.batches ON DELETE CASCADE,
    topic        text    NOT NULL,
    partition    integer NOT NULL CHECK (partition >= 0),
    from_offset  bigint  NOT NULL CHECK (from_offset >= 0),
    until_offset bigint  NOT NULL,
    records      bigint,
    PRIMARY KEY (batch_id, topic, partition),
    CHECK (until_offset >= from_offset)
);

CREATE TABLE offsetflow.positions (
    pipeline    text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    next_offset bigint      NOT NULL CHECK (next_offset >= 0),
    batch_id    bigint,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, topic, partition)
);

CREATE TABLE offsetflow.position_history (
    id         bigserial PRIMARY KEY,
    pipeline   text        NOT NULL,
    topic      text        NOT NULL,
    partition  integer     NOT NULL,
    old_offset bigint,
    new_offset bigint      NOT NULL,
    batch_id   bigint,
    reason     text        NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX position_history_idx ON offsetflow.position_history (pipeline, topic, partition, id);

CREATE TABLE offsetflow.data_loss (
    id            bigserial PRIMARY KEY,
    pipeline      text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL,
    missing_from  bigint      NOT NULL,
    missing_until bigint      NOT NULL,
    policy        text        NOT NULL,
    batch_id      bigint,
    detected_at   timestamptz NOT NULL DEFAULT now()
);

-- One row per staged Spark partition: written in the same transaction as its rows, so a
-- retried task finds it and does not stage twice.
CREATE TABLE offsetflow.staged_parts (
    batch_id      bigint      NOT NULL,
    kind          text        NOT NULL CHECK (kind IN ('rows', 'bad')),
    part          integer     NOT NULL,
    chunk         integer     NOT NULL DEFAULT 0,
    rows_staged   bigint      NOT NULL,
    bad_records   bigint      NOT NULL,
    per_partition jsonb       NOT NULL DEFAULT '{}'::jsonb,
    staged_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (batch_id, kind, part, chunk)
);
