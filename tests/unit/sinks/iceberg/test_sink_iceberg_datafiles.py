"""Iceberg data files through a task's marker (JSON) and back: nothing pyiceberg's writer
measured is lost, partition values of every result type come back typed."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
from pyiceberg.typedef import Record
from pyiceberg.types import (
    DateType,
    DecimalType,
    IntegerType,
    NestedField,
    StringType,
    StructType,
)

from offsetflow.sinks.iceberg.datafiles import decode_data_file, encode_data_file

PARTITION = StructType(
    NestedField(1000, "partition", IntegerType(), required=False),
    NestedField(1001, "day", DateType(), required=False),
    NestedField(1002, "region", StringType(), required=False),
    NestedField(1003, "amount", DecimalType(10, 2), required=False))


def _file(partition: Record) -> DataFile:
    return DataFile.from_args(
        content=DataFileContent.DATA, file_path="s3://b/t/data/partition=3/ofb-x-7-p0-a-1.parquet",
        file_format=FileFormat.PARQUET, partition=partition, record_count=1234,
        file_size_in_bytes=56789, column_sizes={1: 10, 2: 20}, value_counts={1: 1234, 2: 1234},
        null_value_counts={1: 0, 2: 3}, nan_value_counts={4: 1},
        lower_bounds={1: b"\x01\x00\x00\x00", 2: b"ab"},
        upper_bounds={1: b"\x09\x00\x00\x00", 2: b"zz\x00"}, split_offsets=[4],
        sort_order_id=None, equality_ids=None, key_metadata=None)


@pytest.mark.parametrize("values", [[3, 20000, "eu", Decimal("12.50")],
                                    [None, None, None, None], [0, -1, "", Decimal("-0.01")]])
def test_a_data_file_survives_the_marker(values: list[object]) -> None:
    df = _file(Record(*values))
    back = decode_data_file(json.loads(json.dumps(encode_data_file(df, 2, PARTITION))),
                            PARTITION)
    assert back.spec_id == 2
    for name in ("file_path", "record_count", "file_size_in_bytes", "column_sizes",
                 "value_counts", "null_value_counts", "nan_value_counts", "lower_bounds",
                 "upper_bounds", "split_offsets", "content", "file_format"):
        assert getattr(back, name) == getattr(df, name), name
    assert [back.partition[i] for i in range(4)] == values


def test_an_unpartitioned_file_has_an_empty_partition() -> None:
    df = _file(Record())
    back = decode_data_file(encode_data_file(df, 0, StructType()), StructType())
    assert len(back.partition) == 0 and back.record_count == 1234


def test_a_partition_tuple_of_another_spec_is_refused_naming_the_file() -> None:
    enc = encode_data_file(_file(Record(3, 1, "x", Decimal("1.00"))), 0, PARTITION)
    with pytest.raises(ValueError, match="ofb-x-7-p0-a-1.parquet: 4 partition values for a "
                                         "table partitioned by 0 fields"):
        decode_data_file(enc, StructType())
