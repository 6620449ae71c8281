"""PostgreSQL sessions with OffsetFlow's settings: every connection to the ledger or a sink
database (driver, Spark tasks, run locks) is opened by `connect`, so all of them read
committed, render timestamps in UTC and notice a dead peer in about a minute.
"""

from __future__ import annotations

from typing import Any

import psycopg2
import psycopg2.extensions

# Server-side settings of every OffsetFlow session (libpq `options`):
#  - READ COMMITTED whatever the database's default: `PartwiseCommit` polls for new stage
#    markers inside one long transaction, and under `repeatable read` it would never see them;
#  - TimeZone UTC: timestamps rendered as text (deleted_keys' JSON keys) never depend on a
#    server's or role's default;
#  - TCP keepalives on the server's socket: a driver whose host dies mid-commit (no FIN, no
#    RST) loses its session, and the row locks its commit holds, in about a minute instead
#    of the kernel's ~2 h (settings every supported PostgreSQL version knows).
SESSION_OPTIONS = ("-c default_transaction_isolation=read\\ committed -c timezone=UTC "
                   "-c tcp_keepalives_idle=30 -c tcp_keepalives_interval=10 "
                   "-c tcp_keepalives_count=3")
# The text every OffsetFlow session sends and reads is UTF-8 (binary COPY of the stage, the
# Kafka sink's JSON): a libpq startup parameter of its own, so it beats a role's or
# database's client_encoding, PGCLIENTENCODING, and a DSN's client_encoding or `options`.
# With LATIN1 there, staged text became mojibake ("café" read back as "cafÃ©") silently
CLIENT_ENCODING = "UTF8"
# libpq's keepalives: the client side notices a dead server the same way
CLIENT_KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 30,
                                     "keepalives_interval": 10, "keepalives_count": 3}


def connect(dsn: str) -> psycopg2.extensions.connection:
    """Open a connection with OffsetFlow's session settings (`SESSION_OPTIONS`); the DSN is
    never logged (it holds the password). Options a DSN sets itself come after ours."""
    dsn_opts = psycopg2.extensions.parse_dsn(dsn).get("options", "")
    conn = psycopg2.connect(dsn, application_name="offsetflow", connect_timeout=10,
                            options=f"{SESSION_OPTIONS} {dsn_opts}".strip(),
                            client_encoding=CLIENT_ENCODING, **CLIENT_KEEPALIVES)
    return conn
