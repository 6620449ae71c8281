"""Triggering DAG runs through Airflow's REST API (`POST /api/v2/dags/{id}/dagRuns`), so
`offsetflow backfill|replay` work against any Airflow the user can reach (a Helm install,
MWAA, Astronomer), not only one on this machine.

Where: `--airflow-url`, else OFFSETFLOW_AIRFLOW_URL, else Airflow's `[api] base_url`.
Who: a bearer token in OFFSETFLOW_AIRFLOW_TOKEN, else OFFSETFLOW_AIRFLOW_USERNAME and
OFFSETFLOW_AIRFLOW_PASSWORD exchanged for one at `/auth/token` (the simple and FAB auth
managers). Credentials come from the environment only: never a command line, never a log.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from offsetflow.config import airflow_conf
from offsetflow.errors import AirflowApiError

TIMEOUT_S = 30.0
AUTH_HELP = ("set OFFSETFLOW_AIRFLOW_TOKEN (a bearer token of Airflow's API), or "
             "OFFSETFLOW_AIRFLOW_USERNAME and OFFSETFLOW_AIRFLOW_PASSWORD")


@dataclass(frozen=True)
class AirflowApi:
    url: str  # the API server's base URL, without a trailing slash
    token: str

    def call(self, method: str, path: str, body: Any = None) -> Any:
        return request(method, f"{self.url}{path}", body, self.token)

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> dict[str, Any]:
        """A manual DAG run with `conf`; refused clearly when the DAG is unknown."""
        quoted = urllib.parse.quote(dag_id, safe="")
        dag = self.call("GET", f"/api/v2/dags/{quoted}")
        run: dict[str, Any] = self.call("POST", f"/api/v2/dags/{quoted}/dagRuns",
                                        {"logical_date": None, "conf": conf})
        run["is_paused"] = bool(dag.get("is_paused")) if isinstance(dag, dict) else False
        return run


def request(method: str, url: str, body: Any = None, token: str | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        why = {401: f"not authenticated: {AUTH_HELP}",
               403: "the user may not do this (the auth manager's permissions)",
               404: "not found (is the DAG file in Airflow's dags folder and parsed?)"
               }.get(e.code, "")
        raise AirflowApiError(f"{method} {url}: HTTP {e.code}"
                              f"{': ' + why if why else ''} ({detail})") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise AirflowApiError(f"{method} {url}: cannot reach Airflow's API server ({reason});"
                              f" give its address with --airflow-url or "
                              f"OFFSETFLOW_AIRFLOW_URL") from None
    return json.loads(text) if text else None


def connect(url: str | None, env: dict[str, str] | None = None) -> AirflowApi:
    """The API of the Airflow to trigger, authenticated."""
    env = dict(os.environ) if env is None else env
    base = (url or env.get("OFFSETFLOW_AIRFLOW_URL") or airflow_conf("api", "base_url") or "")
    if not base:
        raise AirflowApiError("no Airflow API server to trigger the run on: give "
                              "--airflow-url or OFFSETFLOW_AIRFLOW_URL (or Airflow's [api] "
                              "base_url), or run the window here with --local")
    base = base.rstrip("/")
    token = env.get("OFFSETFLOW_AIRFLOW_TOKEN")
    if not token:
        user, password = env.get("OFFSETFLOW_AIRFLOW_USERNAME"), env.get(
            "OFFSETFLOW_AIRFLOW_PASSWORD")
        if not (user and password):
            raise AirflowApiError(f"no credentials for Airflow's API at {base}: {AUTH_HELP}")
        got = request("POST", f"{base}/auth/token", {"username": user, "password": password})
        token = got.get("access_token") if isinstance(got, dict) else None
        if not token:
            raise AirflowApiError(f"POST {base}/auth/token gave no access_token")
    return AirflowApi(base, token)
