"""Field-level parsing of a pipeline config: walking the raw mapping with every error naming
the file and the dotted field (`FieldReader`), table and column names, and `${VAR}` /
`${VAR:-default}` resolved from the given environment (so secrets stay out of the YAML).
Pure: the sections' parsers (`config_parse`, `sink_kafka_config`) are built on it.

The reader collects: a bad value is recorded and a placeholder read on (its default), so one
run names every error of a file; what a broken structure makes meaningless (a section that
is not a mapping) stops that section only (`guard`).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from offsetflow.config.schema import (
    CONN_ID_RE,
    ENV_RE,
    IDENT_RE,
    SchemaRegistryConfig,
    redact_dsn,
    redact_value,
)
from offsetflow.errors import ConfigError

T = TypeVar("T")


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


def did_you_mean(word: Any, candidates: Collection[str]) -> str:
    """"; did you mean 'x'?" when `word` is a likely typo of one of `candidates`, else ""."""
    close = difflib.get_close_matches(str(word), sorted(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def shown(fld: str, v: Any) -> str:
    """A bad value as an error may show it: a secret field's (a password given as a YAML
    number) by its type only, as errors are logged and shown in Airflow."""
    if redact_value(fld.rsplit(".", 1)[-1], v) == "***":
        return f"a value of type {type(v).__name__} (not shown: a secret)"
    return repr(v)


class FieldReader:
    """Walks the raw mapping and records errors (and warnings) with their dotted path."""

    def __init__(self, raw: Mapping[str, Any], source: str, env: Mapping[str, str],
                 strict_env: bool = True) -> None:
        self.raw = raw
        self.source = source
        self.env = env
        # an unset `${VAR}` without a default: an error (loading to run), or a warning
        # (validating a file away from the environment it runs in)
        self.strict_env = strict_env
        self.errors: list[ConfigError] = []
        self.warnings: list[ConfigError] = []
        self.unresolved: set[str] = set()  # fields holding an unset ${VAR}, left as written

    suggest = staticmethod(did_you_mean)

    def err(self, fld: str, msg: str, at_key: bool = False) -> ConfigError:
        return ConfigError(self.source, fld, msg, at_key=at_key)

    def fail(self, fld: str, msg: str, at_key: bool = False) -> None:
        """Record an error and read on."""
        self.errors.append(self.err(fld, msg, at_key))

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run a section: an error it raises is recorded and ends that section only."""
        try:
            yield
        except ConfigError as e:
            self.errors.extend(e.errors)

    def attempt(self, fn: Callable[..., T], *args: Any) -> T | None:
        """`fn(*args)`, or None with its ConfigError recorded."""
        try:
            return fn(*args)
        except ConfigError as e:
            self.errors.extend(e.errors)
            return None

    def ok(self, fld: str) -> bool:
        """No error recorded for `fld` (or inside it) and no unset variable in it: checks
        that build on its value may run without repeating the error."""
        return fld not in self.unresolved and not any(
            e.field == fld or e.field.startswith((fld + ".", fld + "[")) for e in self.errors)

    def resolve(self, value: str, fld: str, hint: str = "") -> str:
        """`${VAR}` / `${VAR:-default}` from the environment; an unset one without a default
        is recorded (error or warning, see `strict_env`) and left as written."""
        missing: list[str] = []

        def sub(m: re.Match[str]) -> str:
            var, default = m.group(1), m.group(2)
            if var in self.env:
                return self.env[var]
            if default is not None:
                return default
            missing.append(var)
            return m.group(0)

        out = ENV_RE.sub(sub, value)
        for var in missing:
            self.unresolved.add(fld)
            if self.strict_env:
                self.fail(fld, f"environment variable {var} is not set{hint}")
            else:
                self.warnings.append(self.err(
                    fld, f"environment variable {var} is not set here; it must be where the "
                         f"pipeline runs{hint}"))
        return out

    def section(self, name: str, required: bool = True) -> Mapping[str, Any]:
        v = self.raw.get(name)
        if v is None:
            if required:
                raise self.err(name, "is required")
            return {}
        if not isinstance(v, Mapping):
            raise self.err(name, f"must be a mapping, got {type(v).__name__}")
        return v

    def unknown(self, sec: Mapping[str, Any], prefix: str, allowed: Collection[str],
                elsewhere: Mapping[str, str] | None = None) -> None:
        """Record every key of `sec` not in `allowed`, with the likely one it misspells;
        `elsewhere`: where a key that is valid in another setting belongs."""
        for extra in sorted(set(sec) - set(allowed), key=str):
            hint = (f" {elsewhere[extra]}" if elsewhere and extra in elsewhere
                    else did_you_mean(extra, allowed))
            self.fail(f"{prefix}{extra}", f"unknown field{hint} (allowed: {sorted(allowed)})",
                      at_key=True)

    def string(self, sec: Mapping[str, Any], key: str, prefix: str, default: str | None = None,
               choices: Collection[str] | None = None, hint: str = "") -> str | None:
        """A string field; a bad one is recorded and its default read on."""
        fld = prefix + key
        v = sec.get(key, default)
        if v is None:
            return None
        fallback = default if choices is None or default in choices else None
        if not isinstance(v, str):
            self.fail(fld, f"must be a string, got {shown(fld, v)}")
            return fallback
        v = self.resolve(v, fld, hint)
        if choices is not None and fld in self.unresolved:
            return fallback
        if choices is not None and v not in choices:
            self.fail(fld, f"{v!r} is not one of {sorted(choices)}{did_you_mean(v, choices)}")
            return fallback
        return v

    def conn_id(self, sec: Mapping[str, Any], prefix: str, literal: str) -> str | None:
        """An Airflow connection id, given instead of (never beside) the literal field."""
        v = self.string(sec, "conn_id", prefix)
        if v is not None and self.ok(prefix + "conn_id") and not CONN_ID_RE.match(v):
            self.fail(prefix + "conn_id", f"{v!r} is not an Airflow connection id "
                                          f"(letters, digits, '_', '.', '-')")
        if sec.get("conn_id") is not None and sec.get(literal) is not None:
            self.fail(prefix + literal, f"give either {prefix}conn_id or {prefix}{literal}, "
                                        f"not both")
        return v

    def registry(self, sec: Mapping[str, Any], fld: str) -> SchemaRegistryConfig:
        """A schema registry section (`format.schema_registry`, `sink.schema_registry`):
        `url` or `conn_id` (an Airflow http connection, never beside url, username or
        password), basic auth as both username and password or neither, `timeout_s`."""
        conn_id = self.conn_id(sec, f"{fld}.", "url")
        if conn_id is not None:
            for secret in ("username", "password"):
                if sec.get(secret) is not None:
                    self.fail(f"{fld}.{secret}", f"give either {fld}.conn_id (its login and "
                                                 f"password) or {fld}.{secret}, not both")
        url = self.string(sec, "url", f"{fld}.") or ""
        if conn_id is None and self.ok(f"{fld}.url") and not re.match(r"^https?://[^/\s]+",
                                                                       url):
            self.fail(f"{fld}.url", f"{redact_dsn(url)!r} is not an http(s) URL of a "
                                    f"Confluent-compatible Schema Registry")
        user = self.string(sec, "username", f"{fld}.")
        password = self.string(sec, "password", f"{fld}.")
        if (user is None) != (password is None):
            self.fail(f"{fld}.{'password' if user is not None else 'username'}",
                      "basic auth needs both username and password (give each as ${VAR})")
        timeout = self.positive_int(sec, "timeout_s", f"{fld}.", 10) or 10
        return SchemaRegistryConfig(url=url.rstrip("/"), username=user, password=password,
                                    timeout_s=timeout, conn_id=conn_id)

    def positive_int(self, sec: Mapping[str, Any], key: str, prefix: str,
                     default: int | None, minimum: int = 1) -> int | None:
        """An integer field; a bad one is recorded and its default read on."""
        v = sec.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.fail(prefix + key, f"must be an integer >= {minimum}, got {v!r}")
            return default
        return v

    def number(self, sec: Mapping[str, Any], key: str, prefix: str, default: float | None,
               minimum: float = 0.0, exclusive: bool = False) -> float | None:
        """A number field (an integer is one too); a bad one is recorded and its default
        read on."""
        v = sec.get(key, default)
        if v is None:
            return None
        # YAML reads `.inf`, `.nan` and `1e400` as floats; NaN passes every comparison
        bad = isinstance(v, bool) or not isinstance(v, int | float) \
            or not math.isfinite(v) or (v <= minimum if exclusive else v < minimum)
        if bad:
            self.fail(prefix + key, f"must be a finite number {'>' if exclusive else '>='} "
                                    f"{minimum:g}, got {v!r}")
            return default
        return float(v)
