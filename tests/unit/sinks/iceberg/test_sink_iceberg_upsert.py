"""The Iceberg upsert's pure parts: which rows a key chunk or a window selects."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa

from offsetflow.config import IcebergConfig
from offsetflow.ledger import Batch
from offsetflow.ranges import OffsetRange
from offsetflow.sinks.iceberg.keys import key_filter, key_mask, window_mask
from offsetflow.sinks.iceberg.upsert import memory_name, row_columns


def test_row_columns_are_the_key_the_coordinates_the_timestamp_and_the_topic_id() -> None:
    assert row_columns(["event_id"], True) == ["event_id", "topic", "partition", "offset",
                                               "timestamp", "_offsetflow_topic_id"]
    assert row_columns(["partition", "id"], False) == ["partition", "id", "topic", "offset",
                                                       "_offsetflow_topic_id"]


def test_the_memory_name_is_never_a_postgresql_table_name() -> None:
    cfg = IcebergConfig(catalog_name="lake", namespace="ns", table="t")
    assert memory_name(cfg, cfg.identifier) == "iceberg:lake:ns.t"


def test_key_mask_selects_rows_whose_every_key_column_is_among_the_chunks() -> None:
    rows = pa.table({"a": ["x", "y", "x", None], "b": pa.array([1, 2, 2, 1], pa.int32())})
    keys = pa.table({"a": ["x", "z"], "b": pa.array([2, 1], pa.int64())})
    # a superset for two columns: (x, 1) is not a key but its values are; SQL decides
    assert key_mask(rows, ["a", "b"], keys).tolist() == [True, False, True, False]
    assert key_mask(rows, ["a"], keys).tolist() == [True, False, True, False]


def test_key_filter_holds_for_every_key_and_bounds_each_column() -> None:
    keys = pa.table({"k": [b"\x01", b"\x09", b"\x05"]})
    text = repr(key_filter(["k"], keys))
    assert "In" in text and "GreaterThanOrEqual" in text and "LessThanOrEqual" in text
    from pyiceberg.expressions.visitors import expression_evaluator
    from pyiceberg.schema import Schema
    from pyiceberg.typedef import Record
    from pyiceberg.types import BinaryType, NestedField

    schema = Schema(NestedField(1, "k", BinaryType(), required=False))
    holds = expression_evaluator(schema, key_filter(["k"], keys), case_sensitive=True)
    assert [holds(Record(v)) for v in (b"\x01", b"\x05", b"\x09", b"\x02", b"\x0a")] == [
        True, True, True, False, False]


def test_window_mask_selects_the_ranges_coordinates_only() -> None:
    batch = Batch(batch_id=1, pipeline="p", kind="replay", status="planned",
                  ranges=(OffsetRange("t", 0, 10, 20), OffsetRange("t", 1, 0, 5)),
                  target_table="x", planned_at=dt.datetime(2026, 1, 1))
    rows = pa.table({"topic": ["t", "t", "t", "u", "t"],
                     "partition": pa.array([0, 0, 1, 0, 1], pa.int32()),
                     "offset": [10, 20, 4, 15, 5]})
    assert np.array_equal(window_mask(rows, batch), [True, False, True, False, False])


def test_key_filter_leaves_out_columns_it_cannot_compare_and_then_holds_for_all() -> None:
    from pyiceberg.expressions import AlwaysTrue

    stamps = pa.table({"ts": pa.array([dt.datetime(2026, 1, 1)], pa.timestamp("us"))})
    assert key_filter(["ts"], stamps) == AlwaysTrue()
    both = pa.table({"ts": stamps.column("ts"), "id": [7]})
    assert "ts" not in repr(key_filter(["ts", "id"], both))


def test_key_mask_takes_float_zeros_as_one_key_and_nan_as_nan_as_postgresql_does() -> None:
    rows = pa.table({"x": pa.array([-0.0, 0.0, float("nan"), 1.0])})
    for zero in (0.0, -0.0):
        assert key_mask(rows, ["x"], pa.table({"x": [zero]})).tolist() == [True, True,
                                                                          False, False]
    assert key_mask(rows, ["x"], pa.table({"x": [float("nan")]})).tolist() == [
        False, False, True, False]
    f32 = pa.table({"x": pa.array([-0.0], pa.float32())})
    assert key_mask(f32, ["x"], pa.table({"x": [0.0]})).tolist() == [True]
