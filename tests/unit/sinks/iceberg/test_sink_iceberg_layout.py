"""Issue 28 class 4: every partition transform and sort field a config can name is checked
before a table is made with it: at config load (unknown transform, bad width, a column
not in the table, a transform that does not take the column's type, a spec Iceberg
refuses), and what only the runtime can tell (pyiceberg computes every transform but
identity and void with pyiceberg-core) on a sample row before `create_table`."""

from __future__ import annotations

import sys
from typing import Any

import pyarrow as pa
import pytest

from offsetflow.config import parse_pipeline
from offsetflow.config.iceberg_sink import TRANSFORM_TYPES, PartitionField, column_kind
from offsetflow.errors import ConfigError
from offsetflow.sinks.iceberg.layout import layout_for_new_table, unwritable_fields
from offsetflow.sinks.iceberg.stage import arrow_schema
from tests.unit.sinks.iceberg.test_sink_iceberg_config import raw

COLUMNS = [("topic", "text"), ("partition", "integer"), ("offset", "bigint"),
           ("timestamp", "timestamptz"), ("key", "bytea"), ("event_id", "text"),
           ("amount", "double precision")]


@pytest.mark.parametrize(("partition_by", "field", "msg"), [
    (["day(event_id)"], "sink.partition_by[0]",
     r"'day\(event_id\)': day cannot partition 'event_id', a string column; day takes "
     r"date, timestamp, timestamptz columns"),
    (["partition", "bucket(8, amount)"], "sink.partition_by[1]",
     r"bucket cannot partition 'amount', a double column"),
    (["truncate(4, timestamp)"], "sink.partition_by[0]", "truncate cannot partition"),
    (["hour(key)"], "sink.partition_by[0]", "hour cannot partition 'key', a binary"),
    (["bucket(0, event_id)"], "sink.partition_by[0]", "positive width"),
    (["bucket(4294967296, event_id)"], "sink.partition_by[0]", r"at most 2147483647"),
    (["partition", "partition"], "sink.partition_by[1]",
     r"repeats sink.partition_by\[0\] \(partition field 'partition'\)"),
    (["day(timestamp)", "partition", "hour(timestamp)"], "sink.partition_by[2]",
     r"'timestamp' is already partitioned by time in sink.partition_by\[0\]"),
    (["bucket(16, id)"], "sink.partition_by[0]", r"'id' is not a column"),
])
def test_a_partition_field_the_table_cannot_take_is_refused_at_load(
        partition_by: list[str], field: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg) as e:
        parse_pipeline(raw(partition_by=partition_by), "f.yaml", {})
    assert e.value.field == field and e.value.source == "f.yaml"


@pytest.mark.parametrize("partition_by", [
    ["day(timestamp)", "bucket(16, event_id)", "partition"],  # the docs' example
    ["year(timestamp)", "truncate(3, topic)", "bucket(4, offset)", "void(amount)"],
    ["month(timestamp)", "bucket(2, key)", "amount"],
])
def test_transforms_of_the_columns_types_load(partition_by: list[str]) -> None:
    ice = parse_pipeline(raw(partition_by=partition_by), "f.yaml", {}).sink.iceberg
    assert ice is not None and len(ice.partition_by) == len(partition_by)


@pytest.mark.parametrize("kind", sorted(TRANSFORM_TYPES["identity"]))
def test_the_transform_type_table_is_icebergs(kind: str) -> None:
    """`TRANSFORM_TYPES` (config load, no pyiceberg) says what pyiceberg's own
    `can_transform` says, for every transform and column type."""
    from pyiceberg import types as it
    from pyiceberg.transforms import parse_transform

    iceberg = {"string": it.StringType(), "int": it.IntegerType(), "long": it.LongType(),
               "float": it.FloatType(), "double": it.DoubleType(),
               "boolean": it.BooleanType(), "timestamptz": it.TimestamptzType(),
               "timestamp": it.TimestampType(), "date": it.DateType(),
               "binary": it.BinaryType(), "decimal": it.DecimalType(10, 2)}[kind]
    for name, takes in TRANSFORM_TYPES.items():
        spelled = f"{name}[4]" if name in ("bucket", "truncate") else name
        assert parse_transform(spelled).can_transform(iceberg) == (kind in takes), (
            name, kind)


