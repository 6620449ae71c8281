"""The Iceberg sink's pure parts: config validation, partition/sort parsing, the snapshot
summary that makes a batch findable, catalog properties."""

from __future__ import annotations

from typing import Any

import pytest

from offsetflow.config import (
    SortField,
    catalog_properties,
    parse_pipeline,
    snapshot_summary,
    summary_batch,
)
from offsetflow.config.iceberg_sink import (
    PartitionField,
    parse_partition_field,
    parse_sort_field,
    sqlalchemy_url,
)
from offsetflow.errors import ConfigError


def raw(**sink: Any) -> dict[str, Any]:
    return {"name": "p", "kafka": {"bootstrap_servers": "k:9092"},
            "source": {"topics": ["t"]},
            "format": {"type": "json", "schema": {"event_id": "string", "amount": "double"}},
            "sink": {"type": "iceberg", "connection": "postgresql://u:pw@h:5432/db",
                     "table": "lake.events", "catalog": {"warehouse": "file:///w"}, **sink}}


def test_iceberg_sink_config_is_parsed() -> None:
    cfg = parse_pipeline(raw(partition_by=["day(timestamp)", "bucket(16, event_id)",
                                           "partition"],
                             sort_by=["offset desc nulls first", "event_id"]), "f.yaml", {})
    ice = cfg.sink.iceberg
    assert ice is not None
    assert ice.identifier == "lake.events" and ice.catalog_type == "sql"
    assert ice.partition_by == (PartitionField("timestamp", "day"),
                                PartitionField("event_id", "bucket[16]"),
                                PartitionField("partition", "identity"))
    assert [p.name for p in ice.partition_by] == ["timestamp_day", "event_id_bucket",
                                                  "partition"]
    assert ice.sort_by == (SortField("offset", True, True), SortField("event_id"))
    assert catalog_properties(ice, cfg.sink.connection) == {
        "type": "sql", "warehouse": "file:///w",
        "uri": "postgresql+psycopg2://u:pw@h:5432/db"}
    assert cfg.redacted()["sink"]["iceberg"]["properties"]["warehouse"] == "file:///w"


def test_a_table_without_namespace_goes_to_the_default_one() -> None:
    ice = parse_pipeline(raw(table="events"), "f.yaml", {}).sink.iceberg
    assert ice is not None and ice.identifier == "offsetflow.events"


def test_postgres_pipelines_have_no_iceberg_section_and_keep_their_fingerprint() -> None:
    r = raw()
    r["sink"] = {"connection": "postgresql://h/db", "table": "events"}
    cfg = parse_pipeline(r, "f.yaml", {})
    assert cfg.sink.iceberg is None
    assert "sink_iceberg" not in cfg._output_relevant()
    ice = parse_pipeline(raw(table="events"), "f.yaml", {})
    assert ice.fingerprint() != cfg.fingerprint()  # another sink: another output


