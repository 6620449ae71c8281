"""A minimal Confluent-compatible Schema Registry for the local stack and the tests.

Why this and not a real one: Karapace is not published on PyPI; Apicurio Registry's
Confluent-compatible server cannot be built from Maven Central alone here (3.3 needs Java
21, the machine has 17; 3.0.x and 2.6.x are only partly on Central; 2.4.2 lacks a Quarkus
deployment artifact there). So the stack serves the part of the REST API that producers
(confluent-kafka's `SchemaRegistryClient` / `AvroSerializer`) and OffsetFlow's reader use,
with the registry's rules that matter to them: one global id per distinct schema (the same
schema under two subjects shares its id), versions per subject from 1, ids never reused,
everything kept in one JSON file (a restart serves the same ids, as a real registry backed
by its `_schemas` topic does). No compatibility checks, no references, no deletes.

    python schema_registry.py --port 18081 --data DIR/registry.json [--auth user:password]

Only the standard library: the stack starts it with the venv's Python in ~50 ms.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class Store:
    """Schemas by id and subjects' versions, persisted to `path` after every change."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.schemas: dict[int, dict[str, Any]] = {}  # id -> {schema, schemaType}
        self.subjects: dict[str, list[int]] = {}  # subject -> ids by version (1-based)
        if path is not None and path.exists():
            doc = json.loads(path.read_text())
            self.schemas = {int(k): v for k, v in doc["schemas"].items()}
            self.subjects = doc["subjects"]

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"schemas": self.schemas, "subjects": self.subjects}))
        os.replace(tmp, self.path)

    @staticmethod
    def canonical(schema: str, schema_type: str) -> str:
        if schema_type in ("AVRO", "JSON"):
            try:
                return json.dumps(json.loads(schema), separators=(",", ":"), sort_keys=True)
            except ValueError:
                return schema
        return schema.strip()

    def find(self, schema: str, schema_type: str) -> int | None:
        want = self.canonical(schema, schema_type)
        for sid, s in self.schemas.items():
            if s["schemaType"] == schema_type and self.canonical(s["schema"], schema_type) \
                    == want:
                return sid
        return None

    def register(self, subject: str, schema: str, schema_type: str) -> int:
        with self.lock:
            sid = self.find(schema, schema_type)
            if sid is None:
                sid = max(self.schemas, default=0) + 1
                self.schemas[sid] = {"schema": schema, "schemaType": schema_type}
            versions = self.subjects.setdefault(subject, [])
            if sid not in versions:
                versions.append(sid)
            self._save()
            return sid


def _error(code: int, error_code: int, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"error_code": error_code, "message": message}


class Handler(BaseHTTPRequestHandler):
    store: Store
    auth: str | None = None
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the stack's log stays short
        pass

    def _send(self, code: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        if self.auth is None:
            return True
        want = "Basic " + base64.b64encode(self.auth.encode()).decode()
        if self.headers.get("Authorization") == want:
            return True
        self._send(401, {"error_code": 40101, "message": "Unauthorized"})
        return False

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}") if n else {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self._authorized():
            self._send(*self._get(self.path.split("?", 1)[0]))

    def do_POST(self) -> None:  # noqa: N802
        if self._authorized():
            self._send(*self._post(self.path.split("?", 1)[0], self._body()))

    def do_PUT(self) -> None:  # noqa: N802
        if self._authorized():
            doc = self._body()
            self._send(200, {"compatibility": doc.get("compatibility", "BACKWARD")})

    def _version_doc(self, subject: str, version: int, sid: int) -> dict[str, Any]:
        s = self.store.schemas[sid]
        doc = {"subject": subject, "version": version, "id": sid, "schema": s["schema"]}
        if s["schemaType"] != "AVRO":
            doc["schemaType"] = s["schemaType"]
        return doc

    def _get(self, path: str) -> tuple[int, Any]:
        store = self.store
        if path in ("", "/"):
            return 200, {}
        if path == "/subjects":
            return 200, sorted(store.subjects)
        if path == "/schemas/types":
            return 200, ["AVRO", "JSON", "PROTOBUF"]
        if path.startswith("/config"):
            return 200, {"compatibilityLevel": "BACKWARD"}
        m = re.fullmatch(r"/schemas/ids/(\d+)/versions", path)
        if m:  # the subjects and versions that hold this id (Confluent's API)
            sid = int(m.group(1))
            if sid not in store.schemas:
                return _error(404, 40403, "Schema not found")
            return 200, [{"subject": subj, "version": i + 1}
                         for subj, ids in sorted(store.subjects.items())
                         for i, x in enumerate(ids) if x == sid]
        m = re.fullmatch(r"/schemas/ids/(\d+)(/schema)?", path)
        if m:
            s = store.schemas.get(int(m.group(1)))
            if s is None:
                return _error(404, 40403, "Schema not found")
            if m.group(2):
                return 200, json.loads(s["schema"])
            doc = {"schema": s["schema"]}
            if s["schemaType"] != "AVRO":
                doc["schemaType"] = s["schemaType"]
            return 200, doc
        m = re.fullmatch(r"/subjects/([^/]+)/versions(?:/([^/]+))?", path)
        if m:
            from urllib.parse import unquote

            subject = unquote(m.group(1))
            versions = store.subjects.get(subject)
            if not versions:
                return _error(404, 40401, f"Subject '{subject}' not found.")
            if m.group(2) is None:
                return 200, list(range(1, len(versions) + 1))
            v = m.group(2)
            n = len(versions) if v in ("latest", "-1") else int(v) if v.isdigit() else 0
            if not 1 <= n <= len(versions):
                return _error(404, 40402, f"Version {v} not found.")
            return 200, self._version_doc(subject, n, versions[n - 1])
        return _error(404, 404, f"no such resource {path}")

    def _post(self, path: str, doc: dict[str, Any]) -> tuple[int, Any]:
        from urllib.parse import unquote

        m = re.fullmatch(r"/subjects/([^/]+)(/versions)?", path)
        if not m or "schema" not in doc:
            return _error(404 if not m else 422, 42201, "expected {schema: ...}")
        if doc.get("references"):
            return _error(422, 42201, "schema references are not supported by this registry")
        subject, schema_type = unquote(m.group(1)), doc.get("schemaType") or "AVRO"
        if m.group(2):  # register
            sid = self.store.register(subject, doc["schema"], schema_type)
            return 200, {"id": sid}
        sid = self.store.find(doc["schema"], schema_type)  # look up under a subject
        versions = self.store.subjects.get(subject, [])
        if sid is None or sid not in versions:
            return _error(404, 40403, "Schema not found")
        return 200, self._version_doc(subject, versions.index(sid) + 1, sid)


def make_server(port: int, data: Path | None, auth: str | None = None,
                host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server on `host:port` (not yet serving: call serve_forever, e.g. in a thread)."""
    handler = type("BoundHandler", (Handler,), {"store": Store(data), "auth": auth})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--data", type=Path, required=True, help="JSON file the schemas live in")
    ap.add_argument("--auth", default=os.environ.get("OFFSETFLOW_SCHEMA_REGISTRY_AUTH"),
                    help="user:password required as HTTP basic auth (default: none)")
    args = ap.parse_args()
    server = make_server(args.port, args.data, args.auth)
    print(f"schema registry listening on http://127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
