"""The process's cap on glibc malloc arenas (`offsetflow.allocator`): the lowest cap asked
for holds, an explicit MALLOC_ARENA_MAX decides instead (the reader's cap is counted in real
Spark workers: tests/integration/source/test_reader_memory.py; the producer's in the
driver: tests/integration/sinks/kafka/test_sink_kafka_task_files_auto.py)."""

import sys

import pytest

from offsetflow import allocator

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(allocator, "_cap", None)
    monkeypatch.setattr(allocator, "_refused", False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    return monkeypatch


def test_an_explicit_malloc_arena_max_wins(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("MALLOC_ARENA_MAX", "8")
    assert allocator.cap_malloc_arenas(allocator.PRODUCER_ARENAS) is False
    assert allocator.arena_cap() is None


@glibc
def test_the_lowest_cap_holds(fresh: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []

    class Libc:  # glibc's answer (1: set), without changing this process's arenas
        def __init__(self, name: None) -> None:
            def mallopt(param: int, value: int) -> int:
                calls.append((param, value))
                return 1
            self.mallopt = mallopt

    fresh.setattr(allocator.ctypes, "CDLL", Libc)
    assert allocator.cap_malloc_arenas(allocator.READER_ARENAS) is True
    assert allocator.cap_malloc_arenas(allocator.READER_ARENAS) is True  # once
    assert allocator.arena_cap() == 2
    assert allocator.cap_malloc_arenas(allocator.PRODUCER_ARENAS) is True  # lowered
    assert allocator.arena_cap() == 1
    assert allocator.cap_malloc_arenas(allocator.READER_ARENAS) is True  # never raised
    assert allocator.arena_cap() == 1
    assert calls == [(-8, 2), (-8, 1)]
