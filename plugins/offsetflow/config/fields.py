"""Field-level parsing of a pipeline config: walking the raw mapping with every error naming
the file and the dotted field (`FieldReader`), table and column names, and `${VAR}` /
`${VAR:-default}` resolved from the given environment (so secrets stay out of the YAML).
Pure: the sections' parsers (`config_parse`, `sink_kafka_config`) are built on it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from offsetflow.config.schema import CONN_ID_RE, ENV_RE, IDENT_RE
from offsetflow.errors import ConfigError


def validate_table_name(source: str, fld: str, table: Any) -> str:
    if not isinstance(table, str) or not table:
        raise ConfigError(source, fld, "must be a table name like 'orders' or 'raw.orders'")
    parts = table.split(".")
    if len(parts) > 2 or not all(IDENT_RE.match(p) for p in parts):
        raise ConfigError(
            source, fld,
            f"{table!r} is not a valid table name (letters, digits and _, optionally "
            f"'schema.table', each part at most 63 characters)",
        )
    return table


def validate_identifier(source: str, fld: str, name: Any) -> str:
    if not isinstance(name, str) or not IDENT_RE.match(name):
        raise ConfigError(source, fld, f"{name!r} is not a valid column name "
                                       f"(letters, digits and _, at most 63 characters)")
    return name


def resolve_env(value: str, source: str, fld: str, env: Mapping[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        var, default = m.group(1), m.group(2)
        if var in env:
            return env[var]
        if default is not None:
            return default
        raise ConfigError(source, fld, f"environment variable {var} is not set")

    return ENV_RE.sub(sub, value)


class FieldReader:
    """Walks the raw mapping and reports errors with their dotted path."""

    def __init__(self, raw: Mapping[str, Any], source: str, env: Mapping[str, str]) -> None:
        self.raw = raw
        self.source = source
        self.env = env

    def err(self, fld: str, msg: str) -> ConfigError:
        return ConfigError(self.source, fld, msg)

    def section(self, name: str, required: bool = True) -> Mapping[str, Any]:
        v = self.raw.get(name)
        if v is None:
            if required:
                raise self.err(name, "is required")
            return {}
        if not isinstance(v, Mapping):
            raise self.err(name, f"must be a mapping, got {type(v).__name__}")
        return v

    def unknown(self, sec: Mapping[str, Any], prefix: str, allowed: set[str]) -> None:
        extra = sorted(set(sec) - allowed)
        if extra:
            raise self.err(f"{prefix}{extra[0]}", f"unknown field; allowed: {sorted(allowed)}")

    def string(self, sec: Mapping[str, Any], key: str, prefix: str, default: str | None = None,
               choices: set[str] | None = None) -> str | None:
        v = sec.get(key, default)
        if v is None:
            return None
        if not isinstance(v, str):
            raise self.err(prefix + key, f"must be a string, got {v!r}")
        v = resolve_env(v, self.source, prefix + key, self.env)
        if choices is not None and v not in choices:
            raise self.err(prefix + key, f"{v!r} is not one of {sorted(choices)}")
        return v

    def conn_id(self, sec: Mapping[str, Any], prefix: str, literal: str) -> str | None:
        """An Airflow connection id, given instead of (never beside) the literal field."""
        v = self.string(sec, "conn_id", prefix)
        if v is not None and not CONN_ID_RE.match(v):
            raise self.err(prefix + "conn_id", f"{v!r} is not an Airflow connection id "
                                               f"(letters, digits, '_', '.', '-')")
        if v is not None and sec.get(literal) is not None:
            raise self.err(prefix + literal, f"give either {prefix}conn_id or "
                                             f"{prefix}{literal}, not both")
        return v

    def positive_int(self, sec: Mapping[str, Any], key: str, prefix: str,
                     default: int | None, minimum: int = 1) -> int | None:
        v = sec.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.err(prefix + key, f"must be an integer >= {minimum}, got {v!r}")
        return v
