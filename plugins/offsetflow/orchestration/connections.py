"""Airflow connections -> what a pipeline needs: a PostgreSQL DSN, librdkafka settings
and a schema registry.

A pipeline names `kafka.conn_id` (a `kafka` connection), `sink.conn_id` (a `postgres`
connection) and/or `format.schema_registry.conn_id` / a Kafka sink's
`sink.schema_registry.conn_id` (an `http` connection: URL from host,
scheme and port, basic auth from login and password; `registry_of`). Kafka's and
PostgreSQL's become client settings through the providers' own hooks, so whatever the
pinned providers support works here too:

- Kafka: `KafkaBaseHook` builds the confluent-kafka config from the connection's extra,
  resolving callbacks given as dotted paths (`oauth_cb`, `error_cb`, ...) only when
  `[apache_kafka] callback_allowlist` lists them, and adding the OAUTHBEARER token callback of
  Amazon MSK IAM or Google Managed Kafka when the brokers are theirs;
- PostgreSQL: `PostgresHook` builds the connect arguments, its extra's libpq options
  (`sslmode`, ...) and, with `"iam": true`, a token of RDS, Redshift or Azure Entra ID as the
  password; OffsetFlow turns them into a libpq DSN (its ledger, commit and stage use one).

They are resolved where the pipeline runs: in an Airflow task through the Task SDK (which
masks the password in task logs), in the CLI and the plugin page through Airflow's secrets
backends and metadata DB.

The spark-submit driver cannot look connections up (it is not a task). The run-batch
operator hands it what it needs in one environment variable of the spark-submit process
(`HANDOVER_ENV`, client/local mode): the Kafka settings the hook built (or, when they hold
callbacks, which are code, the connection's extra: the driver builds them with the same hook)
and the PostgreSQL DSN. Never on a command line, in Spark conf or in a file left on disk after
a crash; /proc/<pid>/environ is readable only by the same user.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg2
import psycopg2.extensions

from offsetflow.config import (
    FORBIDDEN_CLIENT_KEYS,
    KafkaConfig,
    PipelineConfig,
    SchemaRegistryConfig,
    redact_value,
)
from offsetflow.errors import ConfigError

log = logging.getLogger(__name__)

HANDOVER_ENV = "OFFSETFLOW_RESOLVED_CONNECTIONS"
# what PostgresHook may put in its connect arguments that is no libpq keyword
NOT_LIBPQ = ("cursor_factory", "row_factory")

Lookup = Callable[[str], Any]  # conn_id -> an Airflow Connection (host, port, extra_dejson...)


@dataclass(frozen=True)
class KafkaConnection:
    """What the Kafka hook reads of a `kafka` connection: as the driver receives it, and a
    copy for the hook (which resolves callbacks in the dict `extra_dejson` returns)."""

    conn_id: str
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)
    conn_type: str = "kafka"

    @property
    def extra_dejson(self) -> dict[str, Any]:
        return copy.deepcopy(dict(self.extra))


@functools.cache
def _postgres_hook() -> type:
    """PostgresHook whose connection is the one given and whose `get_conn` returns the
    connect arguments it built (IAM token and extras included) instead of connecting."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    class ConnectArgs(PostgresHook):
        def _create_connection(self, conn_args: dict[str, Any]) -> Any:
            return conn_args

    return ConnectArgs


@functools.cache
def _kafka_hook() -> type:
    """KafkaBaseHook reading the connection it is given, whose client is the config itself
    (the provider's own consumer and producer hooks differ from it only by `_get_client`)."""
    from airflow.providers.apache.kafka.hooks.base import KafkaBaseHook

    class ClientConfig(KafkaBaseHook):
        def __init__(self, conn: Any) -> None:
            super().__init__(kafka_config_id=conn.conn_id)
            self.conn = conn

        def get_connection(self, conn_id: str) -> Any:  # type: ignore[override]
            return self.conn

        def _get_client(self, config: dict[str, Any]) -> dict[str, Any]:
            return config

    return ClientConfig


def postgres_dsn(conn: Any) -> str:
    """libpq DSN of a `postgres` connection, from PostgresHook's connect arguments (schema =
    database, extras as libpq options, an IAM token as the password with `"iam": true`)."""
    if not conn.host:
        raise ValueError("has no host")
    if not conn.schema:
        raise ValueError("has no database (the connection's Schema field)")
    args = _postgres_hook()(postgres_conn_id=conn.conn_id, connection=conn).get_conn()
    password = args.get("password")
    if password and password != conn.password:
        _mask_value(str(password))  # a token the hook generated (IAM): a secret too
    opts = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in args.items()
            if v is not None and k not in NOT_LIBPQ}
    try:
        return psycopg2.extensions.make_dsn(**opts)
    except psycopg2.ProgrammingError as e:  # an extra libpq does not know
        raise ValueError(f"has an extra that is no libpq connection option: "
                         f"{str(e).strip()}") from None


