"""Dataset naming for lineage (OpenLineage naming spec) and the per-pipeline stats list."""

from __future__ import annotations

from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

from offsetflow.orchestration.lineage import (
    kafka_to_openlineage,
    kafka_topic,
    postgres_table,
    postgres_to_openlineage,
    sanitize_kafka_uri,
    sanitize_postgres_uri,
)
from offsetflow.orchestration.pipeline_metrics import Metric, batch_metrics, count, lag_metrics


def test_kafka_names_use_the_first_bootstrap_server_and_default_port() -> None:
    d = kafka_topic("b1.example:19092,b2.example:19092", "orders")
    assert (d.namespace, d.name, d.uri) == ("kafka://b1.example:19092", "orders",
                                             "kafka://b1.example:19092/orders")
    assert kafka_topic("SASL_SSL://broker", "t").namespace == "kafka://broker:9092"
    assert kafka_topic("[::1]:9093", "t").namespace == "kafka://[::1]:9093"


@pytest.mark.parametrize("dsn", ["postgresql://of:S3cret@db.example:6543/shop",
                                 "host=db.example port=6543 dbname=shop user=of password=S3cret"])
def test_postgres_names_carry_host_port_database_schema_table_and_no_password(dsn: str) -> None:
    d = postgres_table(dsn, "raw.orders")
    assert (d.namespace, d.name) == ("postgres://db.example:6543", "shop.raw.orders")
    assert d.uri == "postgres://db.example:6543/shop/raw/orders"
    assert "S3cret" not in repr(d)


def test_postgres_defaults_public_schema_and_port() -> None:
    d = postgres_table("host=h dbname=d", "orders")
    assert (d.namespace, d.name) == ("postgres://h:5432", "d.public.orders")


def test_uri_handlers_and_openlineage_converters_round_trip() -> None:
    k = kafka_topic("h:1", "a.b")
    assert sanitize_kafka_uri(urlsplit(k.uri)) == urlsplit(k.uri)
    ds = kafka_to_openlineage(SimpleNamespace(uri=k.uri, extra={}))
    assert (ds.namespace, ds.name, ds.facets) == (k.namespace, k.name, {})
    ds = kafka_to_openlineage(SimpleNamespace(uri=k.uri, extra={"schema": {"id": "long"}}))
    assert [(f.name, f.type) for f in ds.facets["schema"].fields] == [("id", "long")]
    pg = postgres_table("host=h port=2 dbname=d", "s.t")
    assert sanitize_postgres_uri(urlsplit("postgres://h/d/s/t")).port == 5432
    ds = postgres_to_openlineage(SimpleNamespace(uri=pg.uri))
    assert (ds.namespace, ds.name) == (pg.namespace, pg.name)
    with pytest.raises(ValueError, match="topic"):
        sanitize_kafka_uri(urlsplit("kafka://h:1"))
    with pytest.raises(ValueError, match="database/schema/table"):
        sanitize_postgres_uri(urlsplit("postgres://h:1/d/t"))


def test_batch_metrics_names_and_values() -> None:
    # the pipeline is a tag (emit), never part of a name
    got = batch_metrics([
        {"records_read": 10, "rows_written": 8, "bad_records": 2, "timings": {"commit_s": 0.5},
         "duration_s": 4.0},
        {"records_read": 1, "rows_written": 1, "bad_records": 0, "timings": {}}])
    assert got == [
        Metric("incr", "offsetflow.batches", 1),
        Metric("incr", "offsetflow.records_read", 10),
        Metric("incr", "offsetflow.rows_written", 8),
        Metric("incr", "offsetflow.dead_letters", 2),
        Metric("timing", "offsetflow.commit_duration", 0.5),
        Metric("timing", "offsetflow.batch_duration", 4.0),
        Metric("incr", "offsetflow.batches", 1),
        Metric("incr", "offsetflow.records_read", 1),
        Metric("incr", "offsetflow.rows_written", 1),
        Metric("incr", "offsetflow.dead_letters", 0)]
    assert lag_metrics(7, 12.5) == [Metric("gauge", "offsetflow.lag", 7),
                                    Metric("gauge", "offsetflow.oldest_unread_age", 12.5)]
    assert lag_metrics(None, None) == [] and count("batches_failed", 0) == []
    assert count("batches_failed", 2) == [Metric("incr", "offsetflow.batches_failed", 2)]
