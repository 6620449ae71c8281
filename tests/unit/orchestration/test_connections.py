"""Pipelines naming Airflow connections: config fields, connection -> DSN / librdkafka
settings, the hand-over to the spark-submit driver, asset URIs (pure; no Airflow needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import psycopg2.extensions
import pytest

from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError
from offsetflow.orchestration import assets, connections
from offsetflow.orchestration.operators import batch_id_list


def raw(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": "p", "kafka": {"conn_id": "kc"}, "source": {"topics": ["t"]},
        "format": {"type": "raw"}, "sink": {"conn_id": "pc", "table": "s.t"}}
    d.update(over)
    return d


@dataclass
class Conn:
    conn_id: str
    conn_type: str
    host: str | None = None
    port: int | None = None
    schema: str | None = None
    login: str | None = None
    password: str | None = None
    extra_dejson: dict[str, Any] = field(default_factory=dict)


CONNS = {
    "kc": Conn("kc", "kafka", extra_dejson={"bootstrap.servers": "b1:9092,b2:9092",
                                            "security.protocol": "SASL_SSL",
                                            "sasl.password": "kpw", "group.id": "theirs"}),
    "pc": Conn("pc", "postgres", host="db", port=6432, schema="wh", login="u",
               password="p w'd", extra_dejson={"sslmode": "require", "cursor": "dictcursor"}),
}


def test_conn_ids_are_parsed_and_replace_the_literal_fields() -> None:
    cfg = parse_pipeline(raw(), "p.yaml", env={})
    assert (cfg.kafka.conn_id, cfg.sink.conn_id) == ("kc", "pc")
    assert cfg.bootstrap_servers == "" and cfg.sink.connection == ""


@pytest.mark.parametrize("section,literal", [("kafka", "bootstrap_servers"),
                                             ("sink", "connection")])
def test_conn_id_and_literal_together_is_an_error_naming_the_field(section: str,
                                                                    literal: str) -> None:
    d = raw()
    d[section] = {**d[section], literal: "x"}
    with pytest.raises(ConfigError) as e:
        parse_pipeline(d, "p.yaml", env={})
    assert e.value.field == f"{section}.{literal}" and "conn_id" in e.value.message


def test_bad_conn_id_is_an_error() -> None:
    with pytest.raises(ConfigError) as e:
        parse_pipeline(raw(sink={"conn_id": "a b", "table": "t"}), "p.yaml", env={})
    assert e.value.field == "sink.conn_id"


def test_resolve_fills_dsn_and_librdkafka_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    cfg = parse_pipeline(raw(kafka={"conn_id": "kc", "client": {"client.id": "mine"}}),
                         "p.yaml", env={})
    out = connections.resolve(cfg, CONNS.__getitem__)
    assert out.bootstrap_servers == "b1:9092,b2:9092"
    assert out.client == {"security.protocol": "SASL_SSL", "sasl.password": "kpw",
                          "client.id": "mine"}  # group.id is OffsetFlow's
    dsn = psycopg2.extensions.parse_dsn(out.sink.connection)
    assert dsn == {"host": "db", "port": "6432", "dbname": "wh", "user": "u",
                   "password": "p w'd", "sslmode": "require"}
    assert out.fingerprint() == cfg.fingerprint()  # credentials are not the output
    assert "p w'd" not in json.dumps(out.redacted(), default=str)
    assert "kpw" not in json.dumps(out.redacted(), default=str)


def test_handover_round_trip_needs_no_airflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    cfg = parse_pipeline(raw(), "p.yaml", env={})
    resolved = connections.resolve(cfg, CONNS.__getitem__)
    env = connections.handover_env(resolved)
    monkeypatch.setenv(connections.HANDOVER_ENV, env[connections.HANDOVER_ENV])

    def no_lookup(conn_id: str) -> Any:
        raise AssertionError("the driver must not look connections up")

    driver = connections.resolve(cfg, no_lookup)
    assert driver == resolved
    assert connections.handover_env(parse_pipeline(
        raw(kafka={"bootstrap_servers": "b:1"}, sink={"connection": "dbname=x", "table": "t"}),
        "p.yaml", env={})) == {}


@pytest.mark.parametrize("conns,field_,words", [
    ({}, "kafka.conn_id", "'kc' could not be read"),
    ({"kc": Conn("kc", "postgres")}, "kafka.conn_id", "type 'postgres', not 'kafka'"),
    ({"kc": Conn("kc", "kafka")}, "kafka.conn_id", "no bootstrap.servers"),
    ({"kc": CONNS["kc"], "pc": Conn("pc", "postgres", host="h")}, "sink.conn_id",
     "no database"),
])
def test_connection_errors_name_the_field(conns: dict[str, Conn], field_: str, words: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    cfg = parse_pipeline(raw(), "p.yaml", env={})
    with pytest.raises(ConfigError) as e:
        connections.resolve(cfg, conns.__getitem__)
    assert e.value.field == field_ and words in e.value.message, e.value.message


def test_asset_uris_follow_the_providers_forms() -> None:
    assert assets.table_uri("postgresql://u:pw@db:6432/wh", "s.t") == "postgres://db:6432/wh/s/t"
    assert assets.table_uri("host=db dbname=wh password=x", "t") == \
        "postgres://db:5432/wh/public/t"
    assert assets.topic_uri("SASL_SSL://b1:9092,b2:9092", "orders") == "kafka://b1:9092/orders"


@pytest.mark.parametrize("value,ids", [
    (None, []), ("None", []), ("", []), ("[]", []), (7, [7]), ("7", [7]), ([7, "8"], [7, 8]),
    ("[7, 8]", [7, 8]), ("7,8", [7, 8])])
def test_batch_id_list(value: Any, ids: list[int]) -> None:
    assert batch_id_list(value) == ids


def test_handover_wins_over_literal_addresses_in_the_drivers_file(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A task that overrode the file's connections (operator `postgres_conn_id=` /
    `kafka_conn_id=`) hands the driver its values; the driver reloads the file, which names
    literal brokers and a literal DSN, and must still read and commit where the task
    planned (a driver on the file's ledger would mark another ledger's batch running)."""
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    task_cfg = connections.resolve(parse_pipeline(raw(), "p.yaml", env={}), CONNS.__getitem__)
    monkeypatch.setenv(connections.HANDOVER_ENV,
                       connections.handover_env(task_cfg)[connections.HANDOVER_ENV])
    file_cfg = parse_pipeline(raw(kafka={"bootstrap_servers": "other:1"},
                                  sink={"connection": "dbname=other", "table": "s.t"}),
                              "p.yaml", env={})
    driver = connections.resolve(file_cfg, lambda conn_id: (_ for _ in ()).throw(
        AssertionError("the driver must not look connections up")))
    assert driver.sink.connection == task_cfg.sink.connection
    assert driver.bootstrap_servers == "b1:9092,b2:9092"
