"""A folder made read-only or full for a test, by mounting over it (root only: chmod does
not stop root). Each is undone on exit, whatever the test did; a machine where mount is
not allowed skips the test."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mount {' '.join(args)} is not allowed here: {done.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=True, capture_output=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` read-only (a bind mount of itself, remounted ro), as a read-only volume."""
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,ro,bind", str(path))
        yield
    finally:
        _umount(path)


@contextlib.contextmanager
def full(path: Path, size: str = "64k") -> Iterator[None]:
    """An empty tmpfs of `size` over `path` (what was there is hidden until exit): a
    nearly full disk. What was written on it goes with it."""
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    try:
        yield
    finally:
        _umount(path)
