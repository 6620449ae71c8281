"""Which tests must run alone: the ones that stop, kill or crash a service every other test
uses (the broker, PostgreSQL, the Spark Connect server). A test that starts a cluster of its
own (Spark standalone, three brokers) and kills a node of it harms no other test.

`make test` runs the rest on several pytest-xdist workers at once and these afterwards, one
at a time. Found from the test modules' source, so a new fault test is serial without
anyone remembering to mark it: a test function that calls a disruptive step is serial; a
helper or fixture that calls one makes its whole module serial.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

DISRUPTIVE = re.compile(
    r"chaos\.(restart_postgres|crash_postgres|stop_kafka|start_kafka|kill_kafka|stack)\("
    r"|\.postgres_down_in_commit\("  # tests/tooling/fault_case.py: stops or crashes it
    # a stack.sh verb handed to a subprocess or a helper (not a message a test looks for)
    r"|[\"'](kafka-kill|kafka-stop|kafka-start|pg-crash|pg-stop|pg-start|connect-start"
    r"|connect-stop)[\"'](?!\s+in\b)")


@functools.cache
def disruptive_in(path: Path) -> tuple[bool, frozenset[str]]:
    """(the whole module is serial, the serial test functions of the module)."""
    src = path.read_text()
    whole, tests = False, set()
    for node in ast.parse(src).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if DISRUPTIVE.search(ast.get_source_segment(src, node) or ""):
            if node.name.startswith("test_"):
                tests.add(node.name)
            else:
                whole = True
    return whole, frozenset(tests)


def is_serial(path: Path, function: str) -> bool:
    whole, tests = disruptive_in(path)
    return whole or function in tests
