"""The checker's view of an Iceberg sink: the table read back with a pyiceberg scan (the
current snapshot of main, as any reader sees it), and the batches its snapshots name."""

from __future__ import annotations

from typing import Any

from offsetflow.config import SUMMARY_BATCH, SUMMARY_PIPELINE, PipelineConfig
from offsetflow.sinks.iceberg.sink import load_catalog
from tests.tooling.chaos import expected_checksum
from tests.tooling.checker import SinkRow


def iceberg_table(cfg: PipelineConfig, dsn: str) -> Any:
    assert cfg.sink.iceberg is not None
    return load_catalog(cfg.sink.iceberg, cfg.sink.connection or dsn).load_table(
        cfg.sink.iceberg.identifier)


def iceberg_sink_rows(cfg: PipelineConfig, dsn: str) -> list[SinkRow]:
    """With a `pad` column (large records) the checksum carries the pad's md5, as
    `chaos.sink_rows` does for a PostgreSQL table, so a truncated or swapped value shows."""
    table = iceberg_table(cfg, dsn)
    fields = ["event_id", "checksum", "topic", "partition", "offset"]
    padded = "pad" in {f.name for f in table.schema().fields}
    data = table.scan(selected_fields=(*fields, "pad") if padded else tuple(fields)).to_arrow()
    return [SinkRow(r["event_id"], r["checksum"] and expected_checksum(r["checksum"], r.get("pad")),
                    r["topic"], r["partition"], r["offset"]) for r in data.to_pylist()]


def snapshot_batches(cfg: PipelineConfig, dsn: str) -> list[int]:
    """Batch ids of main's snapshots, oldest first (one per batch; a replay's delete and
    append are two snapshots of one commit, so its id shows twice)."""
    from pyiceberg.table.snapshots import ancestors_of

    table = iceberg_table(cfg, dsn)
    out = []
    for snap in ancestors_of(table.current_snapshot(), table.metadata):
        props = snap.summary.additional_properties if snap.summary else {}
        if props.get(SUMMARY_PIPELINE) == cfg.name:
            out.append(int(props[SUMMARY_BATCH]))
    return out[::-1]
