"""Pipelines naming Airflow connections: config fields, connection -> DSN / librdkafka
settings, the hand-over to the spark-submit driver, asset URIs (pure; no Airflow needed)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
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
    env = connections.handover_env(resolved, CONNS.__getitem__)
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
    ({"kc": Conn("kc", "kafka")}, "kafka.conn_id",
     "Airflow connection 'kc': config['bootstrap.servers'] must be provided"),
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
                       connections.handover_env(task_cfg, CONNS.__getitem__)[
                           connections.HANDOVER_ENV])
    file_cfg = parse_pipeline(raw(kafka={"bootstrap_servers": "other:1"},
                                  sink={"connection": "dbname=other", "table": "s.t"}),
                              "p.yaml", env={})
    driver = connections.resolve(file_cfg, lambda conn_id: (_ for _ in ()).throw(
        AssertionError("the driver must not look connections up")))
    assert driver.sink.connection == task_cfg.sink.connection
    assert driver.bootstrap_servers == "b1:9092,b2:9092"


# -- the providers' hooks build the settings (issue 29 item 3) -------------------------------
def token_cb(config_str: str) -> tuple[str, float]:
    """An OAUTHBEARER callback a connection names by its dotted path."""
    return "token", 0.0


CALLBACK = f"{__name__}.token_cb"
OAUTH = Conn("ko", "kafka", extra_dejson={"bootstrap.servers": "b:9092",
                                          "security.protocol": "SASL_SSL",
                                          "sasl.mechanism": "OAUTHBEARER", "oauth_cb": CALLBACK,
                                          "sasl.oauthbearer.client.secret": "oauth-secret"})


def _cfg(**over: Any) -> Any:
    return parse_pipeline(raw(**over), "p.yaml", env={})


def test_an_allow_listed_oauth_callback_is_resolved_here_and_in_the_driver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Kafka provider resolves `oauth_cb` from its dotted path when `[apache_kafka]
    callback_allowlist` lists it; the driver gets the connection's extra (a callable cannot
    travel as JSON) and resolves it with the same hook."""
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    monkeypatch.setenv("AIRFLOW__APACHE_KAFKA__CALLBACK_ALLOWLIST", CALLBACK)
    conns = {**CONNS, "ko": OAUTH}
    cfg = _cfg(kafka={"conn_id": "ko"})
    task = connections.resolve(cfg, conns.__getitem__)
    assert task.client["oauth_cb"] is token_cb
    assert task.consumer_settings()["oauth_cb"] is token_cb
    env = connections.handover_env(task, conns.__getitem__)
    assert "oauth-secret" in env[connections.HANDOVER_ENV]  # for the driver's process only
    monkeypatch.setenv(connections.HANDOVER_ENV, env[connections.HANDOVER_ENV])
    driver = connections.resolve(cfg, lambda conn_id: (_ for _ in ()).throw(
        AssertionError("the driver must not look connections up")))
    assert driver.client["oauth_cb"] is token_cb and driver.bootstrap_servers == "b:9092"
    shown = json.dumps(driver.redacted())
    assert f"<callback {CALLBACK}>" in shown and "oauth-secret" not in shown
    assert "oauth-secret" not in repr(driver) and "p w'd" not in repr(driver)


def test_a_callback_not_allow_listed_is_refused_naming_the_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    monkeypatch.delenv("AIRFLOW__APACHE_KAFKA__CALLBACK_ALLOWLIST", raising=False)
    with pytest.raises(ConfigError) as e:
        connections.resolve(_cfg(kafka={"conn_id": "ko"}), {**CONNS, "ko": OAUTH}.__getitem__)
    assert e.value.field == "kafka.conn_id"
    assert "Airflow connection 'ko'" in e.value.message
    assert "callback_allowlist" in e.value.message and "oauth-secret" not in str(e.value)


