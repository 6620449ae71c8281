"""Iceberg data files as JSON, so a Spark task can record the files it wrote in its
PostgreSQL marker and the driver can commit them without reading a footer or a row.

Everything pyiceberg's writer measured is kept: counts, sizes, bounds (already Iceberg's
single-value binary form, as hex), split offsets; the partition tuple travels in the same
binary form (`pyiceberg.conversions`), typed by the table's partition type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyiceberg.manifest import DataFile
    from pyiceberg.types import StructType

_COUNTS = ("column_sizes", "value_counts", "null_value_counts", "nan_value_counts")
_BOUNDS = ("lower_bounds", "upper_bounds")


def encode_data_file(df: DataFile, spec_id: int, partition_type: StructType
                     ) -> dict[str, Any]:
    """A JSON-able dict of a data file written with partition spec `spec_id`."""
    from pyiceberg.conversions import to_bytes

    conv: Any = to_bytes  # partition result types are primitive
    out: dict[str, Any] = {
        "path": df.file_path, "size": int(df.file_size_in_bytes),
        "records": int(df.record_count), "spec_id": int(spec_id),
        "split_offsets": [int(x) for x in df.split_offsets or []],
        "partition": [None if v is None else conv(f.field_type, v).hex()
                      for f, v in zip(partition_type.fields, _values(df.partition),
                                      strict=True)],
    }
    for name in _COUNTS:
        out[name] = {str(k): int(v) for k, v in (getattr(df, name) or {}).items()}
    for name in _BOUNDS:
        out[name] = {str(k): bytes(v).hex() for k, v in (getattr(df, name) or {}).items()}
    return out


def decode_data_file(d: dict[str, Any], partition_type: StructType) -> DataFile:
    """The `DataFile` `encode_data_file` described, ready for a fast append."""
    from pyiceberg.conversions import from_bytes
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    values = d["partition"]
    if len(values) != len(partition_type.fields):
        raise ValueError(f"data file {d['path']}: {len(values)} partition values for a "
                         f"table partitioned by {len(partition_type.fields)} fields")
    conv: Any = from_bytes  # partition result types are primitive
    partition = Record(*[None if v is None else conv(f.field_type, bytes.fromhex(v))
                         for f, v in zip(partition_type.fields, values, strict=True)])
    stats: dict[str, Any] = {
        **{name: {int(k): int(v) for k, v in d[name].items()} for name in _COUNTS},
        **{name: {int(k): bytes.fromhex(v) for k, v in d[name].items()} for name in _BOUNDS}}
    df = DataFile.from_args(
        content=DataFileContent.DATA, file_path=d["path"], file_format=FileFormat.PARQUET,
        partition=partition, record_count=d["records"], file_size_in_bytes=d["size"],
        sort_order_id=None, spec_id=d["spec_id"], equality_ids=None, key_metadata=None,
        split_offsets=d["split_offsets"] or None, **stats)
    df.spec_id = int(d["spec_id"])  # not a field of the file's record: set on its own
    return df


def _values(record: Any) -> list[Any]:
    if record is None:
        return []
    return [record[i] for i in range(len(record))]
