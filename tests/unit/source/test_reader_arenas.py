"""The reader's cap on glibc malloc arenas (`reader.cap_malloc_arenas`): once per process,
and an explicit MALLOC_ARENA_MAX decides instead (the cap itself is counted in real Spark
workers: tests/integration/source/test_reader_memory.py)."""

import sys

import pytest

from offsetflow.source import reader


def test_an_explicit_malloc_arena_max_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "_arenas_capped", None)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert reader.cap_malloc_arenas() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_capped_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "_arenas_capped", None)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert reader.cap_malloc_arenas() is True
    monkeypatch.setattr(reader.ctypes, "CDLL", None)  # not called again
    assert reader.cap_malloc_arenas() is True