def test_msk_iam_brokers_get_the_providers_token_callback_or_say_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OAUTHBEARER to Amazon MSK: the Kafka provider adds its MSK IAM token callback (here
    the signer library is not installed: the error names the connection and the extra)."""
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    msk = Conn("msk", "kafka", extra_dejson={
        "bootstrap.servers": "b-1.demo.abcde1.c2.kafka.eu-west-1.amazonaws.com:9098",
        "security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"})
    try:
        import aws_msk_iam_sasl_signer  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError) as e:
            connections.resolve(_cfg(kafka={"conn_id": "msk"}), {**CONNS, "msk": msk}.__getitem__)
        assert "'msk'" in e.value.message and "msk" in e.value.message.split(":", 1)[1]
        assert "aws_msk_iam_sasl_signer" in e.value.message
    else:  # pragma: no cover - with the extra installed
        out = connections.resolve(_cfg(kafka={"conn_id": "msk"}), {**CONNS, "msk": msk}.__getitem__)
        assert callable(out.client["oauth_cb"])


def test_postgres_iam_token_becomes_the_dsns_password_and_is_masked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`"iam": true`: PostgresHook makes the password (an RDS/Redshift/Azure token); the DSN
    carries it, the task's log masker knows it."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook
    from airflow.sdk.log import redact

    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    iam = Conn("pi", "postgres", host="db.rds", port=5432, schema="wh", login="app",
               extra_dejson={"iam": True, "sslmode": "verify-full", "aws_conn_id": "aws_x"})
    monkeypatch.setattr(PostgresHook, "get_iam_token",
                        lambda self, conn: ("app", "rds-token-123", 5432))
    out = connections.resolve(_cfg(sink={"conn_id": "pi", "table": "t"}),
                              {**CONNS, "pi": iam}.__getitem__)
    assert psycopg2.extensions.parse_dsn(out.sink.connection) == {
        "host": "db.rds", "port": "5432", "dbname": "wh", "user": "app",
        "password": "rds-token-123", "sslmode": "verify-full"}
    assert "rds-token-123" not in str(redact(f"dsn {out.sink.connection}"))


def test_postgres_iam_without_the_amazon_provider_says_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    iam = Conn("pi", "postgres", host="db.rds", schema="wh", login="app", password="pw-x",
               extra_dejson={"iam": True})
    try:
        import airflow.providers.amazon  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError) as e:
            connections.resolve(_cfg(sink={"conn_id": "pi", "table": "t"}),
                                {**CONNS, "pi": iam}.__getitem__)
        assert e.value.field == "sink.conn_id" and "Airflow connection 'pi'" in e.value.message
        assert "apache-airflow-providers-amazon" in e.value.message
        assert "pw-x" not in str(e.value)
    else:  # pragma: no cover
        pytest.skip("the amazon provider is installed")


def test_an_extra_libpq_does_not_know_is_an_error_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    odd = Conn("po", "postgres", host="db", schema="wh", login="u", password="pw-y",
               extra_dejson={"sslmod": "require"})
    with pytest.raises(ConfigError) as e:
        connections.resolve(_cfg(sink={"conn_id": "po", "table": "t"}),
                            {**CONNS, "po": odd}.__getitem__)
    assert "Airflow connection 'po'" in e.value.message and "sslmod" in e.value.message
    assert "pw-y" not in str(e.value)


def test_the_driver_builds_plain_settings_without_importing_airflow(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Settings without callbacks travel as they are: the spark-submit driver of a SCRAM or
    SSL pipeline does not import Airflow (seconds per batch), only one with a callback."""
    import subprocess
    import sys

    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    monkeypatch.setenv("AIRFLOW__APACHE_KAFKA__CALLBACK_ALLOWLIST", CALLBACK)
    (tmp_path / "p.yaml").write_text(json.dumps(raw()))
    probe = ("import sys; from offsetflow.config import load_pipeline; "
             "from offsetflow.orchestration.connections import resolve; "
             f"cfg = resolve(load_pipeline({str(tmp_path / 'p.yaml')!r})); "
             "print(cfg.bootstrap_servers, type(cfg.client.get('oauth_cb')).__name__, "
             "'airflow' in sys.modules)")
    for conns, expect in (({**CONNS}, "b1:9092,b2:9092 NoneType False"),
                          ({**CONNS, "kc": replace(OAUTH, conn_id="kc")},
                           "b:9092 function True")):
        task = connections.resolve(_cfg(), conns.__getitem__)
        env = {**os.environ, **connections.handover_env(task, conns.__getitem__)}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout.split("\n")[-2:] == [expect, ""], out.stderr[-3000:]


def test_schema_registry_from_an_http_connection_is_resolved_masked_and_handed_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    masked: list[str] = []
    monkeypatch.setattr(connections, "_mask_value", masked.append)
    conns = {**CONNS, "sr": Conn("sr", "http", host="sr.example", port=8081, schema="https",
                                 login="svc", password="sr-s3cret")}
    d = raw(format={"type": "avro", "schema": {"id": "long"},
                    "schema_registry": {"conn_id": "sr", "reader_version": 2}})
    cfg = parse_pipeline(d, "p.yaml", env={})
    assert cfg.registry is not None and cfg.registry.conn_id == "sr" and cfg.registry.url == ""
    out = connections.resolve(cfg, conns.__getitem__)
    assert out.registry is not None
    assert (out.registry.url, out.registry.username, out.registry.password,
            out.registry.reader_version) == ("https://sr.example:8081", "svc", "sr-s3cret", 2)
    assert "sr-s3cret" in masked  # Airflow masks it in task logs
    assert "sr-s3cret" not in repr(out) and "sr-s3cret" not in json.dumps(out.redacted(),
                                                                          default=str)
    assert out.fingerprint() == cfg.fingerprint()
    env = connections.handover_env(out, conns.__getitem__)
    monkeypatch.setenv(connections.HANDOVER_ENV, env[connections.HANDOVER_ENV])

    def no_lookup(conn_id: str) -> Any:
        raise AssertionError("the driver must not look connections up")

    assert connections.resolve(cfg, no_lookup) == out
    # a host with its scheme and port as written; no login: no basic auth
    assert connections.registry_of(Conn("x", "http", host="http://sr:18081/", port=9)) == {
        "url": "http://sr:18081", "username": None, "password": None}


