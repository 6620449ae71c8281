"""glibc's malloc arenas, capped per process for librdkafka's threads.

glibc gives a thread that finds the arenas in use one of its own, up to 8 per core. Every
confluent-kafka client starts threads (librdkafka's main thread, one per broker) that get
such arenas. Two costs follow, each measured on this project's paths:

- memory: what a thread frees stays mapped in its arena, so a Spark Python worker running
  task after task, each with new consumer threads, carried ~100-150 MB of arenas over its
  ~300 MB (the reader caps its process at READER_ARENAS);
- CPU: the driver's transactional producer allocates every message (payload, headers,
  delivery state) on the thread that calls `produce`, and with arenas of their own per
  thread, its malloc spent a fifth of that thread's time in `_int_malloc` (perf);
  one arena took `produce` from ~2.1 to ~1.35 s per million records with two headers
  each (PRODUCER_ARENAS; docs/performance.md).

An explicit MALLOC_ARENA_MAX in the environment always decides instead.
"""

from __future__ import annotations

import ctypes
import os
import sys

READER_ARENAS = 2
PRODUCER_ARENAS = 1
_M_ARENA_MAX = -8  # mallopt(3)

_cap: int | None = None  # the cap set in this process, the lowest asked for
_refused = False  # not glibc, or MALLOC_ARENA_MAX decides


def cap_malloc_arenas(n: int) -> bool:
    """Cap glibc's malloc arenas of this process at `n`, or lower it to `n` when a higher
    cap was set before (a driver that read ranges and then produces): the lowest cap asked
    for holds. A cap applies to threads that need an arena after it, so callers cap
    before starting a client's threads. False where it cannot be done (not glibc) or
    MALLOC_ARENA_MAX decides."""
    global _cap, _refused
    if _refused:
        return False
    if _cap is not None and _cap <= n:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in os.environ:
        _refused = True
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt arenas)
        _refused = True
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if mallopt(_M_ARENA_MAX, n) != 1:
        _refused = True
        return False
    _cap = n
    return True


def arena_cap() -> int | None:
    """The cap this process set (None: none, or MALLOC_ARENA_MAX decides)."""
    return _cap
