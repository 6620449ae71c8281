"""A small client of the Confluent Schema Registry REST API (also served by Karapace and by
Apicurio Registry's `ccompat` API): a schema by its global id, a subject's version.

Why not confluent-kafka's `SchemaRegistryClient`: the reader must tell apart "this id does
not exist" (a record's problem: a dead letter) from "the registry did not answer" (the
batch's problem: fail it, retriably, with nothing committed), and it runs in every Spark
task; a few urllib calls say that exactly, with no OAuth or httpx stack to import.

Secrets: the password is sent as HTTP basic auth and never appears in a message; the URL in
messages has any `user:password@` removed.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from offsetflow.config import redact_dsn
from offsetflow.errors import SchemaRegistryError

log = logging.getLogger(__name__)

ACCEPT = "application/vnd.schemaregistry.v1+json, application/json"
# a refused connection, a timeout or a 5xx is asked again after these pauses, then it is
# the batch's error (SchemaRegistryError): a registry restarting is ridden out, one that is
# down fails the batch in a few seconds instead of wedging its tasks
RETRY_BACKOFF_S = (0.2, 0.5, 1.0)
NOT_FOUND_CODES = {40401, 40402, 40403}  # subject, version, schema not found
CONFLICT = object()  # a POST the registry refused as incompatible (HTTP 409)


@dataclass(frozen=True)
class RegisteredSchema:
    """One schema as the registry holds it: its global id, type and text."""

    schema_id: int
    schema_type: str  # AVRO | PROTOBUF | JSON
    schema: str
    version: int | None = None
    has_references: bool = False


class RegistryClient:
    """GETs against one registry; `None` for what it says does not exist."""

    def __init__(self, url: str, username: str | None = None, password: str | None = None,
                 timeout_s: float = 10.0, backoff: tuple[float, ...] = RETRY_BACKOFF_S
                 ) -> None:
        self.url = url.rstrip("/")
        self.shown = redact_dsn(self.url)
        self.timeout_s = timeout_s
        self.backoff = backoff
        self._headers = {"Accept": ACCEPT}
        if username is not None:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> RegistryClient:
        """From `registry_settings` (plain values, as shipped to the tasks)."""
        return cls(settings["url"], settings.get("username"), settings.get("password"),
                   float(settings.get("timeout_s") or 10))

    def schema_by_id(self, schema_id: int, serialized: bool = False
                     ) -> RegisteredSchema | None:
        """`serialized`: a Protobuf schema as its base64 FileDescriptorProto (Confluent's
        `?format=serialized`), not `.proto` text."""
        query = "?format=serialized" if serialized else ""
        doc = self._get(f"/schemas/ids/{schema_id}{query}", f"schema id {schema_id}")
        if doc is None:
            return None
        return RegisteredSchema(schema_id, str(doc.get("schemaType") or "AVRO"),
                                str(doc["schema"]), None, bool(doc.get("references")))

    def version_in(self, schema_id: int, subject: str) -> int | None:
        """The version `schema_id` has in `subject` (its first), or None where it has none
        (for messages: "schema id 7 (version 2)")."""
        doc = self._get(f"/schemas/ids/{schema_id}/versions", f"schema id {schema_id} versions")
        found = [int(d["version"]) for d in (doc or []) if isinstance(d, dict)
                 and d.get("subject") == subject]
        return min(found) if found else None

    def subject_version(self, subject: str, version: int | None, serialized: bool = False
                        ) -> RegisteredSchema | None:
        """`version` of `subject` (None: its latest), or None when either does not exist;
        `serialized` as for `schema_by_id`."""
        v = "latest" if version is None else str(version)
        query = "?format=serialized" if serialized else ""
        doc = self._get(f"/subjects/{urllib.parse.quote(subject, safe='')}/versions/{v}"
                        f"{query}", f"subject {subject!r} version {v}")
        if doc is None:
            return None
        return RegisteredSchema(int(doc["id"]), str(doc.get("schemaType") or "AVRO"),
                                str(doc["schema"]), int(doc["version"]),
                                bool(doc.get("references")))

    def register(self, subject: str, schema: str, schema_type: str = "AVRO") -> int | None:
        """Register `schema` under `subject` (or find it there: the registry answers an
        existing schema with its id), its global id; None when the registry refuses it as
        incompatible with the subject's versions (HTTP 409)."""
        body = {"schema": schema, **({} if schema_type == "AVRO" else
                                     {"schemaType": schema_type})}
        doc = self._get(f"/subjects/{urllib.parse.quote(subject, safe='')}/versions",
                        f"registering a schema under subject {subject!r}", body)
        return None if doc is CONFLICT else int(doc["id"])

    def _get(self, path: str, what: str, body: Any = None) -> Any:
        """GET `path` (with `body`: POST it as JSON)."""
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/vnd.schemaregistry.v1+json"
        req = urllib.request.Request(self.url + path, headers=headers,
                                     data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
        last = ""
        for attempt in range(len(self.backoff) + 1):
            if attempt:
                time.sleep(self.backoff[attempt - 1])
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as e:
                err = _error_body(e)
                if e.code == 409 and body is not None:
                    return CONFLICT
                if e.code == 404 and (err.get("error_code") in NOT_FOUND_CODES
                                      or "error_code" not in err):
                    return None
                if e.code in (401, 403):
                    raise SchemaRegistryError(self.shown, what, f"HTTP {e.code} (credentials "
                                              f"refused: check format.schema_registry."
                                              f"username/password)", retriable=False) from None
                last = f"HTTP {e.code} {err.get('message') or e.reason}"
                if e.code < 500 and e.code != 429:
                    raise SchemaRegistryError(self.shown, what, last, retriable=False) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError,
                    http.client.HTTPException) as e:
                # HTTPException: an answer cut short (a registry killed mid-answer) or not
                # HTTP: as transient as a refused connection
                reason = getattr(e, "reason", e)
                last = f"{type(reason).__name__}: {reason}"
            except ValueError as e:  # not JSON: a proxy's page, say
                last = f"the answer is not JSON ({e})"
            log.warning("schema registry %s: %s: %s (attempt %d)", self.shown, what, last,
                        attempt + 1)
        raise SchemaRegistryError(self.shown, what, f"no answer after {len(self.backoff) + 1} "
                                                    f"attempts, last: {last}")


