"""A pipeline's Spark Connect session id (connect_session): stable per pipeline and server,
separate between pipelines, and a URL pyspark's client accepts."""

from __future__ import annotations

import uuid

import pytest

from offsetflow.job.connect_session import (
    is_closed_session,
    names_session,
    session_id,
    with_session_id,
)


def test_the_id_is_stable_and_separate_per_pipeline_server_and_generation() -> None:
    a = session_id("orders", "sc://spark:15002")
    assert a == session_id("orders", "sc://spark:15002")
    assert a == session_id("orders", "sc://spark:15002/;token=abc")  # a token is no identity
    others = {session_id("payments", "sc://spark:15002"), session_id("orders", "sc://other:15002"),
              session_id("orders", "sc://spark:15002", 1)}
    assert a not in others and len(others) == 3
    assert uuid.UUID(a).version == 4


@pytest.mark.parametrize(("url", "want"), [
    ("sc://h:1", "sc://h:1/;session_id=S"),
    ("sc://h:1/", "sc://h:1/;session_id=S"),
    ("sc://h:1/;token=t", "sc://h:1/;token=t;session_id=S"),
    ("sc://h:1/;token=t;", "sc://h:1/;token=t;session_id=S"),
])
def test_with_session_id(url: str, want: str) -> None:
    assert with_session_id(url, "S") == want


def test_a_url_naming_its_own_session_is_used_as_it_is() -> None:
    assert names_session("sc://h:1/;token=t;session_id=x")
    assert not names_session("sc://h:1/;token=session_id")
    assert not names_session("sc://h:1")


def test_a_closed_session_is_told_from_other_errors() -> None:
    assert is_closed_session(RuntimeError("[INVALID_HANDLE.SESSION_CLOSED] The handle x is "
                                          "invalid. Session was closed."))
    assert not is_closed_session(RuntimeError("[INVALID_HANDLE.SESSION_CHANGED]"))
