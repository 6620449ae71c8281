"""Which ledger this is (migration 0008): a random installation id created once in the
ledger, for sinks that keep their own record of a batch's commit outside PostgreSQL (the
Kafka topic sink's group and offset metadata), so another ledger's batch of the same number
is never taken for this one's."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2.extensions

from offsetflow.errors import BatchStateError


@dataclass(frozen=True)
class LedgerIdentity:
    installation_id: str
    # batches numbered below it may have sink records of the format before the identity
    first_batch_id: int

    def predates(self, batch_id: int) -> bool:
        return batch_id < self.first_batch_id


def ledger_identity(cur: psycopg2.extensions.cursor) -> LedgerIdentity:
    cur.execute("SELECT installation_id, first_batch_id FROM offsetflow.ledger_identity")
    row = cur.fetchone()
    if row is None:  # the migration inserts it; only a hand edit removes it
        raise BatchStateError("the ledger has no identity (table offsetflow.ledger_identity "
                              "is empty); restore its row from a backup of this ledger: a "
                              "new id would make external sinks forget the batches they hold")
    return LedgerIdentity(str(row[0]), int(row[1]))