def kafka_settings(conn: Any) -> dict[str, Any]:
    """librdkafka settings of a `kafka` connection as the Kafka provider's hooks build them.
    Keys OffsetFlow owns (group.id, auto-commit, ...) are dropped: offsets live in the ledger
    and the reader assigns and seeks."""
    snapshot = KafkaConnection(conn.conn_id, copy.deepcopy(dict(conn.extra_dejson or {})))
    config: dict[str, Any] = dict(_kafka_hook()(snapshot).get_conn)
    dropped = sorted(k for k in config if k in FORBIDDEN_CLIENT_KEYS)
    if dropped:
        log.info("kafka connection %s: ignoring %s (managed by OffsetFlow)", conn.conn_id,
                 dropped)
    return {str(k): v for k, v in config.items() if k not in FORBIDDEN_CLIENT_KEYS}


def airflow_lookup(conn_id: str) -> Any:
    """The Task SDK inside a task (masks the password); Airflow's secrets backends and
    metadata DB elsewhere (the CLI, the plugin page)."""
    from airflow.sdk import BaseHook

    try:
        return BaseHook.get_connection(conn_id)
    except Exception as task_err:  # noqa: BLE001 - outside a task the SDK cannot answer
        try:
            from airflow.models.connection import Connection

            return Connection.get_connection_from_secrets(conn_id)
        except Exception:  # noqa: BLE001 - report the task-side reason: it names the id
            raise task_err from None


def resolve(cfg: PipelineConfig, lookup: Lookup | None = None) -> PipelineConfig:
    """`cfg` with its connections filled in (bootstrap_servers + client, sink.connection).
    Values handed over by the run-batch operator win, even over a literal address or DSN in
    the file: the task may have overridden the file's connections (`postgres_conn_id=`),
    and the driver must read and commit where the task planned. Otherwise Airflow is
    asked for the connections the config names."""
    handed = dict(_handed_over().get(cfg.name) or {})
    out = cfg
    kafka: Any = None
    settings: dict[str, Any] | None = None
    if "kafka" in handed:
        k = handed["kafka"]
        kafka = KafkaConnection(str(k["conn_id"]), dict(k.get("extra") or {}))
        settings = dict(k["settings"]) if "settings" in k else None
    elif cfg.kafka.conn_id:
        kafka = _lookup(cfg, "kafka.conn_id", cfg.kafka.conn_id, "kafka",
                        lookup or airflow_lookup)
    if kafka is not None:
        if settings is None:
            settings = _convert(cfg, "kafka.conn_id", kafka, kafka_settings)
        bootstrap = str(settings.pop("bootstrap.servers"))
        # the pipeline's own kafka.client settings override the connection's
        out = replace(out, bootstrap_servers=bootstrap, client={**settings, **cfg.client},
                      kafka=KafkaConfig(conn_id=kafka.conn_id))
    dsn = handed.get("sink")
    if dsn is None and cfg.sink.conn_id:
        conn = _lookup(cfg, "sink.conn_id", cfg.sink.conn_id, "postgres",
                       lookup or airflow_lookup)
        dsn = _convert(cfg, "sink.conn_id", conn, postgres_dsn)
    if dsn is not None:
        out = replace(out, sink=replace(out.sink, connection=str(dsn)))
    reg = _resolved_registry(cfg, cfg.registry, "format.schema_registry.conn_id",
                             handed.get("registry"), lookup)
    if reg is not None:
        out = replace(out, registry=reg)
    sink_reg = _resolved_registry(cfg, cfg.sink.kafka.registry if cfg.sink.kafka else None,
                                  "sink.schema_registry.conn_id", handed.get("sink_registry"),
                                  lookup)
    if sink_reg is not None and out.sink.kafka is not None:
        out = replace(out, sink=replace(out.sink, kafka=replace(out.sink.kafka,
                                                                registry=sink_reg)))
    return out


def _resolved_registry(cfg: PipelineConfig, reg: SchemaRegistryConfig | None, fld: str,
                       handed: Mapping[str, Any] | None, lookup: Lookup | None
                       ) -> SchemaRegistryConfig | None:
    """A registry named by an Airflow `http` connection (`fld`), filled in from what the
    task handed over or from Airflow; None when `reg` names no connection."""
    if reg is None or not reg.conn_id:
        return None
    found = handed
    if found is None:
        conn = _lookup(cfg, fld, reg.conn_id, "http", lookup or airflow_lookup)
        found = _convert(cfg, fld, conn, registry_of)
    return replace(reg, url=str(found["url"]), username=found.get("username"),
                   password=found.get("password"))