@pytest.mark.parametrize(("sink", "field", "msg"), [
    ({"mode": "upsert"}, "sink.key", "upsert mode needs a key"),
    ({"mode": "upsert", "key": ["nope"]}, "sink.key[0]", "'nope' is not a column"),
    ({"catalog": {}}, "sink.catalog.warehouse", "needs a warehouse"),
    ({"catalog": {"type": "rest"}}, "sink.catalog.uri", "needs its uri"),
    ({"catalog": {"type": "nessie", "warehouse": "w"}}, "sink.catalog.type", "not one of"),
    ({"catalog": "sql"}, "sink.catalog", "must be a mapping"),
    ({"partition_by": ["day(nope)"]}, "sink.partition_by[0]", "'nope' is not a column"),
    ({"partition_by": ["bucket(event_id)"]}, "sink.partition_by[0]", "positive width"),
    ({"partition_by": ["week(timestamp)"]}, "sink.partition_by[0]", "unknown transform"),
    ({"partition_by": ["day(1, timestamp)"]}, "sink.partition_by[0]", "takes no width"),
    ({"partition_by": [3]}, "sink.partition_by[0]", "is not a partition field"),
    ({"partition_by": {"a": 1}}, "sink.partition_by", "must be a list"),
    ({"sort_by": ["amount sideways"]}, "sink.sort_by[0]", "is not a sort field"),
    ({"sort_by": ["missing"]}, "sink.sort_by[0]", "'missing' is not a column"),
    ({"target_file_mb": 0}, "sink.target_file_mb", "positive integer"),
    ({"warehouse": "w"}, "sink.warehouse", "unknown field"),
])
def test_bad_iceberg_config_names_the_field(sink: dict[str, Any], field: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as e:
        parse_pipeline(raw(**sink), "f.yaml", {})
    assert e.value.field == field and e.value.source == "f.yaml"


def test_upsert_into_iceberg_takes_the_postgresql_upserts_key_and_tombstone_policy(
        ) -> None:
    r = raw(mode="upsert", key=["event_id"])
    r["tombstones"] = "dead_letter"
    cfg = parse_pipeline(r, "f.yaml", {})
    assert cfg.sink.mode == "upsert" and cfg.sink.key == ("event_id",)
    assert cfg.tombstone_policy == "dead_letter" and cfg.sink.iceberg is not None
    r["tombstones"] = "null_row"  # an append policy
    with pytest.raises(ConfigError, match="not a tombstone policy of sink.mode upsert") as e:
        parse_pipeline(r, "f.yaml", {})
    assert e.value.field == "tombstones"


def test_iceberg_fields_are_unknown_to_a_postgres_sink() -> None:
    r = raw()
    r["sink"] = {"connection": "postgresql://h/db", "table": "events",
                 "partition_by": ["partition"]}
    with pytest.raises(ConfigError, match="unknown field") as e:
        parse_pipeline(r, "f.yaml", {})
    assert e.value.field == "sink.partition_by"


def test_a_transform_pipeline_defers_the_column_check_to_the_table() -> None:
    r = raw(partition_by=["day(made_by_transform)"])
    r["transform"] = "pkg.mod.fn"
    ice = parse_pipeline(r, "f.yaml", {}).sink.iceberg
    assert ice is not None and ice.partition_by[0].column == "made_by_transform"


def test_partition_and_sort_fields_parse() -> None:
    assert parse_partition_field(" truncate( 4 , topic ) ", "f", "x") == \
        PartitionField("topic", "truncate[4]")
    assert parse_partition_field("HOUR(timestamp)", "f", "x") == PartitionField("timestamp",
                                                                                "hour")
    assert parse_sort_field("amount ASC NULLS LAST", "f", "x") == SortField("amount")


def test_snapshot_summary_round_trip_matches_only_its_own_batch() -> None:
    s = snapshot_summary("p", 42, "replay", [("t", 0, 10, 20), ("t", 1, 5, 5)], 9, 1)
    assert s["offsetflow.ranges"] == '[["t",0,10,20],["t",1,5,5]]'
    assert all(isinstance(v, str) for v in s.values())  # Iceberg summaries are strings
    assert summary_batch(s, "p", 42) == (9, 1)
    assert summary_batch(s, "p", 4) is None
    assert summary_batch(s, "other", 42) is None
    assert summary_batch({}, "p", 42) is None


@pytest.mark.parametrize(("dsn", "url"), [
    ("postgresql://u:p@h:5/db", "postgresql+psycopg2://u:p@h:5/db"),
    ("postgres://h/db", "postgresql+psycopg2://h/db"),
    ("host=h port=5 dbname=db user=u password='p w@x' sslmode=require",
     "postgresql+psycopg2://u:p%20w%40x@h:5/db?sslmode=require"),
    ("dbname=db", "postgresql+psycopg2://localhost/db"),
    ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
])
def test_sqlalchemy_url_from_a_libpq_dsn(dsn: str, url: str) -> None:
    assert sqlalchemy_url(dsn) == url


def test_explicit_catalog_uri_wins_and_secrets_are_redacted() -> None:
    cfg = parse_pipeline(raw(catalog={"type": "rest", "uri": "https://cat", "token": "s3cr3t",
                                      "warehouse": "wh"}), "f.yaml", {})
    assert cfg.sink.iceberg is not None
    props = catalog_properties(cfg.sink.iceberg, cfg.sink.connection)
    assert props == {"type": "rest", "uri": "https://cat", "token": "s3cr3t",
                     "warehouse": "wh"}
    assert cfg.redacted()["sink"]["iceberg"]["properties"]["token"] == "***"


def test_hex_columns_decode_whole_chunks_with_nulls_empties_and_slices() -> None:
    import pyarrow as pa

    from offsetflow.sinks.iceberg.stage import arrow_schema, arrow_type, unhex

    hexes = pa.array(["00ff", None, "", "616263"])
    assert unhex(hexes).to_pylist() == [b"\x00\xff", None, b"", b"abc"]
    assert unhex(hexes.slice(1)).to_pylist() == [None, b"", b"abc"]
    assert unhex(pa.array([], pa.string())).to_pylist() == []
    assert arrow_type("numeric(12,3)") == pa.decimal128(12, 3)
    assert arrow_schema([("offset", "bigint")]).names == ["offset", "_offsetflow_batch_id"]


@pytest.mark.parametrize(("path", "canonical"), [
    ("file:/w/t/data/x.parquet", "/w/t/data/x.parquet"),
    ("file:///w/t/data/x.parquet", "/w/t/data/x.parquet"),
    ("/w/t/data/x.parquet", "/w/t/data/x.parquet"),
    ("/w//t/./data/x.parquet", "/w/t/data/x.parquet"),
    ("file:/w/t/data/k=a%2Fb/x.parquet", "/w/t/data/k=a%2Fb/x.parquet"),  # kept encoded
    ("s3://bucket/t/data/x.parquet", "bucket/t/data/x.parquet"),
    ("hdfs://nn:8020/t/data/x.parquet", "/t/data/x.parquet"),
])
def test_data_file_paths_compare_in_one_canonical_form(path: str, canonical: str) -> None:
    from offsetflow.sinks.iceberg.files import canonical_path

    assert canonical_path(path) == canonical


@pytest.mark.parametrize(("table", "target", "ident"), [
    ("events", "events", "offsetflow.events"),
    ("events", "public.events", "offsetflow.events"),
    ("events", "offsetflow.events", "offsetflow.events"),
    ("offsetflow.events", "events", "offsetflow.events"),
    ("lake.events", "lake.events", "lake.events"),
    ("lake.events", "events", "offsetflow.events"),
    ("lake.events", "lake.other", "lake.other"),
])
def test_a_target_table_resolves_to_one_iceberg_identifier(table: str, target: str,
                                                           ident: str) -> None:
    from offsetflow.config import resolve_identifier

    ice = parse_pipeline(raw(table=table), "f.yaml", {}).sink.iceberg
    assert ice is not None
    assert resolve_identifier(ice, table, target) == ident


def test_batch_file_prefix_names_pipeline_batch_and_plan() -> None:
    from datetime import UTC, datetime

    from offsetflow.ledger import Batch
    from offsetflow.sinks.iceberg.files import batch_file_prefix

    at = datetime(2026, 11, 23, tzinfo=UTC)
    b = Batch(7, "p", "live", "running", (), "t", planned_at=at)
    assert batch_file_prefix(b).startswith("ofb-") and batch_file_prefix(b).endswith("-7-")
    assert batch_file_prefix(b) != batch_file_prefix(Batch(7, "q", "live", "running", (),
                                                           "t", planned_at=at))
    assert batch_file_prefix(b) != batch_file_prefix(Batch(
        7, "p", "live", "running", (), "t", planned_at=datetime(2026, 1, 1, tzinfo=UTC)))


def test_a_found_snapshot_must_carry_the_batchs_very_ranges() -> None:
    from offsetflow.config import check_summary_ranges
    from offsetflow.config.iceberg_sink import BatchIdentityError

    s = snapshot_summary("p", 7, "live", [("t", 1, 5, 9), ("t", 0, 0, 100)], 9, 0)
    check_summary_ranges(s, "p", 7, [("t", 0, 0, 100), ("t", 1, 5, 9)], "1 of ns.t")
    with pytest.raises(BatchIdentityError, match=r"batch 7 of pipeline p: Iceberg snapshot "
                                                 r"1 of ns\.t names this batch with ranges "
                                                 r"t\[0\] \[0, 100\), t\[1\] \[5, 9\) but "
                                                 r"the ledger's batch has t\[0\] \[0, 5000\)"):
        check_summary_ranges(s, "p", 7, [("t", 0, 0, 5000)], "1 of ns.t")
    with pytest.raises(BatchIdentityError, match="with ranges none"):
        check_summary_ranges({**s, "offsetflow.ranges": "garbage"}, "p", 7,
                             [("t", 0, 0, 100)], "1 of ns.t")


@pytest.mark.parametrize("catalog", [
    {"warehouse": "file:///w2"},
    {"warehouse": "file:///w", "name": "other"},
    {"warehouse": "file:///w", "type": "rest", "uri": "https://cat"},
    {"warehouse": "file:///w", "uri": "postgresql+psycopg2://u:pw@other:5432/db"},
])
def test_the_catalog_is_part_of_the_fingerprint(catalog: dict[str, Any]) -> None:
    base = parse_pipeline(raw(), "f.yaml", {}).fingerprint()
    assert parse_pipeline(raw(catalog=catalog), "f.yaml", {}).fingerprint() != base
    other_db = raw()
    other_db["sink"]["connection"] = "postgresql://u:pw@h:5432/db2"
    assert parse_pipeline(other_db, "f.yaml", {}).fingerprint() != base


def test_catalog_secrets_stay_out_of_the_fingerprint_and_do_not_change_it() -> None:
    from offsetflow.config.iceberg_sink import catalog_identity

    a = raw(catalog={"warehouse": "w", "uri": "postgresql+psycopg2://u:s3cr3t@h:5/db?x=1",
                     "token": "t1"})
    b = raw(catalog={"warehouse": "w", "uri": "postgresql+psycopg2://v:other@h:5/db",
                     "token": "t2"})
    ca, cb = (parse_pipeline(r, "f.yaml", {}) for r in (a, b))
    assert ca.fingerprint() == cb.fingerprint()  # credentials rotate without a drift
    assert ca.sink.iceberg is not None
    ident = catalog_identity(ca.sink.iceberg, ca.sink.connection, None)
    assert ident == ["sql", "offsetflow", "w", "postgresql+psycopg2://h:5/db"]
    assert catalog_identity(ca.sink.iceberg, "postgresql://x@other/db", None) == ident
    plain = parse_pipeline(raw(), "f.yaml", {})
    assert plain.sink.iceberg is not None
    assert catalog_identity(plain.sink.iceberg, "host=h port=5 dbname=d password=x",
                            None)[3] == "h:5/d"
    assert catalog_identity(plain.sink.iceberg, "", "pg_conn")[3] == "conn_id:pg_conn"


def test_layout_drift_names_each_difference() -> None:
    from offsetflow.config import layout_drift

    ice = parse_pipeline(raw(partition_by=["day(timestamp)", "event_id"],
                             sort_by=["amount desc nulls first"]), "f.yaml", {}).sink.iceberg
    assert ice is not None
    same = [("timestamp", "day"), ("event_id", "identity")]
    assert layout_drift(ice, same, [SortField("amount", True, True)], 128 << 20) == []
    assert layout_drift(ice, same, [SortField("amount", True, True)], None) == []
    assert layout_drift(ice, [], [], 64 << 20) == [
        "partitioned by [] but sink.partition_by says [day(timestamp), event_id]",
        "sorted by [] but sink.sort_by says [amount desc nulls first]",
        "target file size 64 MB but sink.target_file_mb says 128"]
