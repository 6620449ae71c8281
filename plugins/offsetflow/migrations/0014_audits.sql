-- Audit before publish (issue 33): a replay or backfill run with --audit writes its window
-- into a shadow table beside the live one (the target's columns), is diffed against the live
-- rows at the same coordinates, then published (delete-by-coordinates + insert from the
-- shadow, in one transaction with this row) or discarded (the shadow dropped). One row per
-- audited window; its id is the window's first batch id (the shadow is <table>__audit_<id>).
CREATE TABLE offsetflow.audits (
    audit_id          bigint      PRIMARY KEY,
    pipeline          text        NOT NULL,
    kind              text        NOT NULL CHECK (kind IN ('replay', 'backfill')),
    batch_ids         bigint[]    NOT NULL,
    target_table      text        NOT NULL,   -- the live table publish writes into
    shadow_table      text        NOT NULL,
    dead_letter_table text,                   -- the live dead-letter table
    shadow_dead_letter_table text,
    ranges            jsonb       NOT NULL,   -- the window, [{topic, partition, from, until}]
    -- staging: batches planned/running into the shadow; staged: all committed there;
    -- audited: diffed (the diff and the live window's digest below); published | discarded
    status            text        NOT NULL CHECK (status IN ('staging', 'staged', 'audited',
                                                             'published', 'discarded')),
    staged_by         text        NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    staged_at         timestamptz,
    audited_by        text,
    audited_at        timestamptz,
    audit             jsonb,                  -- the diff and quality results shown
    live_digest       text,                   -- the live window the diff compared against
    closed_by         text,
    closed_at         timestamptz,
    reason            text,
    history           jsonb       NOT NULL DEFAULT '[]'   -- every transition, who, when
);
CREATE INDEX audits_open ON offsetflow.audits (pipeline)
    WHERE status IN ('staging', 'staged', 'audited');
