"""The schema versions on `offsetflow status` and the lag page come from the registry at
display time (`ops.with_schema_versions`); a registry that hangs or answers slowly must not
make the page hang: the wait is bounded per page, not per pipeline or per schema id.

The registries here are local sockets standing for a frozen registry (accepts, never
answers) and a slow one (answers each request after a pause), as the status tests stand
an unreachable one with a closed port."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from offsetflow.config import PipelineConfig, parse_pipeline
from offsetflow.ops import STATUS_REGISTRY_TIMEOUT_S, with_schema_versions


def _cfg(name: str, url: str) -> PipelineConfig:
    return parse_pipeline({
        "name": name, "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "source": {"topics": ["t"]}, "format": {
            "type": "json_schema", "schema": {"id": "long"},
            "schema_registry": {"url": url}},
        "sink": {"connection": "postgresql://u@127.0.0.1:1/db", "table": name}},
        f"<test {name}>", {})


def _batches(ids: range) -> list[dict[str, Any]]:
    return [{"schemas": {"readers": {"t": i}, "writers": {"t": {str(i): [0, i]}}}}
            for i in ids]


@pytest.fixture
def frozen_registry() -> Iterator[str]:
    """A registry that accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


PAUSE_S = 0.8


@pytest.fixture
def slow_registry() -> Iterator[str]:
    """A registry that answers every request, each after PAUSE_S."""

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            time.sleep(PAUSE_S)  # the registry's slowness, not a test's wait
            body = json.dumps([{"subject": "t-value", "version": 1}]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_frozen_registry_is_waited_for_once_per_page_not_once_per_pipeline(
        frozen_registry: str) -> None:
    cfgs = [_cfg(f"p{i}", frozen_registry) for i in range(4)]
    started = time.monotonic()
    errors = [with_schema_versions(c, _batches(range(1, 3))) for c in cfgs]
    took = time.monotonic() - started
    assert all(errors), errors  # each pipeline says the versions are unknown, and why
    assert took < 2 * STATUS_REGISTRY_TIMEOUT_S, \
        f"4 pipelines on a frozen registry took {took:.1f} s"


def test_a_slow_registry_is_asked_within_a_bounded_time(slow_registry: str) -> None:
    cfg = _cfg("slow", slow_registry)
    batches = _batches(range(100, 110))  # 10 ids none cached yet
    started = time.monotonic()
    error = with_schema_versions(cfg, batches)
    took = time.monotonic() - started
    assert took < STATUS_REGISTRY_TIMEOUT_S + PAUSE_S + 0.5, \
        f"10 ids on a registry answering in {PAUSE_S} s each took {took:.1f} s"
    assert error is not None and "in time" in error, error
    known = [v for b in batches for v in b["schema_versions"]["t"].values() if v["known"]]
    assert known, "the ids it answered in time show their versions"
    # a later page shows the ones answered and asks for the rest
    again = _batches(range(100, 110))
    with_schema_versions(dataclasses.replace(cfg), again)
    assert sum(v["known"] for b in again for v in b["schema_versions"]["t"].values()) \
        > len(known)


@pytest.fixture
def cut_registry() -> Iterator[str]:
    """A registry that dies mid-answer: it promises a body and closes after a part."""

    class Cut(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b'[{"subject"')
            self.close_connection = True

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Cut)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_registry_cut_mid_answer_is_a_registry_error_not_a_crash(cut_registry: str) -> None:
    from offsetflow.errors import SchemaRegistryError
    from offsetflow.source import RegistryClient

    batches = _batches(range(200, 201))
    error = with_schema_versions(_cfg("cut", cut_registry), batches)
    assert error is not None and "IncompleteRead" in error, error
    assert not batches[0]["schema_versions"]["t"]["200"]["known"]
    # the tasks' and the driver's lookups: the batch's retriable registry error
    with pytest.raises(SchemaRegistryError) as e:
        RegistryClient(cut_registry, timeout_s=2, backoff=(0.01,)).schema_by_id(200)
    assert e.value.retriable and "IncompleteRead" in str(e.value)
