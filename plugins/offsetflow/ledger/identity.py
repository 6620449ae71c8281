"""Which ledger this is (migration 0008): a random installation id created once in the
ledger, for sinks that keep their own record of a batch's commit outside PostgreSQL (the
Kafka topic sink's group and offset metadata), so another ledger's batch of the same number
is never taken for this one's.

A copy of a ledger (staging built from a prod dump, CREATE DATABASE ... TEMPLATE) carries
the id along, and would share prod's transactional.id and group. No signal tells a copy from
the same ledger restored elsewhere, so the id records where it was made (`Home`: database
name, and the server's system identifier where readable) and is refused in any other
database until the operator says which it is: `offsetflow db new-identity` (a copy: an id of
its own) or `offsetflow db adopt-identity` (the same ledger, restored or moved)."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg2.errors
import psycopg2.extensions

from offsetflow.errors import BatchStateError, LedgerIdentityError

# the server's system identifier, NULL where pg_control_system() is not executable
_SYSTEM_ID = ("CASE WHEN has_function_privilege('pg_catalog.pg_control_system()', 'EXECUTE') "
              "THEN (SELECT system_identifier::text FROM pg_catalog.pg_control_system()) END")


@dataclass(frozen=True)
class Home:
    """Where an identity was made, or where the ledger is now."""

    database: str
    system_id: str | None

    def differs(self, other: Home) -> bool:
        """Another database: another name, or another server where both ids are known."""
        return self.database != other.database or (
            self.system_id is not None and other.system_id is not None
            and self.system_id != other.system_id)

    def __str__(self) -> str:
        return f"database {self.database} (server system identifier {self.system_id or '?'})"


@dataclass(frozen=True)
class LedgerIdentity:
    installation_id: str
    # batches numbered below it may have sink records of the format before the identity
    first_batch_id: int

    def predates(self, batch_id: int) -> bool:
        return batch_id < self.first_batch_id


def ledger_identity(cur: psycopg2.extensions.cursor) -> LedgerIdentity:
    """This ledger's identity; refused in another database than the one it was made in."""
    try:
        cur.execute(f"""SELECT installation_id, first_batch_id, home_database, home_system_id,
                               current_database(), {_SYSTEM_ID}
                          FROM offsetflow.ledger_identity""")
    except psycopg2.errors.UndefinedTable as e:
        raise BatchStateError("the ledger has no table offsetflow.ledger_identity (migration "
                              "0008): this version needs its schema upgraded; run offsetflow "
                              "db upgrade") from e
    row = cur.fetchone()
    if row is None:  # the migration inserts it; only a hand edit removes it
        raise BatchStateError("the ledger has no identity (table offsetflow.ledger_identity "
                              "is empty); restore its row from a backup of this ledger: a "
                              "new id would make external sinks forget the batches they hold")
    home, here = Home(row[2], row[3]), Home(row[4], row[5])
    if home.differs(here):
        raise LedgerIdentityError(
            f"the ledger's identity {row[0]} was made in {home}, and this is {here}: a copy "
            f"of a ledger (staging built from a prod dump) would share the original's Kafka "
            f"transactional.id and group, fencing its runs and overwriting its record of "
            f"commits. If this ledger is a copy, give it its own identity: offsetflow --dsn "
            f"<this ledger> db new-identity. If it is the same ledger restored or moved "
            f"(the original is gone or no longer runs), keep the identity: offsetflow --dsn "
            f"<this ledger> db adopt-identity")
    return LedgerIdentity(str(row[0]), int(row[1]))


def new_identity(cur: psycopg2.extensions.cursor) -> str:
    """A copy's own identity (random, made here); its batches' sink records then never
    mix with the original's. Returns the new id."""
    cur.execute(f"""UPDATE offsetflow.ledger_identity
                       SET installation_id = replace(gen_random_uuid()::text, '-', ''),
                           created_at = now(), home_database = current_database(),
                           home_system_id = {_SYSTEM_ID}
                    RETURNING installation_id""")
    row = cur.fetchone()
    if row is None:
        raise BatchStateError("the ledger has no identity row; run offsetflow db upgrade")
    return str(row[0])


def adopt_identity(cur: psycopg2.extensions.cursor) -> str:
    """Keep the identity in this database (the same ledger, restored or moved). Returns it."""
    cur.execute(f"""UPDATE offsetflow.ledger_identity
                       SET home_database = current_database(), home_system_id = {_SYSTEM_ID}
                    RETURNING installation_id""")
    row = cur.fetchone()
    if row is None:
        raise BatchStateError("the ledger has no identity row; run offsetflow db upgrade")
    return str(row[0])
