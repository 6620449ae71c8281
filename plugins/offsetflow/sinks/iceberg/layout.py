"""The layout of the Iceberg sink's table: how a new table gets the configured partition
spec, sort order and file size in ONE create commit (a kill cannot leave it half-made),
and a warning when an existing table's layout differs from the config (the config shapes
only a table OffsetFlow creates).

A partition spec is computed on a sample row before a table is created with it, and an
existing table's before anything is written to it (`unwritable_fields`): a transform this
runtime cannot compute (pyiceberg computes every transform but identity and void with
pyiceberg-core) would otherwise fail every batch, and a table created with it would keep
failing after the config is fixed (the config shapes only a new table)."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetflow.config import IcebergConfig, SortField, layout_drift
from offsetflow.errors import ConfigError, IcebergLayoutError

if TYPE_CHECKING:
    from pyiceberg.partitioning import PartitionSpec
    from pyiceberg.schema import Schema
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

# what the message of a transform pyiceberg cannot compute without it says to install
CORE_PIN = "pyiceberg-core==0.10.1"


def layout_for_new_table(cfg: IcebergConfig, arrow: pa.Schema) -> tuple[Any, Any, Any]:
    """(schema, partition spec, sort order) of a new table, for one create_table."""
    from pyiceberg.catalog import Catalog
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import assign_fresh_schema_ids
    from pyiceberg.table.sorting import NullOrder, SortDirection, SortOrder
    from pyiceberg.table.sorting import SortField as IcebergSortField
    from pyiceberg.transforms import IdentityTransform, parse_transform

    schema = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(arrow))

    def source(column: str) -> int:
        return int(schema.find_field(column).field_id)

    where = cfg.source_file or "the pipeline config"
    for what, cols in (("partition_by", [f.column for f in cfg.partition_by]),
                       ("sort_by", [s.column for s in cfg.sort_by])):
        for i, c in enumerate(cols):  # a transform's output columns are known only now
            if _find(schema, c) is None:
                raise ConfigError(where, f"sink.{what}[{i}]",
                                  f"{c!r} is not a column of the table "
                                  f"({', '.join(schema.column_names)}); nothing was created")
    spec = PartitionSpec(*[PartitionField(source_id=source(f.column), field_id=1000 + i,
                                          transform=parse_transform(f.transform), name=f.name)
                           for i, f in enumerate(cfg.partition_by)])
    for i, err in unwritable_fields(schema, spec):  # before create_table: never made
        f = cfg.partition_by[i]
        raise ConfigError(where, f"sink.partition_by[{i}]",
                          f"{f.spelled()!r} cannot be computed here ({err}); nothing was "
                          f"created. " + _way_out(err, "or partition by another column or "
                                                       "transform"))
    order = SortOrder(*[IcebergSortField(
        source_id=source(s.column), transform=IdentityTransform(),
        direction=SortDirection.DESC if s.descending else SortDirection.ASC,
        null_order=NullOrder.NULLS_FIRST if s.nulls_first else NullOrder.NULLS_LAST)
        for s in cfg.sort_by])
    return schema, spec, order


def _find(schema: Schema, column: str) -> Any:
    try:
        return schema.find_field(column)
    except ValueError:
        return None


def unwritable_fields(schema: Schema, spec: PartitionSpec) -> list[tuple[int, str]]:
    """(index, why) of each field of `spec` this runtime cannot compute for rows of
    `schema`: each is run, as the writers run it, on a sample row and a null row."""
    from pyiceberg.io.pyarrow import (
        _determine_partitions,  # noqa: PLC2701 - the writers' own
        schema_to_pyarrow,
    )
    from pyiceberg.partitioning import PartitionSpec

    arrow = schema_to_pyarrow(schema, include_field_ids=False)
    sample = pa.Table.from_arrays([pa.array([sample_value(f.type), None], f.type)
                                   for f in arrow], schema=arrow)
    out = []
    for i, field in enumerate(spec.fields):
        source = schema.find_field(field.source_id)
        if not field.transform.can_transform(source.field_type):
            out.append((i, f"{field.transform} does not apply to {source.name}, a "
                           f"{source.field_type} column"))
            continue
        try:
            for part in _determine_partitions(PartitionSpec(field), schema, sample):
                part.partition_key.to_path()
        except Exception as e:  # noqa: BLE001 - whatever it is, the writers would meet it
            out.append((i, f"{type(e).__name__}: {e}"))
    return out


def check_table_layout(table: Table) -> None:
    """An existing table whose partition spec this runtime cannot compute is refused
    before anything is written to it (every batch would fail at its first row)."""
    spec, schema = table.spec(), table.schema()
    for i, err in unwritable_fields(schema, spec):
        f = spec.fields[i]
        raise IcebergLayoutError(
            f"Iceberg table {'.'.join(table.name())} is partitioned by {f.transform}"
            f"({schema.find_column_name(f.source_id)}) (partition field {i}, {f.name!r}), "
            f"which cannot be computed here ({err}); nothing was written. "
            + _way_out(err, "or evolve the table's partition spec (e.g. Spark ALTER TABLE "
                            "... DROP PARTITION FIELD), or, if it holds nothing yet, drop it: "
                            "the next run creates it from sink.partition_by"))


def _way_out(err: str, otherwise: str) -> str:
    if "needs to be installed" in err:
        return (f"Install {CORE_PIN} (requirements.txt; the version pyiceberg 0.12 takes) "
                f"where the driver and the Spark workers run, {otherwise}")
    return otherwise[0].upper() + otherwise[1:].removeprefix("or ")


def sample_value(t: pa.DataType) -> Any:
    """One value of Arrow type `t` (None for a nested one: partition sources are not)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "offsetflow"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return b"offsetflow"
    if pa.types.is_fixed_size_binary(t):
        return b"\0" * t.byte_width
    if pa.types.is_boolean(t):
        return True
    if pa.types.is_integer(t):
        return 7
    if pa.types.is_floating(t):
        return 1.5
    if pa.types.is_decimal(t):
        return Decimal(1)
    if pa.types.is_timestamp(t):
        return datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC if t.tz else None)
    if pa.types.is_date(t):
        return date(2026, 1, 2)
    return None


def warn_layout_drift(table: Table, cfg: IcebergConfig) -> None:
    from pyiceberg.table.sorting import NullOrder, SortDirection

    schema = table.schema()
    diff = layout_drift(
        cfg, [(schema.find_column_name(f.source_id) or "?", str(f.transform))
              for f in table.spec().fields],
        [SortField(schema.find_column_name(f.source_id) or "?",
                   f.direction == SortDirection.DESC, f.null_order == NullOrder.NULLS_FIRST)
         for f in table.sort_order().fields],
        int(table.properties["write.target-file-size-bytes"])
        if "write.target-file-size-bytes" in table.properties else None)
    if diff:
        log.warning("Iceberg table %s's layout differs from the config: %s. partition_by, "
                    "sort_by and target_file_mb shape only a table OffsetFlow creates: evolve "
                    "the table (e.g. Spark ALTER TABLE ... ADD PARTITION FIELD / WRITE "
                    "ORDERED BY / SET TBLPROPERTIES) or undo the edit",
                    ".".join(table.name()), "; ".join(diff))