@pytest.mark.parametrize("registry,field_,words", [
    ({"conn_id": "sr", "url": "http://x"}, "format.schema_registry.url", "not both"),
    ({"conn_id": "sr", "password": "p", "username": "u"}, "format.schema_registry.username",
     "not both"),
    ({"conn_id": "s r"}, "format.schema_registry.conn_id", "not an Airflow connection id"),
])
def test_schema_registry_conn_id_refusals(registry: dict[str, Any], field_: str,
                                          words: str) -> None:
    d = raw(format={"type": "avro", "schema": {"id": "long"}, "schema_registry": registry})
    with pytest.raises(ConfigError) as e:
        parse_pipeline(d, "p.yaml", env={})
    assert e.value.field == field_ and words in e.value.message, e.value


def test_schema_registry_connection_of_another_type_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    d = raw(format={"type": "avro", "schema": {"id": "long"},
                    "schema_registry": {"conn_id": "pc"}})
    with pytest.raises(ConfigError) as e:
        connections.resolve(parse_pipeline(d, "p.yaml", env={}), CONNS.__getitem__)
    assert e.value.field == "format.schema_registry.conn_id" and "not 'http'" in e.value.message


def _kafka_sink_avro(registry: dict[str, Any]) -> dict[str, Any]:
    return raw(format={"type": "json", "schema": {"id": "long"}},
               sink={"type": "kafka", "conn_id": "pc", "topic": "out", "value_format": "avro",
                     "schema_registry": registry})


def test_the_kafka_sinks_registry_from_an_http_connection_is_resolved_masked_and_handed_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`sink.schema_registry.conn_id` (a Kafka sink writing Avro values to a registry of its
    own, not the source's): resolved like format.schema_registry.conn_id, masked, handed to
    the driver, never in the config's repr or fingerprint."""
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    masked: list[str] = []
    monkeypatch.setattr(connections, "_mask_value", masked.append)
    conns = {**CONNS, "out-sr": Conn("out-sr", "http", host="https://out-sr.example",
                                     port=8443, login="writer", password="w-s3cret")}
    cfg = parse_pipeline(_kafka_sink_avro({"conn_id": "out-sr", "timeout_s": 7}), "p.yaml",
                         env={})
    reg = cfg.sink.kafka.registry
    assert reg is not None and reg.conn_id == "out-sr" and reg.url == ""
    out = connections.resolve(cfg, conns.__getitem__)
    got = out.sink.kafka.registry
    assert got is not None
    assert (got.url, got.username, got.password, got.timeout_s) == (
        "https://out-sr.example:8443", "writer", "w-s3cret", 7)
    assert "w-s3cret" in masked
    assert "w-s3cret" not in repr(out) and "w-s3cret" not in json.dumps(out.redacted(),
                                                                          default=str)
    assert out.fingerprint() == cfg.fingerprint()
    env = connections.handover_env(out, conns.__getitem__)
    assert "w-s3cret" in env[connections.HANDOVER_ENV]  # only in the driver's environment
    monkeypatch.setenv(connections.HANDOVER_ENV, env[connections.HANDOVER_ENV])

    def no_lookup(conn_id: str) -> Any:
        raise AssertionError("the driver must not look connections up")

    assert connections.resolve(cfg, no_lookup) == out


@pytest.mark.parametrize("registry,field_,words", [
    ({"conn_id": "sr", "url": "http://x"}, "sink.schema_registry.url", "not both"),
    ({"conn_id": "sr", "password": "p", "username": "u"}, "sink.schema_registry.username",
     "not both"),
    ({"conn_id": "s r"}, "sink.schema_registry.conn_id", "not an Airflow connection id"),
])
def test_the_kafka_sinks_registry_conn_id_refusals(registry: dict[str, Any], field_: str,
                                                   words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_pipeline(_kafka_sink_avro(registry), "p.yaml", env={})
    assert e.value.field == field_ and words in e.value.message, e.value


def test_the_kafka_sinks_registry_connection_of_another_type_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(connections.HANDOVER_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        connections.resolve(parse_pipeline(_kafka_sink_avro({"conn_id": "pc"}), "p.yaml",
                                           env={}), CONNS.__getitem__)
    assert e.value.field == "sink.schema_registry.conn_id" and "not 'http'" in e.value.message