def registry_of(conn: Any) -> dict[str, Any]:
    """A schema registry from an Airflow `http` connection: the URL from its host (with a
    scheme, or the connection's schema field as one, http by default) and port, basic auth
    from its login and password."""
    host = str(conn.host or "").strip().rstrip("/")
    if not host:
        raise ValueError("has no host (the schema registry's URL, e.g. https://sr:8081)")
    url = host if "://" in host else f"{conn.schema or 'http'}://{host}"
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if conn.port and ":" not in netloc.rsplit("@", 1)[-1]:
        netloc = f"{netloc}:{int(conn.port)}"
    if scheme not in ("http", "https"):
        raise ValueError(f"scheme {scheme!r} is not http or https")
    return {"url": f"{scheme}://{netloc}{slash}{path}".rstrip("/"),
            "username": conn.login or None,
            "password": conn.password if conn.login else None}


def _lookup(cfg: PipelineConfig, fld: str, conn_id: str, want: str, lookup: Lookup) -> Any:
    try:
        conn = lookup(conn_id)
    except Exception as e:  # noqa: BLE001 - any lookup failure is the user's to fix
        raise ConfigError(cfg.source_file, fld, f"Airflow connection {conn_id!r} could "
                                                f"not be read: {e}") from None
    if conn.conn_type not in (want, "postgresql" if want == "postgres" else want):
        raise ConfigError(cfg.source_file, fld, f"Airflow connection {conn_id!r} is of "
                                                f"type {conn.conn_type!r}, not {want!r}")
    _mask(conn)
    return conn


def _convert(cfg: PipelineConfig, fld: str, conn: Any, convert: Callable[[Any], Any]) -> Any:
    """`convert(conn)`; what the hooks refuse (a callback not allow-listed, no
    bootstrap.servers, an IAM token that could not be made) is a ConfigError naming the
    connection and the field, without the connection's secrets."""
    try:
        return convert(conn)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the hooks' own errors (ValueError, boto, ...)
        text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        for secret in _secrets_of(conn):
            text = text.replace(secret, "***")
        raise ConfigError(cfg.source_file, fld,
                          f"Airflow connection {conn.conn_id!r}: {text}") from None


def _secrets_of(conn: Any) -> list[str]:
    out = [str(conn.password)] if getattr(conn, "password", None) else []
    for k, v in (getattr(conn, "extra_dejson", None) or {}).items():
        if isinstance(v, str) and v and redact_value(str(k), v) != v:
            out.append(v)
    return out


def _mask_value(value: str) -> None:
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # pragma: no cover - Airflow is optional for the CLI
        return
    mask_secret(value)


def _mask(conn: Any) -> None:
    """Airflow masks a connection's password when a task reads it; the CLI and pages do not
    log it; mask secrets in the extra too (sasl.password, ssl.key.password, ...)."""
    for secret in _secrets_of(conn):
        _mask_value(secret)


def handover_env(cfg: PipelineConfig, lookup: Lookup | None = None) -> dict[str, str]:
    """The environment a spark-submit driver of the resolved `cfg` needs to run without
    Airflow (empty when the pipeline names no connection): the Kafka settings as the hook
    built them here, or, when they hold callbacks (code cannot travel as JSON), the
    connection's extra, for the driver to build them with the same hook (importing Airflow
    costs it seconds, so only then); and the DSN as resolved here (an IAM token is made
    once). Secret: only for the spark-submit process."""
    values: dict[str, Any] = {}
    if cfg.kafka.conn_id:
        settings = {**cfg.client, "bootstrap.servers": cfg.bootstrap_servers}
        if all(v is None or isinstance(v, str | int | float | bool) for v in settings.values()):
            values["kafka"] = {"conn_id": cfg.kafka.conn_id, "settings": settings}
        else:
            conn = _lookup(cfg, "kafka.conn_id", cfg.kafka.conn_id, "kafka",
                           lookup or airflow_lookup)
            values["kafka"] = {"conn_id": conn.conn_id, "extra": dict(conn.extra_dejson)}
    if cfg.sink.conn_id:
        values["sink"] = cfg.sink.connection
    for key, reg in (("registry", cfg.registry),
                     ("sink_registry", cfg.sink.kafka.registry if cfg.sink.kafka else None)):
        if reg is not None and reg.conn_id:
            values[key] = {"url": reg.url, "username": reg.username, "password": reg.password}
    return {HANDOVER_ENV: json.dumps({cfg.name: values})} if values else {}


def _handed_over(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    raw = (os.environ if env is None else env).get(HANDOVER_ENV)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ConfigError("environment", HANDOVER_ENV, "is not valid JSON") from None
    return data if isinstance(data, dict) else {}
