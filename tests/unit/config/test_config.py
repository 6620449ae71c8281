from pathlib import Path
from typing import Any

import pytest
import yaml

from offsetflow.config import (
    config_drift,
    connect_address,
    load_pipeline,
    parse_pipeline,
    redact_dsn,
)
from offsetflow.config.schema import ConfigDrift
from offsetflow.errors import ConfigError

ENV = {"OFFSETFLOW_PG_DSN": "postgresql://u:secret@h:1/db"}


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:19092"},
        "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "string", "amount": "double"}},
        "sink": {"table": "raw.orders"},
    }
    d.update(over)
    return d


def test_defaults_are_safe() -> None:
    cfg = parse_pipeline(base(), "orders.yaml", ENV)
    assert cfg.name == "orders"
    assert cfg.isolation_level == "read_committed"
    assert cfg.data_loss == "fail" and cfg.bad_records == "fail"
    assert cfg.sink.mode == "append" and cfg.sink.connection == ENV["OFFSETFLOW_PG_DSN"]
    conf = cfg.consumer_settings()
    assert conf["enable.auto.commit"] == "false" and conf["auto.offset.reset"] == "error"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"name": "Bad-Name"}, "name", "must match"),
        ({"source": {}}, "source.topics", "exactly one"),
        ({"source": {"topics": ["a"], "topic_pattern": "a.*"}}, "source.topics", "exactly one"),
        ({"source": {"topics": ["bad topic"]}}, "source.topics[0]", "not a valid Kafka topic"),
        ({"source": {"topic_pattern": "("}}, "source.topic_pattern", "invalid regular"),
        ({"source": {"topics": ["a"], "max_records_per_partition": 0}},
         "source.max_records_per_partition", ">= 1"),
        ({"source": {"topics": ["a"], "starting": "yesterday"}}, "source.starting",
         "use earliest"),
        ({"source": {"topics": ["a"], "starting": {"timestamp": "2026-13-01T00:00:00"}}},
         "source.starting.timestamp", "not an ISO-8601 time"),
        ({"source": {"topics": ["a"], "data_loss": "ignore"}}, "source.data_loss", "not one of"),
        ({"sink": {"table": "x; DROP TABLE y"}}, "sink.table", "not a valid table name"),
        ({"sink": {"table": "a.b.c"}}, "sink.table", "not a valid table name"),
        ({"sink": {"table": "t", "mode": "upsert"}}, "sink.key", "needs a key"),
        ({"sink": {"table": "t", "mode": "upsert", "key": ["nope"]}}, "sink.key[0]",
         "not a column"),
        ({"sink": {"table": "t", "mode": "upsert", "key": ['id"--']}}, "sink.key[0]",
         "not a valid column"),
        ({"format": {"type": "json", "schema": {"offset": "long"}}}, "format.schema.offset",
         "reserved"),
        ({"format": {"type": "json", "schema": {"x": "uuid4"}}}, "format.schema.x", "unknown type"),
        ({"format": {"type": "json"}}, "format.schema", "needs a schema"),
        ({"kafka": {"client": {"enable.auto.commit": True}}}, "kafka.client.enable.auto.commit",
         "managed by OffsetFlow"),
        ({"transform": "notdotted"}, "transform", "dotted path"),
        ({"spark": {"launch": "yarn"}}, "spark.launch", "not one of"),
        ({"spark": {"launch": "connect", "connect_url": "http://h:15002"}},
         "spark.connect_url", "not a Spark Connect URL"),
        ({"surprise": 1}, "surprise", "unknown field"),
    ],
)
def test_errors_name_file_and_field(change: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_pipeline(base(**change), "include/pipelines/orders.yaml", ENV)
    assert ei.value.field == field
    assert words in str(ei.value)
    assert str(ei.value).startswith("include/pipelines/orders.yaml: " + field)


def test_env_interpolation_and_missing_variable() -> None:
    raw = base(kafka={"bootstrap_servers": "${BROKERS:-localhost:1}",
                      "client": {"sasl.password": "${KPASS}"}})
    cfg = parse_pipeline(raw, "p.yaml", {**ENV, "KPASS": "hunter2"})
    assert cfg.bootstrap_servers == "localhost:1"
    assert cfg.client["sasl.password"] == "hunter2"
    assert "hunter2" not in str(cfg.redacted())
    assert "secret" not in str(cfg.redacted())
    with pytest.raises(ConfigError, match="KPASS is not set"):
        parse_pipeline(raw, "p.yaml", ENV)


def test_redact_dsn_forms() -> None:
    assert redact_dsn("postgresql://u:pw@h:5/db") == "postgresql://u:***@h:5/db"
    assert "pw" not in redact_dsn("host=h password=pw user=u")
    # what is no secret stays readable: a PostgreSQL user, a registry's plain URL
    assert redact_dsn("postgresql://u@h:5/db") == "postgresql://u@h:5/db"
    assert redact_dsn("http://registry:8081/?a=1") == "http://registry:8081/?a=1"


@pytest.mark.parametrize("dsn, secret", [
    ("host=h password='sec ret pw' dbname=x", "ret pw"),   # quoted, with spaces
    ("password='a\\'b c' user=u", "b c"),                 # escaped quote inside
    ("postgresql://:s3cret@h/db", "s3cret"),               # empty user
    ("postgresql://u:p@ss@h/db", "ss"),                    # unencoded @ in the password
    ("https://u:pa/ss@registry:8081", "pa/ss"),            # unencoded / in the password
    ("https://APIKEY123@registry:8081", "APIKEY123"),      # an API key as the user part
    ("https://registry:8081/?api_key=SECRET9", "SECRET9"),  # a secret query parameter
    ("http://r:8081/x?a=1&access_token=TOK7", "TOK7"),
])
def test_redact_dsn_hides_the_whole_password(dsn: str, secret: str) -> None:
    out = redact_dsn(dsn)
    assert secret not in out and "***" in out, out


def test_fingerprint_changes_with_sink_but_not_with_rate_limit() -> None:
    a = parse_pipeline(base(), "p.yaml", ENV)
    b = parse_pipeline(base(source={"topics": ["orders"], "max_records_per_partition": 5}),
                       "p.yaml", ENV)
    c = parse_pipeline(base(sink={"table": "other"}), "p.yaml", ENV)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_fingerprint_leaves_the_split_out() -> None:
    a = parse_pipeline(base(spark={"max_offsets_per_task": 1000}), "p.yaml", ENV)
    b = parse_pipeline(base(spark={"max_offsets_per_task": 2000}), "p.yaml", ENV)
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint_v1(1000) != a.fingerprint_v1(2000)


# fingerprints the release before ledger migration 0003 recorded for base() (split hashed in)
V1_AT_250K = "f0ecc36111483223"
V1_AT_50K = "68e0d22a09772dfd"


@pytest.mark.parametrize(("split_now", "fingerprint", "split_offsets", "sink", "drift"), [
    # batches that record their split: only the output decides whether the user must accept
    (100_000, "now", 100_000, "raw.orders", ConfigDrift(False)),
    (100_000, "now", 250_000, "raw.orders", ConfigDrift(False, 250_000)),
    (100_000, "now", 100_000, "raw.other", ConfigDrift(True)),
    (100_000, "now", 250_000, "raw.other", ConfigDrift(True, 250_000)),
    # batches planned before 0003: matched with their likely split
    (50_000, V1_AT_50K, None, "raw.orders", ConfigDrift(False)),
    (100_000, V1_AT_250K, None, "raw.orders", ConfigDrift(False, 250_000)),  # the default moved
    (100_000, V1_AT_50K, None, "raw.orders", ConfigDrift(True)),  # an explicit split changed
    (250_000, V1_AT_250K, None, "raw.other", ConfigDrift(True)),
    (100_000, None, None, "raw.other", ConfigDrift(False)),  # no fingerprint recorded at all
])
def test_config_drift(split_now: int, fingerprint: str | None, split_offsets: int | None,
                      sink: str, drift: ConfigDrift) -> None:
    planned = parse_pipeline(base(), "orders.yaml", ENV)
    cfg = parse_pipeline(base(sink={"table": sink}, spark={"max_offsets_per_task": split_now}),
                         "orders.yaml", ENV)
    recorded = planned.fingerprint() if fingerprint == "now" else fingerprint
    assert config_drift(cfg, recorded, split_offsets) == drift


def test_load_pipeline_reports_yaml_errors(tmp_path: Path) -> None:
    f = tmp_path / "broken.yaml"
    f.write_text("source: [unclosed")
    with pytest.raises(ConfigError, match="broken.yaml: <yaml>"):
        load_pipeline(f, ENV)
    g = tmp_path / "good.yaml"
    g.write_text(yaml.safe_dump(base()))
    assert load_pipeline(g, ENV).name == "good"


def test_shipped_pipelines_are_valid() -> None:
    root = Path(__file__).resolve().parents[3] / "include" / "pipelines"
    files = sorted(root.glob("*.yaml"))
    assert files, "include/pipelines has no pipeline"
    for f in files:
        load_pipeline(f, ENV)


@pytest.mark.parametrize(
    ("url", "address"),
    [("sc://127.0.0.1:15002", ("127.0.0.1", 15002)),
     ("sc://spark-connect.internal", ("spark-connect.internal", 15002)),
     ("sc://h:443/;use_ssl=true;token=abc", ("h", 443)),
     ("sc://[::1]:15003", ("::1", 15003))],
)
def test_connect_address(url: str, address: tuple[str, int]) -> None:
    assert connect_address(url) == address


def test_bad_connect_url_error_never_shows_its_token() -> None:
    with pytest.raises(ValueError, match="not a Spark Connect URL") as ei:
        connect_address("grpc://h:1/;token=s3cret")
    assert "s3cret" not in str(ei.value)


@pytest.mark.parametrize("tz", ["UTC", "America/New_York", "Asia/Kolkata"])
@pytest.mark.parametrize("value", ["2026-01-01 00:00:00", "'2026-01-01 00:00:00'",
                                   "'2026-01-01T00:00:00'", "2026-01-01T00:00:00Z",
                                   "'2026-01-01T01:00:00+01:00'", "1767225600000"])
def test_start_time_without_zone_is_utc_whatever_the_machine_zone(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, tz: str, value: str) -> None:
    """Unquoted, YAML gives a zone-less time as a naive datetime; quoted, as a string. Both
    mean UTC (2026-01-01T00:00:00Z = 1767225600000 ms), never the machine's local time."""
    import time

    from offsetflow.config import load_pipeline

    monkeypatch.setenv("TZ", tz)
    time.tzset()
    try:
        f = tmp_path / "orders.yaml"
        f.write_text(f"""
kafka: {{bootstrap_servers: "127.0.0.1:19092"}}
source:
  topics: [orders]
  starting: {{timestamp: {value}}}
format: {{type: json, schema: {{id: string}}}}
sink: {{table: orders, connection: "postgresql://h/db"}}
""")
        cfg = load_pipeline(f)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert cfg.starting.kind == "timestamp"
    assert cfg.starting.timestamp_ms == 1767225600000


def test_conn_ids_replace_bootstrap_servers_and_connection() -> None:
    """With Airflow connections named, the addresses and the DSN may be left out (and no
    environment variable is needed for them); the ids are on cfg.kafka / cfg.sink."""
    raw = base(kafka={"conn_id": "kafka_default"},
               sink={"table": "raw.orders", "conn_id": "offsetflow_pg"})
    cfg = parse_pipeline(raw, "orders.yaml", {})
    assert cfg.kafka.conn_id == "kafka_default" and cfg.sink.conn_id == "offsetflow_pg"
    assert cfg.bootstrap_servers == "" and cfg.sink.connection == ""
    assert cfg.fingerprint() == parse_pipeline(base(), "orders.yaml", ENV).fingerprint()
    with pytest.raises(ConfigError) as e:  # one source of truth for the brokers
        parse_pipeline(base(kafka={"conn_id": "k", "bootstrap_servers": "h:1"}), "o.yaml", ENV)
    assert e.value.field == "kafka.bootstrap_servers" and "not both" in e.value.message
    plain = parse_pipeline(base(), "orders.yaml", ENV)
    assert plain.kafka.conn_id is None and plain.sink.conn_id is None


@pytest.mark.parametrize("raw, field, words", [
    (base(sink={"table": "t"}), "sink.connection",
     "OFFSETFLOW_PG_DSN is not set (give sink.connection, or sink.conn_id"),
    (base(sink={"table": "t", "connection": ""}), "sink.connection",
     "must not be empty (or give sink.conn_id"),
    (base(kafka={"bootstrap_servers": " "}), "kafka.bootstrap_servers",
     "must not be empty (or give kafka.conn_id"),
    (base(kafka={"conn_id": "bad id!"}), "kafka.conn_id", "is not an Airflow connection id"),
    (base(sink={"table": "t", "conn_id": 5}), "sink.conn_id", "must be a string"),
])
def test_missing_or_bad_connection_names_the_field(raw: dict[str, Any], field: str,
                                                    words: str) -> None:
    with pytest.raises(ConfigError) as ei:
        parse_pipeline(raw, "orders.yaml", {})
    assert ei.value.field == field and words in ei.value.message


def test_admin_clients_keep_librdkafka_info_notes_off_the_console() -> None:
    assert parse_pipeline(base(), "o.yaml", ENV).admin_settings()["log_level"] == "4"
    chatty = base(kafka={"bootstrap_servers": "h:1", "client": {"log_level": 7}})
    assert parse_pipeline(chatty, "o.yaml", ENV).admin_settings()["log_level"] == "7"


@pytest.mark.parametrize("over,secret", [
    ({}, "secret"),  # the DSN's password
    ({"kafka": {"bootstrap_servers": "b:1", "client": {"sasl.password": "kpw-1"}}}, "kpw-1"),
    ({"sink": {"type": "kafka", "topic": "out", "producer": {"sasl.password": "ppw-2"}}},
     "ppw-2"),
    ({"sink": {"type": "iceberg", "table": "ns.t",
               "catalog": {"warehouse": "file:///tmp/lake",
                           "properties": {"s3.secret-access-key": "ipw-3"}}}}, "ipw-3"),
])
def test_a_configs_repr_shows_no_credentials(over: dict[str, Any], secret: str) -> None:
    """An exception, a log line or a test failure that shows a config shows its repr: the
    DSN, client and producer settings and catalog properties are left out of it."""
    from offsetflow.job.tasks import ReadContext

    cfg = parse_pipeline(base(**over), "p.yaml", ENV)
    assert secret not in repr(cfg), repr(cfg)
    rc = ReadContext.of(cfg, 1, cfg.sink.connection or ENV["OFFSETFLOW_PG_DSN"], [])
    assert "secret" not in repr(rc) and secret not in repr(rc)


def test_a_read_contexts_repr_shows_no_registry_password() -> None:
    """The registry settings a Spark task receives hold the password (now also from an
    Airflow `http` connection, format.schema_registry.conn_id): not in the repr."""
    from offsetflow.job.tasks import ReadContext
    from offsetflow.source import registry_settings

    rc = ReadContext(1, "dsn", "p", {}, {"id": "long"}, "avro", False, [], None,
                     registry_settings("http://sr:8081", "u", "rpw-4", 10), None, None)
    assert "rpw-4" not in repr(rc), repr(rc)


@pytest.mark.parametrize("where", ["sink", "format"])
def test_a_password_of_the_wrong_type_is_never_echoed_in_the_error(where: str) -> None:
    """An unquoted numeric password in YAML is an int: the config error names the field
    and the type, never the value (config errors are logged and shown in Airflow)."""
    reg = {"url": "http://sr:8081", "username": "u", "password": 98765432}
    raw = base(sink={"type": "kafka", "connection": "postgresql://x/y", "topic": "out",
                     "value_format": "avro", **({"schema_registry": reg} if where == "sink"
                                                else {})})
    if where == "format":
        raw["format"] = {"type": "avro", "schema_registry": reg}
    with pytest.raises(ConfigError) as e:
        parse_pipeline(raw, "p.yaml", {})
    assert f"{'sink' if where == 'sink' else 'format'}.schema_registry.password" in str(e.value)
    assert "98765432" not in str(e.value) and "int" in str(e.value)
