"""Airflow's API server with OffsetFlow's plugin, reading pipelines from a test's own folder,
for the browser tests of the plugin's pages (status, streaming statistics, audit). Started at
once and awaited by `wait()`, so a test prepares its data while the server boots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# the browser tests' screenshots, and the headless Chromium they drive
SHOTS = ROOT / "test-output" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def health(url: str) -> int:
    """The status of `url`'s health endpoint; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


@contextmanager
def start_api_server(base: Path, port: int, env: Mapping[str, str] | None = None
               ) -> Iterator[dict[str, Any]]:
    """{"pipelines": folder, "wait": () -> the admin's password, "log": path, "url": url};
    the server is always stopped (its whole process group) on leaving."""
    url = f"http://127.0.0.1:{port}"
    pipelines = base / "pipelines"
    pipelines.mkdir()
    assert health(url) == 0, f"port {port} is already in use"
    full = {**os.environ, **(env or {}), "OFFSETFLOW_PIPELINES_DIR": str(pipelines),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__API__PORT": str(port), "AIRFLOW__API__BASE_URL": url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/"}
    log_path = base / "api-server.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(["airflow", "api-server", "--port", str(port)], env=full,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=base)

    def wait() -> str:
        deadline = time.monotonic() + 180
        while health(url) != 200:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the API server did not become healthy"
            time.sleep(1)
        pw_file = Path(full["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
        return str(json.loads(pw_file.read_text())["admin"])

    try:
        yield {"pipelines": pipelines, "wait": wait, "log": log_path, "url": url}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        log.close()
