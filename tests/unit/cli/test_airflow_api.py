"""`offsetflow backfill|replay` find Airflow's API and credentials from the environment
only, and say what to set when they cannot (the real API: test_rest_api.py)."""

from __future__ import annotations

import pytest

from offsetflow.cli.airflow_api import connect
from offsetflow.errors import AirflowApiError


def test_no_api_server_named_says_how_to_name_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW__API__BASE_URL", raising=False)
    monkeypatch.setattr("offsetflow.cli.airflow_api.airflow_conf", lambda *_: None)
    with pytest.raises(AirflowApiError, match="--airflow-url or OFFSETFLOW_AIRFLOW_URL"):
        connect(None, env={})


def test_missing_credentials_are_named() -> None:
    with pytest.raises(AirflowApiError, match="OFFSETFLOW_AIRFLOW_TOKEN") as e:
        connect("http://airflow.example:8080/", env={"OFFSETFLOW_AIRFLOW_USERNAME": "me"})
    assert "http://airflow.example:8080" in str(e.value)


def test_an_unreachable_server_is_named_without_the_password() -> None:
    with pytest.raises(AirflowApiError) as e:
        connect("http://127.0.0.1:1", env={"OFFSETFLOW_AIRFLOW_USERNAME": "me",
                                           "OFFSETFLOW_AIRFLOW_PASSWORD": "s3cret-pw"})
    assert "POST http://127.0.0.1:1/auth/token: cannot reach Airflow's API server" in str(e.value)
    assert "s3cret-pw" not in str(e.value)


def test_a_token_needs_no_login() -> None:
    api = connect("http://127.0.0.1:1/", env={"OFFSETFLOW_AIRFLOW_TOKEN": "tok"})
    assert (api.url, api.token) == ("http://127.0.0.1:1", "tok")
