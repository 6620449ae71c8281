"""A ledger a newer OffsetFlow migrated is refused by an older one (a deploy rolled back
after `offsetflow db upgrade`): planning, running a batch and `db upgrade` name the unknown
migrations instead of running code that does not honour them. Real PostgreSQL and Kafka."""

from __future__ import annotations

from typing import Any

import psycopg2
import pytest

from offsetflow.errors import LedgerVersionError
from offsetflow.ledger import Ledger
from offsetflow.ops import plan_only
from tests.tooling.pipeline_data import ledger_database, pipeline_for, produce_plain


def test_a_ledger_migrated_by_a_newer_version_is_refused(admin_dsn: str, kafka_bootstrap: str,
                                                          make_topic: Any, unique: str) -> None:
    topic = make_topic("lv", 1)
    produce_plain(kafka_bootstrap, topic, 10, f"lv{unique}", 1)
    with ledger_database(admin_dsn, f"offsetflow_lv_{unique}") as dsn:
        cfg = pipeline_for(topic, dsn, kafka_bootstrap, f"lv_{unique}")
        planned = plan_only(cfg, dsn).batch
        assert planned is not None
        with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
            cur.execute("INSERT INTO offsetflow.schema_migrations (version) "
                        "VALUES ('9999_from_a_newer_version')")
        conn.close()
        with Ledger(dsn) as ledger:
            with pytest.raises(LedgerVersionError, match="9999_from_a_newer_version"):
                ledger.mark_running(planned.batch_id)
            with pytest.raises(LedgerVersionError, match="newer OffsetFlow"):
                ledger.upgrade()
            with pytest.raises(LedgerVersionError, match="9999_from_a_newer_version"):
                ledger.abandon(planned.batch_id, "test")
            assert ledger.get_batch(planned.batch_id).status == "planned"  # untouched
        with pytest.raises(LedgerVersionError, match="9999_from_a_newer_version"):
            plan_only(cfg, dsn)
