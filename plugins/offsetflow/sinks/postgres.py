"""PostgreSQL as the sink (the default): the batch's rows go into `sink.table` in the ledger's
own commit transaction (`offsetflow.commit.protocol`'s step 4, `move_rows`), so there is
no separate sink to commit, find or sweep."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg2.extensions

from offsetflow.commit import CommitSpec, ExternalSink, ensure_target
from offsetflow.errors import BatchStateError
from offsetflow.ledger import Batch
from offsetflow.sinks.base import Sink


class PostgresSink(Sink):
    """`sink.type: postgres`: append, or upsert on `sink.key`."""

    def prepare_target(self, cur: psycopg2.extensions.cursor, batch: Batch,
                       columns: Sequence[tuple[str, str]], evolved: Sequence[str] = ()
                       ) -> bool:
        """The batch's target table (the pipeline's, or the one a backfill named), created
        with its lineage column and indexes, or checked to fit; the `evolved` columns an
        existing table lacks are the commit's to add (in its transaction)."""
        return ensure_target(cur, batch.target_table, columns, self.cfg.sink.mode,
                             self.cfg.sink.key, evolved)

    @property
    def commits_partwise(self) -> bool:
        """An append moves each part as its task staged it; an upsert keeps the latest
        record per key across the whole batch, so it waits for all parts."""
        return self.cfg.sink.mode == "append"

    def external(self, dsn: str, columns: Sequence[tuple[str, str]] | None = None,
                 spec: CommitSpec | None = None) -> None:
        """None: step 4 runs in the ledger's transaction."""
        return None

    def complete_from(self, dsn: str, batch: Batch) -> ExternalSink:
        raise BatchStateError(
            f"batch {batch.batch_id}: pipeline {batch.pipeline} writes to PostgreSQL, "
            f"where rows and ledger commit together; there is no sink record to complete "
            f"it from (run it, or abandon it)")

    @property
    def reset_rows_table(self) -> str | None:
        """The pipeline's table in append mode; upsert rows cannot collide: a recreated
        topic's records replace its old incarnation's (`offsetflow.commit.upsert`)."""
        return self.cfg.sink.table if self.cfg.sink.mode == "append" else None
