"""Airflow connections -> what a pipeline needs: a PostgreSQL DSN and librdkafka settings.

A pipeline names `kafka.conn_id` (a `kafka` connection: librdkafka settings in its extra,
as the Kafka provider keeps them) and/or `sink.conn_id` (a `postgres` connection). They are
resolved where the pipeline runs: in an Airflow task through the Task SDK (which masks the
password in task logs), in the CLI through Airflow's secrets backends and metadata DB.

The spark-submit driver cannot look connections up (it is not a task). The run-batch
operator hands it the resolved values in one environment variable of the spark-submit
process (`HANDOVER_ENV`, client/local mode): never on a command line, in Spark conf or in a
file left on disk after a crash, and /proc/<pid>/environ is readable only by the same user.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import psycopg2.extensions

from offsetflow.config import FORBIDDEN_CLIENT_KEYS, PipelineConfig, redact_value
from offsetflow.errors import ConfigError

log = logging.getLogger(__name__)

HANDOVER_ENV = "OFFSETFLOW_RESOLVED_CONNECTIONS"
# libpq keywords a `postgres` connection's extra may carry into the DSN
LIBPQ_EXTRAS = {"sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "connect_timeout",
                "application_name", "options", "target_session_attrs", "keepalives",
                "keepalives_idle", "keepalives_interval", "keepalives_count", "gssencmode",
                "channel_binding", "sslnegotiation"}

Lookup = Callable[[str], Any]  # conn_id -> an Airflow Connection (host, port, extra_dejson...)


def uses_connections(cfg: PipelineConfig) -> bool:
    return bool(cfg.kafka.conn_id or cfg.sink.conn_id)


def postgres_dsn(conn: Any) -> str:
    """libpq DSN of a `postgres` connection (schema = database, as the provider reads it)."""
    if not conn.host:
        raise ValueError("has no host")
    if not conn.schema:
        raise ValueError("has no database (the connection's Schema field)")
    extra = getattr(conn, "extra_dejson", None) or {}
    opts = {k: str(v) for k, v in extra.items() if k in LIBPQ_EXTRAS}
    return psycopg2.extensions.make_dsn(
        host=conn.host, port=conn.port or 5432, dbname=conn.schema, user=conn.login or None,
        password=conn.password or None, **opts)


def kafka_settings(conn: Any) -> dict[str, str]:
    """librdkafka settings of a `kafka` connection (its extra, like the Kafka provider's
    hooks). Keys OffsetFlow owns (group.id, auto-commit, ...) are dropped: offsets live in
    the ledger and the reader assigns and seeks."""
    extra = dict(getattr(conn, "extra_dejson", None) or {})
    if "bootstrap.servers" not in extra and conn.host:
        extra["bootstrap.servers"] = f"{conn.host}:{conn.port or 9092}"
    if not extra.get("bootstrap.servers"):
        raise ValueError("has no bootstrap.servers in its extra")
    dropped = sorted(k for k in extra if k in FORBIDDEN_CLIENT_KEYS)
    if dropped:
        log.info("kafka connection %s: ignoring %s (managed by OffsetFlow)", conn.conn_id,
                 dropped)
    return {str(k): str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in extra.items() if k not in FORBIDDEN_CLIENT_KEYS}


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
    values: dict[str, Any] = dict(_handed_over().get(cfg.name) or {})
    if (cfg.kafka.conn_id and "kafka" not in values) or (cfg.sink.conn_id
                                                         and "sink" not in values):
        values = {**_lookup_values(cfg, lookup or airflow_lookup), **values}
    out = cfg
    if "kafka" in values:
        settings = dict(values["kafka"])
        bootstrap = settings.pop("bootstrap.servers")
        # the pipeline's own kafka.client settings override the connection's
        out = replace(out, bootstrap_servers=bootstrap, client={**settings, **cfg.client})
    if "sink" in values:
        out = replace(out, sink=replace(cfg.sink, connection=values["sink"]))
    return out


def _lookup_values(cfg: PipelineConfig, lookup: Lookup) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for fld, conn_id, convert, want in (
            ("kafka.conn_id", cfg.kafka.conn_id, kafka_settings, "kafka"),
            ("sink.conn_id", cfg.sink.conn_id, postgres_dsn, "postgres")):
        if not conn_id:
            continue
        try:
            conn = lookup(conn_id)
        except Exception as e:  # noqa: BLE001 - any lookup failure is the user's to fix
            raise ConfigError(cfg.source_file, fld, f"Airflow connection {conn_id!r} could "
                                                    f"not be read: {e}") from None
        if conn.conn_type not in (want, "postgresql" if want == "postgres" else want):
            raise ConfigError(cfg.source_file, fld, f"Airflow connection {conn_id!r} is of "
                                                    f"type {conn.conn_type!r}, not {want!r}")
        try:
            values[fld.split(".")[0]] = convert(conn)
        except ValueError as e:
            raise ConfigError(cfg.source_file, fld,
                              f"Airflow connection {conn_id!r} {e}") from None
        _mask(conn)
    return values


def _mask(conn: Any) -> None:
    """Airflow masks a connection's password when a task reads it; the CLI and pages do not
    log it; mask secrets in the extra too (sasl.password, ssl.key.password, ...)."""
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # pragma: no cover - Airflow is optional for the CLI
        return
    if conn.password:
        mask_secret(conn.password)
    for k, v in (getattr(conn, "extra_dejson", None) or {}).items():
        if isinstance(v, str) and v and redact_value(str(k), v) != v:
            mask_secret(v)


def handover_env(cfg: PipelineConfig) -> dict[str, str]:
    """The environment a spark-submit driver of `cfg` needs to run without Airflow (empty
    when the pipeline names no connection). Secret: only for the spark-submit process."""
    if not uses_connections(cfg):
        return {}
    values: dict[str, Any] = {}
    if cfg.kafka.conn_id:
        values["kafka"] = {**{k: v for k, v in cfg.client.items()},
                           "bootstrap.servers": cfg.bootstrap_servers}
    if cfg.sink.conn_id:
        values["sink"] = cfg.sink.connection
    return {HANDOVER_ENV: json.dumps({cfg.name: values})}


def _handed_over(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    raw = (os.environ if env is None else env).get(HANDOVER_ENV)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ConfigError("environment", HANDOVER_ENV, "is not valid JSON") from None
    return data if isinstance(data, dict) else {}
