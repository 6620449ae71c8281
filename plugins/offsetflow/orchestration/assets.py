"""Asset names of a pipeline's data, in the providers' URI forms (pure; no Airflow import).

Target table: `postgres://host:port/database/schema/table` (the postgres provider's form).
Kafka topic: `kafka://host:port/topic` (the Kafka provider's form; first bootstrap server).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg2.extensions

from offsetflow.config import PipelineConfig, split_table_name


def table_uri(dsn: str, table: str) -> str:
    """URI of `table` in the database of `dsn` (URI or key=value DSN; no credentials)."""
    p = psycopg2.extensions.parse_dsn(dsn)
    host = p.get("host") or "localhost"
    if "," in host or host.startswith("/"):
        host = host.split(",")[0] if not host.startswith("/") else "localhost"
    port = (p.get("port") or "5432").split(",")[0]
    db = p.get("dbname") or p.get("user") or "postgres"
    schema, name = split_table_name(table)
    return f"postgres://{host}:{port}/{db}/{schema}/{name}"


def topic_uri(bootstrap_servers: str, topic: str) -> str:
    first = bootstrap_servers.split(",")[0].strip()
    for prefix in ("PLAINTEXT://", "SSL://", "SASL_SSL://", "SASL_PLAINTEXT://"):
        first = first.removeprefix(prefix)
    return f"kafka://{first}/{topic}"


def alias_name(pipeline: str) -> str:
    """The AssetAlias a pipeline's publish task emits through: the target table's URI
    needs its connection, which a DAG file must not read while it is parsed."""
    return f"offsetflow_{pipeline}_target"


def target_uris(cfg: PipelineConfig, table: str | None = None) -> str:
    target = table or cfg.sink.table
    if target.startswith("kafka:"):  # sink.type: kafka: the output topic
        return topic_uri(cfg.bootstrap_servers, target.removeprefix("kafka:"))
    return table_uri(cfg.sink.connection, target)


def batch_extra(cfg: PipelineConfig, fig: Mapping[str, Any]) -> dict[str, Any]:
    """What a downstream DAG reads from the event: the batch, its kind, its ranges and the
    topics it read (`inputs`: their URIs, known here even when a connection names them)."""
    topics = sorted({r["topic"] for r in fig.get("ranges", [])})
    return {"pipeline": cfg.name, "batch_id": fig["batch_id"], "kind": fig["kind"],
            "inputs": [topic_uri(cfg.bootstrap_servers, t) for t in topics],
            "rows_written": fig["rows_written"], "records_read": fig["records_read"],
            "bad_records": fig["bad_records"], "target_table": fig.get("target_table"),
            "ranges": [dict(r) for r in fig.get("ranges", [])]}
