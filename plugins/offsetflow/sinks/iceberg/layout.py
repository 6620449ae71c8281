"""The layout of the Iceberg sink's table: how a new table gets the configured partition
spec, sort order and file size in ONE create commit (a kill cannot leave it half-made),
and a warning when an existing table's layout differs from the config (the config shapes
only a table OffsetFlow creates)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetflow.config import IcebergConfig, SortField, layout_drift

if TYPE_CHECKING:
    from pyiceberg.table import Table

log = logging.getLogger(__name__)


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

    spec = PartitionSpec(*[PartitionField(source_id=source(f.column), field_id=1000 + i,
                                          transform=parse_transform(f.transform), name=f.name)
                           for i, f in enumerate(cfg.partition_by)])
    order = SortOrder(*[IcebergSortField(
        source_id=source(s.column), transform=IdentityTransform(),
        direction=SortDirection.DESC if s.descending else SortDirection.ASC,
        null_order=NullOrder.NULLS_FIRST if s.nulls_first else NullOrder.NULLS_LAST)
        for s in cfg.sort_by])
    return schema, spec, order


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