def test_column_kinds_follow_the_stage_types() -> None:
    assert [column_kind(t) for _, t in COLUMNS] == [
        "string", "int", "long", "timestamptz", "binary", "string", "double"]
    assert column_kind("numeric(10,2)") == column_kind("decimal(10,2)") == "decimal"
    assert column_kind("timestamp") == "timestamptz"  # format.schema's timestamp
    assert column_kind("jsonb") == "string"


def _cfg(partition_by: list[str], **extra: Any) -> Any:
    r = raw(partition_by=partition_by)
    r.update(extra)
    cfg = parse_pipeline(r, "f.yaml", {}).sink.iceberg
    assert cfg is not None
    return cfg


def test_a_spec_is_computed_on_a_sample_before_the_table_is_made() -> None:
    pytest.importorskip("pyiceberg_core")  # requirements.txt pins it
    schema, spec, _ = layout_for_new_table(
        _cfg(["day(timestamp)", "bucket(16, event_id)", "partition"]), arrow_schema(COLUMNS))
    assert unwritable_fields(schema, spec) == []
    assert [f.name for f in spec.fields] == ["timestamp_day", "event_id_bucket", "partition"]


def test_a_transform_this_runtime_cannot_compute_names_the_field_and_creates_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pyiceberg computes bucket, truncate and the time transforms with pyiceberg-core:
    without it (as on main before its pin) the table was created and every batch failed.
    Now the spec is run on a sample before `create_table` and refused by field."""
    monkeypatch.setitem(sys.modules, "pyiceberg_core", None)  # not installed here
    with pytest.raises(ConfigError, match=(
            r"f.yaml: sink.partition_by\[1\]: 'bucket\(16, event_id\)' cannot be computed "
            r"here \(NotInstalledError: pyiceberg_core needs to be installed.*\); nothing was "
            r"created. Install pyiceberg-core==0.10.1 .*where the driver and the Spark "
            r"workers run, or partition by another column or transform")):
        layout_for_new_table(_cfg(["partition", "bucket(16, event_id)"]),
                             arrow_schema(COLUMNS))
    layout_for_new_table(_cfg(["partition", "void(amount)"]), arrow_schema(COLUMNS))


def test_a_transform_pipelines_columns_are_checked_when_its_table_is_made() -> None:
    """With a `transform`, the table's columns are known only when it is made: a partition
    or sort column it lacks, or of a type the transform does not take, is refused then,
    by field, before `create_table`."""
    cfg = _cfg(["partition", "day(made)"], transform="pkg.mod.fn")
    with pytest.raises(ConfigError, match=r"sink.partition_by\[1\]: 'made' is not a column "
                                          r"of the table .*nothing was created"):
        layout_for_new_table(cfg, arrow_schema(COLUMNS))
    with pytest.raises(ConfigError, match=r"sink.partition_by\[1\]: 'day\(made\)' cannot be "
                                          r"computed here \(day does not apply to made, a "
                                          r"string column\)"):
        layout_for_new_table(cfg, arrow_schema([*COLUMNS, ("made", "text")]))
    ok = _cfg(["partition"], transform="pkg.mod.fn")
    assert layout_for_new_table(ok, arrow_schema(COLUMNS))[1].fields[0].name == "partition"


def test_the_sample_covers_every_stage_type() -> None:
    from offsetflow.sinks.iceberg.layout import sample_value

    for t in arrow_schema([(f"c{i}", t) for i, t in enumerate(
            ["text", "bigint", "integer", "smallint", "double precision", "real", "boolean",
             "timestamptz", "timestamp", "date", "bytea", "jsonb", "numeric(12,3)"])]).types:
        assert pa.array([sample_value(t)], t)[0].is_valid, t
    assert PartitionField("event_id", "bucket[16]").spelled() == "bucket(16, event_id)"
