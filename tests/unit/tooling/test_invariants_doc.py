"""docs/invariants.md names the tests that prove each invariant: every one it names must
exist, or a renamed test silently stops proving anything there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# `package/file.py::test_name`, `package/file.py::test_prefix_*`, `::test_name` (the file
# named before it in the same row), `package/file.py::*`; a [param] suffix is ignored
REF = re.compile(r"`((?:[\w/]+/)?test_\w+\.py)?::(\*|test_\w+\*?)(?:\[[^\]]*\])?`")


def _file(name: str) -> Path:
    """Paths are relative to tests/integration/ (`commit/test_sink.py`) unless they start
    with `tests/` (`tests/unit/stage/test_packing.py`)."""
    return ROOT / name if name.startswith("tests/") else ROOT / "tests" / "integration" / name


def named_tests() -> list[tuple[int, str, str]]:
    """(row line, file, test or pattern) for every test the table names."""
    found = []
    doc = (ROOT / "docs" / "invariants.md").read_text()
    for line_no, line in enumerate(doc.splitlines(), 1):
        current = None
        for m in REF.finditer(line):
            current = m.group(1) or current
            assert current is not None, f"line {line_no}: {m.group(0)} names no file"
            found.append((line_no, current, m.group(2)))
    return found


def test_every_test_docs_invariants_names_exists() -> None:
    refs = named_tests()
    assert len(refs) > 50  # the parser still finds the table's references
    missing = []
    for line_no, name, test in refs:
        path = _file(name)
        if not path.exists():
            missing.append(f"line {line_no}: {name} (no such file)")
            continue
        if test == "*":
            continue
        pattern = (re.escape(test[:-1]) + r"\w*" if test.endswith("*") else re.escape(test))
        if not re.search(rf"^(?:async )?def {pattern}\(", path.read_text(), re.MULTILINE):
            missing.append(f"line {line_no}: {name}::{test}")
    assert not missing, "docs/invariants.md names tests that do not exist:\n" + \
        "\n".join(missing)
