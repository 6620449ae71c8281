"""Shared set-up of the nested-value Iceberg tests (`sinks/iceberg/test_sink_iceberg_nested*`):
a registry-format pipeline into an Iceberg table in a file warehouse, with a dead-letter
table, and the Avro record a careless producer writes (a decimal wider than its schema)."""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path
from typing import Any

import yaml

from offsetflow.config import PipelineConfig, load_pipeline
from tests.tooling.registry_case import registry_url


def iceberg_pipeline(tmp: Path, dsn: str, bootstrap: str, topics: str | list[str],
                     columns: dict[str, str], *, prefix: str = "icenest",
                     name: str | None = None, table: str | None = None,
                     fmt: str = "avro", **sections: Any) -> PipelineConfig:
    """A pipeline reading `topics` (from the start) as `fmt` through the stack's registry
    into `table` (default: `lake.<name>`, a table of its own). `sections`: a dict is merged
    into the section of that name (`format={"schema_evolution": ...}`, `sink={"mode": ...}`),
    anything else set as it is (`transform=`, `quality=`)."""
    name = name or f"{prefix}_{uuid.uuid4().hex[:8]}"
    raw: dict[str, Any] = {
        "name": name, "kafka": {"bootstrap_servers": bootstrap},
        "source": {"topics": [topics] if isinstance(topics, str) else list(topics),
                   "starting": "earliest"},
        "format": {"type": fmt, "schema": dict(columns),
                   "schema_registry": {"url": registry_url()}},
        "sink": {"type": "iceberg", "connection": dsn, "table": table or f"lake.{name}",
                 "catalog": {"warehouse": f"file://{tmp / 'warehouse'}"}},
        "bad_records": "dead_letter", "dead_letter_table": f"dl_{name}",
        "spark": {"master": "local[2]"}}
    for k, v in sections.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_pipeline(path)


def wide_decimal(schema: dict[str, Any], record: dict[str, Any], sid: int) -> bytes:
    """`record` framed as schema `sid`'s, its decimals written with the precision raised
    from 9 to 20 (fastavro's own writer refuses a value wider than its schema): a careless
    producer's record, whose bytes encoding holds what decimal(9,2) cannot."""
    import fastavro

    wide = json.loads(json.dumps(schema).replace('"precision": 9', '"precision": 20'))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(wide), record)
    return b"\x00" + sid.to_bytes(4, "big") + buf.getvalue()
