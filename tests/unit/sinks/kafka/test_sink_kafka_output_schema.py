"""The registry's answers the Avro value schema depends on, from a local HTTP server: a
registration returns the id, an incompatible one (HTTP 409) is told apart from an error,
and the error it becomes names the subject, both schemas and the ways out. (The stack's
registry checks no compatibility, so the 409 is served here.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from offsetflow.errors import OutputSchemaIncompatibleError
from offsetflow.source import RegistryClient

LATEST = {"subject": "out-value", "version": 3, "id": 11,
          "schema": '{"type":"record","name":"r","fields":[{"name":"id","type":"long"}]}'}


class Handler(BaseHTTPRequestHandler):
    posted: list[Any] = []

    def _send(self, code: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.posted.append((self.path, doc))
        if "incompatible" in self.path:
            self._send(409, {"error_code": 409, "message": "Schema being registered is "
                                                          "incompatible with an earlier schema"})
        else:
            self._send(200, {"id": 12})

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, LATEST)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_register_returns_the_id_or_none_when_incompatible(url: str) -> None:
    client = RegistryClient(url, backoff=())
    assert client.register("out-value", '{"type":"string"}') == 12
    assert Handler.posted[-1] == ("/subjects/out-value/versions", {"schema": '{"type":"string"}'})
    assert client.register("incompatible-value", '{"type":"string"}') is None


def test_the_incompatible_error_names_the_subject_both_schemas_and_the_ways_out() -> None:
    e = OutputSchemaIncompatibleError("http://sr:8081", "out-value", "version 3, schema id 11",
                                      '{"type":"record"}')
    text = str(e)
    assert "'out-value'" in text and "version 3, schema id 11" in text
    assert '{"type":"record"}' in text and "sink.value_subject" in text
    assert "compatibility level" in text and "Nothing was produced" in text


def test_an_explicit_schema_field_that_is_no_value_column_is_refused() -> None:
    """Fields are filled by name: a field no column fills (a typo, a column left out of
    value_columns) would be null in every record, silently; refused before anything is
    produced, naming the fields and the columns."""
    from offsetflow.config import KafkaSinkConfig
    from offsetflow.errors import KafkaSinkError
    from offsetflow.sinks.kafka.output_schema import value_schema

    explicit = {"type": "record", "name": "r", "fields": [
        {"name": "id", "type": "long"}, {"name": "amount_eur", "type": ["null", "double"]}]}
    sink = KafkaSinkConfig(topic="out", value_format="avro", value_schema=json.dumps(explicit))
    columns = {"topic": "text", "id": "bigint", "amount": "double precision"}
    with pytest.raises(KafkaSinkError, match=r"\['amount_eur'\] are no value column.*"
                                             r"\['id', 'amount'\]"):
        value_schema(sink, "out", columns)
    ok = {**explicit, "fields": explicit["fields"][:1]}
    assert value_schema(KafkaSinkConfig(topic="out", value_format="avro",
                                        value_schema=json.dumps(ok)), "out", columns) == ok
    narrowed = KafkaSinkConfig(topic="out", value_format="avro", value_columns=("id",),
                               value_schema=json.dumps(explicit))
    with pytest.raises(KafkaSinkError, match="amount_eur"):
        value_schema(narrowed, "out", columns)


def test_a_pin_is_for_one_registry_subject_and_schema() -> None:
    """An id means nothing in another registry (the registry URL is no part of the config
    fingerprint): a pin made there is not this attempt's, nor one for another subject or
    schema."""
    from offsetflow.sinks.kafka.output_schema import offered_digest

    base = offered_digest("http://sr-a:8081", "out-value", '{"type":"record"}')
    assert base == offered_digest("http://sr-a:8081", "out-value", '{"type":"record"}')
    assert len({base, offered_digest("http://sr-b:8081", "out-value", '{"type":"record"}'),
                offered_digest("http://sr-a:8081", "other-value", '{"type":"record"}'),
                offered_digest("http://sr-a:8081", "out-value", '{"type":"enum"}')}) == 4