def _error_body(e: urllib.error.HTTPError) -> dict[str, Any]:
    try:
        doc = json.loads(e.read() or b"{}")
    except (ValueError, OSError):
        return {}
    return doc if isinstance(doc, dict) else {}


def registry_settings(url: str, username: str | None, password: str | None,
                      timeout_s: int) -> dict[str, Any]:
    """The registry connection as plain values (what a Spark task receives)."""
    return {"url": url, "username": username, "password": password, "timeout_s": timeout_s}


def value_schemas(client: RegistryClient, topics: list[str], schema_type: str,
                  strict: bool = True) -> dict[str, tuple[int, str] | None]:
    """Protobuf and JSON Schema under format.schema_evolution (or with a `json` column):
    topic -> (id, text) of the latest version of its `<topic>-value` subject (Confluent's
    TopicNameStrategy), whose fields decide the evolved columns and nested types (records
    are read with their writer schema); None where the subject has no schema. A subject
    holding another schema type is the config's error (SchemaRegistryError, not
    retriable) when `strict` (evolution needs that schema); otherwise it is no reader
    (nested values stay JSON text), so a pipeline that ran without one still runs."""
    out: dict[str, tuple[int, str] | None] = {}
    for topic in dict.fromkeys(topics):
        subject = f"{topic}-value"
        found = client.subject_version(subject, None, serialized=schema_type == "PROTOBUF")
        if found is not None and found.schema_type != schema_type and not strict:
            log.warning("subject %r holds a %s schema, not %s (format.type): its values' "
                        "nested fields stay JSON text", subject, found.schema_type,
                        schema_type)
            found = None
        if found is not None and found.schema_type != schema_type:
            raise SchemaRegistryError(
                client.shown, f"subject {subject!r}", f"holds a {found.schema_type} schema, "
                f"not {schema_type} (format.type)", retriable=False)
        out[topic] = None if found is None else (found.schema_id, found.schema)
    return out


# format.type -> the registry's schemaType of its values
SCHEMA_TYPES = {"avro": "AVRO", "protobuf": "PROTOBUF", "json_schema": "JSON"}
