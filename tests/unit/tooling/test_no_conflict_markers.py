"""No merge left its conflict markers in a tracked file (a merge of two branches that both
appended to one docs row once committed them; nothing else would have failed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MARKER = re.compile(rb"^(<{7} |={7}$|>{7} )", re.MULTILINE)


def test_no_tracked_file_holds_conflict_markers() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    found = []
    for name in filter(None, files):
        path = ROOT / name.decode()
        if not path.is_file() or path.suffix in {".png", ".jar", ".arrow", ".parquet"}:
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8000] and MARKER.search(data):
            found.append(name.decode())
    assert not found, f"conflict markers left in {found}"
