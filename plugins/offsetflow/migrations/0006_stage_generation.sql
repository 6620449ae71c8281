-- The stage's generation: bumped whenever a batch's staging is dropped for a new layout (a
-- changed split or config adopted, a transform run starting over, abandon, commit). A run
-- stages under the generation it read together with its split, every marker records it, and
-- the commit refuses markers of another generation: a zombie (an older attempt still
-- running) can no longer leave parts of the old layout that a newer attempt would skip.
ALTER TABLE offsetflow.batches ADD COLUMN stage_generation bigint NOT NULL DEFAULT 0;
-- NULL: a marker written before this migration (or by an older release); never trusted.
ALTER TABLE offsetflow.staged_parts ADD COLUMN generation bigint;
-- batches.stage_layout (0004) is no longer written: a transform run now always starts a new
-- generation (offsetflow.stage.reset.restart_stage), as AQE's coalescing follows more than any
-- recorded setting.
