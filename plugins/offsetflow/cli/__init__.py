"""The `offsetflow` command line.
"""

from __future__ import annotations

from offsetflow.cli.commands import main

__all__ = [
    "main",
]
