"""Issue 28 class 3 (second bullet): a replay into an append-mode Iceberg table after the
source topic was deleted and recreated (`reset-position --force` keeps the old
incarnation's rows beside the new one's, at the same coordinates) replaces only the rows
of the incarnation it re-reads: their batches' topic ids in the ledger tell them apart
(`offsetflow.commit.incarnations`). A row whose incarnation the ledger cannot tell refuses
the window instead of being deleted or duplicated."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from pyiceberg.expressions import EqualTo

from offsetflow.cli import main as cli
from offsetflow.commit import LINEAGE_COLUMN
from offsetflow.errors import WindowIncarnationError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from offsetflow.ops import run_until_caught_up
from tests.tooling import chaos
from tests.tooling.iceberg_case import IcebergCase, window
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.kafka_topics import recreate


def _rows(case: IcebergCase) -> Counter[str]:
    data = iceberg_table(case.cfg, case.dsn).scan(selected_fields=("event_id",)).to_arrow()
    return Counter(data["event_id"].to_pylist())


def _dead_letters(case: IcebergCase) -> list[tuple[str, int, int]]:
    return sorted((d.topic, d.partition, d.offset) for d in
                  chaos.dead_letters(case.dsn, case.cfg.dead_letter_table, case.cfg.name))


def test_a_replay_after_the_topic_was_recreated_keeps_the_other_incarnations_rows(
        tmp_path: Path, pg_dsn: str, kafka_bootstrap: str, make_topic: Any, unique: str,
        spark: Any) -> None:
    topic = make_topic("ice-inc", 1)
    case = IcebergCase(tmp_path, pg_dsn, kafka_bootstrap, topic, 1, unique)
    case.raw["bad_records"] = "dead_letter"
    case.write_config()
    old = case.workload
    old.plain(5)  # offsets 0-4, a bad record at 5, then 6-49
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topic, b"{not json", b"bad", partition=0)
    assert p.flush(30) == 0
    old.plain(44)
    run_until_caught_up(case.cfg, case.dsn, spark)
    assert _dead_letters(case) == [(topic, 0, 5)]

    recreate(kafka_bootstrap, topic, 1)  # offsets from 0 again, another topic id
    new = chaos.Workload(kafka_bootstrap, topic, 1, f"n{unique}")
    new.plain(60)
    # from offset 10 on: the old rows at >= 10 are kept beside the new ones (--force); the
    # old incarnation's dead letter at 5 stays where it is
    assert cli(["--dsn", case.dsn, "reset-position", "--pipeline-file", str(case.file),
                "--topic", topic, "--partition", "0", "--offset", "10", "--force",
                "--reason", "topic recreated"]) == 0
    run_until_caught_up(case.cfg, case.dsn, spark)
    expected = Counter([*(r.record_id for r in old.produced.values()),
                        *(r.record_id for r in new.produced.values() if r.offset >= 10)])
    assert _rows(case) == expected
    # a replay of the new incarnation's [0, 40): its rows there are replaced (and the
    # ten below the reset read for the first time), the old incarnation's stay
    expected.update(r.record_id for r in new.produced.values() if r.offset < 10)
    for _ in range(2):  # and again: the first replay's rows are the window's now
        window(case, spark, "replay", partitions="0", from_offset=0, until_offset=40)
        assert _rows(case) == expected
        assert _dead_letters(case) == [(topic, 0, 5)]

    # a row there whose incarnation the ledger cannot tell (not its batch: another writer,
    # or a batch planned before topic ids were recorded) refuses the window, by name
    table = iceberg_table(case.cfg, case.dsn)
    stray = table.scan(row_filter=EqualTo("offset", 20), limit=1).to_arrow()
    stray = stray.set_column(stray.schema.get_field_index(LINEAGE_COLUMN), LINEAGE_COLUMN,
                             pa.array([987654321] * stray.num_rows, pa.int64()))
    table.append(stray)
    snaps = snapshot_batches(case.cfg, case.dsn)
    with pytest.raises(WindowIncarnationError, match=(
            rf"\(replay of {topic}\[0\] \[0, 40\)\): the Iceberg table lake\.{case.table} "
            rf"holds 1 rows there written by batch\(es\) \[987654321\], whose topic "
            rf"incarnation the ledger does not record .* nothing was written. Delete the "
            rf"rows")):
        window(case, spark, "replay", partitions="0", from_offset=0, until_offset=40)
    assert snapshot_batches(case.cfg, case.dsn) == snaps
    # the way out: that row deleted, the batch re-run commits once
    iceberg_table(case.cfg, case.dsn).delete(EqualTo(LINEAGE_COLUMN, 987654321))
    with Ledger(case.dsn) as ledger, ledger.transaction() as cur:
        cur.execute("SELECT max(batch_id) FROM offsetflow.batches WHERE pipeline = %s",
                    (case.cfg.name,))
        bid = cur.fetchone()[0]
    assert case.batch(bid).status == "failed"
    assert run_batch(spark, case.cfg, bid, case.dsn).result.status == "committed"
    assert _rows(case) == expected
    assert snapshot_batches(case.cfg, case.dsn).count(bid) == 2  # its delete and append

