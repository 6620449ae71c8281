"""One `airflow standalone` shared by the modules that run one (test_ui_window_forms.py,
test_rest_api.py, test_public_api.py: their tests request `shared_airflow`). pytest-xdist
runs them one after the other on one worker (tests/tooling/xdist_groups.py); the Airflow
stops after the last of those tests, not at the end of the worker's session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tooling.airflow_standalone import SharedStandalone, shared_standalone

_shared: list[SharedStandalone] = []  # the session's, for the teardown hook below


@pytest.fixture(scope="session")
def shared_airflow(tmp_path_factory: pytest.TempPathFactory, pg_dsn: str,
                   secret_dsn: tuple[str, str], kafka_bootstrap: str,
                   spark_connect_url: str) -> Iterator[SharedStandalone]:
    shared = SharedStandalone(lambda: shared_standalone(
        tmp_path_factory.mktemp("airflow"), pg_dsn, secret_dsn, kafka_bootstrap,
        spark_connect_url))
    _shared.append(shared)
    yield shared
    shared.stop()
    _shared.remove(shared)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the module fixtures of a test using the shared Airflow are torn down (they
    pause their DAGs through its API), stop it if the next test does not use it."""
    yield
    if "shared_airflow" not in getattr(item, "fixturenames", ()):
        return
    if nextitem is not None and "shared_airflow" in getattr(nextitem, "fixturenames", ()):
        return
    for shared in _shared:
        shared.stop()
