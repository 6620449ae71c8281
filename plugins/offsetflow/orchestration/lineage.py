"""Dataset names of a pipeline's inputs and outputs, for lineage (OpenLineage) and assets.

Pure: no I/O, no Airflow import at module level. Follows the OpenLineage naming spec:

- Kafka topic:       namespace ``kafka://{host}:{port}`` (the first bootstrap server),
                     name ``{topic}``
- PostgreSQL table:  namespace ``postgres://{host}:{port}``, name ``{database}.{schema}.{table}``

and the Airflow asset URIs of the Kafka and Postgres providers (``kafka://host:port/topic``,
``postgres://host:port/database/schema/table``). Credentials never appear in a name: only
host, port and database are taken from a DSN.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

from psycopg2.extensions import parse_dsn

from offsetflow.config import PipelineConfig, split_table_name

KAFKA_DEFAULT_PORT = 9092
POSTGRES_DEFAULT_PORT = 5432


@dataclass(frozen=True)
class DatasetName:
    """One OpenLineage dataset: namespace + name, and the matching Airflow asset URI."""

    namespace: str
    name: str
    uri: str


def _host_port(text: str, default_port: int) -> str:
    text = text.strip()
    if "://" in text:  # SASL_SSL://host:port style listeners
        text = text.split("://", 1)[1]
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and (":" not in host or host.startswith("[")):
        return f"{host}:{port}"
    return f"{text}:{default_port}"


def kafka_topic(bootstrap_servers: str, topic: str) -> DatasetName:
    first = bootstrap_servers.split(",")[0]
    hp = _host_port(first, KAFKA_DEFAULT_PORT)
    return DatasetName(f"kafka://{hp}", topic, f"kafka://{hp}/{topic}")


def postgres_table(dsn: str, table: str) -> DatasetName:
    """`dsn`: a libpq connection string or URI (its password is not used)."""
    params = parse_dsn(dsn)
    host = params.get("host") or "localhost"
    if "," in host:  # multi-host DSN: the first is the primary by convention
        host = host.split(",")[0]
    port = (params.get("port") or str(POSTGRES_DEFAULT_PORT)).split(",")[0]
    database = params.get("dbname") or params.get("user") or "postgres"
    schema, name = split_table_name(table)
    return DatasetName(f"postgres://{host}:{port}", f"{database}.{schema}.{name}",
                       f"postgres://{host}:{port}/{database}/{schema}/{name}")


def pipeline_datasets(cfg: PipelineConfig, topics: list[str] | tuple[str, ...] | None = None,
                      table: str | None = None) -> tuple[list[DatasetName], list[DatasetName]]:
    """(inputs, outputs) of a pipeline: its topics (or those a batch read) and its table
    (or a backfill's side table)."""
    inputs = [kafka_topic(cfg.bootstrap_servers, t) for t in (topics or cfg.topics)]
    target = table or cfg.sink.table
    outputs = [kafka_topic(cfg.bootstrap_servers, target.removeprefix("kafka:"))
               if target.startswith("kafka:")  # sink.type: kafka
               else postgres_table(cfg.sink.connection, target)]
    return inputs, outputs


# -- Airflow asset URI handlers and OpenLineage converters ---------------------------------
# Registered through provider_info only when the Kafka / Postgres providers (which own these
# schemes) are not installed, so assets and hook-level lineage work either way.
def sanitize_kafka_uri(uri: SplitResult) -> SplitResult:
    if not uri.netloc:
        raise ValueError("URI format kafka:// must contain a host")
    if not uri.path.strip("/"):
        raise ValueError("URI format kafka:// must contain a topic: kafka://host:port/topic")
    return uri


def sanitize_postgres_uri(uri: SplitResult) -> SplitResult:
    if not uri.netloc:
        raise ValueError("URI format postgres:// must contain a host")
    if uri.port is None:
        uri = uri._replace(netloc=f"{uri.hostname}:{POSTGRES_DEFAULT_PORT}")
    if len([p for p in uri.path.split("/") if p]) != 3:
        raise ValueError("URI format postgres:// must be postgres://host:port/database/schema/table")
    return uri


def kafka_to_openlineage(asset: Any, lineage_context: Any = None) -> Any:
    """With a schema facet when the asset's extra carries the record schema (``schema``:
    field -> type, what `record_schema_extra` makes)."""
    u = urlsplit(asset.uri)
    fields = (getattr(asset, "extra", None) or {}).get("schema")
    return openlineage_dataset(f"kafka://{u.netloc}", u.path.strip("/"),
                               fields if isinstance(fields, dict) else None)


def openlineage_dataset(namespace: str, name: str,
                        schema: dict[str, Any] | None = None) -> Any:
    """An OpenLineage dataset, with a schema facet when `schema` (field -> type) is given."""
    from openlineage.client.event_v2 import Dataset
    from openlineage.client.facet_v2 import schema_dataset

    facets: dict[str, Any] = {}
    if schema:
        facets["schema"] = schema_dataset.SchemaDatasetFacet(fields=[
            schema_dataset.SchemaDatasetFacetFields(name=str(k), type=str(v))
            for k, v in schema.items()])
    return Dataset(namespace=namespace, name=name, facets=facets)


def openlineage_output(namespace: str, name: str, rows: int | None = None) -> Any:
    """An OpenLineage output dataset, with `outputStatistics` (rows written) when given."""
    from openlineage.client.event_v2 import OutputDataset
    from openlineage.client.facet_v2 import output_statistics_output_dataset as stats

    facets: dict[str, Any] = {} if rows is None else {
        "outputStatistics": stats.OutputStatisticsOutputDatasetFacet(rowCount=rows)}
    return OutputDataset(namespace=namespace, name=name, outputFacets=facets)


BATCH_FACET = "offsetflow_batch"


@functools.cache
def _batch_facet_class() -> Any:
    import attr
    from openlineage.client.facet_v2 import RunFacet

    @attr.define
    class OffsetFlowBatchRunFacet(RunFacet):  # type: ignore[misc]
        """The batches a run task read and wrote: ids, kinds, statuses and offset ranges
        `[from_offset, until_offset)`, so a lineage consumer can tell which records of the
        input topics landed in which run."""

        pipeline: str
        batches: list[dict[str, Any]] = attr.field(factory=list)

        @staticmethod
        def _get_schema() -> str:
            return "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunFacet"

    return OffsetFlowBatchRunFacet


def batch_run_facet(pipeline: str, batches: list[dict[str, Any]]) -> Any:
    """The custom run facet `offsetflow_batch` (`batches`: batch_id, kind, status, attempts,
    ranges as topic/partition/from_offset/until_offset)."""
    return _batch_facet_class()(pipeline=pipeline, batches=batches)


def record_schema_extra(cfg: PipelineConfig) -> dict[str, Any]:
    """Asset extra of a pipeline's topics: the JSON record schema (empty for raw format)."""
    return {"schema": dict(cfg.schema)} if cfg.schema else {}


def postgres_to_openlineage(asset: Any, lineage_context: Any = None) -> Any:
    from openlineage.client.event_v2 import Dataset

    u = urlsplit(asset.uri)
    return Dataset(namespace=f"postgres://{u.netloc}",
                   name=".".join(p for p in u.path.split("/") if p))
