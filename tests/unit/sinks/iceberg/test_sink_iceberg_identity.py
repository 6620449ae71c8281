"""The pure rules of issue 28: when a table found is the ledger's (`identity.differences`),
which snapshots expiry keeps for open batches of any pipeline and ledger
(`maint.oldest_needed`), and that a snapshot of another ledger is never this one's batch."""

from __future__ import annotations

from offsetflow.config import snapshot_summary, summary_batch
from offsetflow.sinks.iceberg.identity import Record, Seen, differences
from offsetflow.sinks.iceberg.maint import oldest_needed

REC = Record("p", "", "lake.t", "sql catalog 'c' at h:5432/db", "u1", "file:///w/lake.db/t",
             "file:///w/lake.db/t/metadata/00003-x.metadata.json", 3, 33, 7)


def seen(**kw: object) -> Seen:
    base = {"identifier": "lake.t", "catalog": REC.catalog, "table_uuid": "u1",
            "location": "file:///w/lake.db/t/", "metadata_location": "m", "last_sequence_number": 3,
            "last_snapshot": "main"}
    return Seen(**{**base, **kw})  # type: ignore[arg-type]


def test_the_same_table_differs_in_nothing_even_renamed_or_grown() -> None:
    assert differences(REC, seen()) == []
    assert differences(REC, seen(identifier="lake.t2", last_sequence_number=9,
                                 last_snapshot="gone")) == []


def test_another_uuid_location_catalog_older_history_or_a_rollback_is_another_table() -> None:
    (d,) = differences(REC, seen(table_uuid="u2"))
    assert "table-uuid u2, not u1" in d
    assert "location changed to s3://b/t" in differences(REC, seen(location="s3://b/t"))[0]
    assert "not the ledger's sql catalog 'c'" in differences(REC, seen(catalog="x"))[0]
    (d,) = differences(REC, seen(last_sequence_number=2))
    assert "older metadata file than file:///w/lake.db/t/metadata/00003-x" in d
    (d,) = differences(REC, seen(last_snapshot="off-main"))
    assert "rolled back past the ledger's last batch 7" in d


def test_a_record_without_a_table_yet_takes_any() -> None:
    empty = Record("p", "", "lake.t", REC.catalog, None, None)
    assert differences(empty, seen(table_uuid="anything")) == []


def _snap(pipeline: str, batch: int, ledger: str | None = None, floor: int | None = None
          ) -> dict[str, str]:
    return snapshot_summary(pipeline, batch, "scheduled", [("t", 0, 0, 1)], 1, 0,
                            ledger=ledger, open_floor=floor)


def test_expiry_keeps_from_the_oldest_open_batch_of_any_pipeline_of_this_ledger() -> None:
    chain = [_snap("a", 9, "me"), _snap("b", 8, "me"), _snap("a", 7, "me"), {}]
    assert oldest_needed(chain, "me", set(), {"a", "b"}) == (-1, "")
    assert oldest_needed(chain, "me", {("b", 8)}, {"a", "b"})[0] == 1
    assert oldest_needed(chain, "me", {("b", 8), ("a", 7)}, {"a", "b"})[0] == 2
    # written before the ledger was recorded: this ledger's if it runs the pipeline
    assert oldest_needed([_snap("a", 7)], "me", set(), {"a"}) == (-1, "")


def test_expiry_keeps_another_ledgers_batches_from_its_newest_snapshots_floor() -> None:
    chain = [_snap("a", 9, "me"), _snap("b", 5, "other", floor=4), _snap("b", 4, "other", 4),
             _snap("b", 3, "other", 2), _snap("a", 2, "me")]
    upto, why = oldest_needed(chain, "me", set(), {"a"})
    assert upto == 2 and "batch 4 of pipeline b of another ledger (other)" in why
    # the writer's newest says every earlier batch was closed then: only it may be open
    chain[1] = _snap("b", 5, "other", floor=5)
    assert oldest_needed(chain, "me", set(), {"a"})[0] == 1
    # a pipeline of the same name in another ledger is not this ledger's
    assert oldest_needed([_snap("a", 9, "other", 9)], "me", set(), {"a"})[0] == 0
    # not recorded, of a pipeline this ledger never ran: its newest snapshot may be open
    assert oldest_needed([_snap("c", 9), _snap("c", 8)], "me", set(), set())[0] == 0
    # ... unless the operator says that writer has none open (it stopped writing)
    upto, why = oldest_needed(chain, "me", set(), {"a"})
    assert "--closed-writer other:b" in why
    assert oldest_needed(chain, "me", set(), {"a"}, frozenset({"other:b"})) == (-1, "")


def test_another_ledgers_snapshot_of_the_same_pipeline_and_batch_id_is_not_found() -> None:
    assert summary_batch(_snap("a", 9, "other"), "a", 9, "me") is None
    assert summary_batch(_snap("a", 9, "me"), "a", 9, "me") == (1, 0)
    assert summary_batch(_snap("a", 9), "a", 9, "me") == (1, 0)  # before it was recorded
