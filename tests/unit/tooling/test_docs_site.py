"""The documentation site builds strict (`make docs`): a broken link or anchor, a config
field the schema has and the reference does not describe (or the reverse), or a ```yaml
pipeline example in README.md or docs/ that does not parse as written fails this test, and
with it `make test` (CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def test_a_broken_config_example_fails_the_build(tmp_path: Path) -> None:
    """The check is live: a docs tree with one unparseable example does not build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n```yaml\nsink:\n  table: t\n  tabel: t\n```\n")
    cfg = tmp_path / "mkdocs.yml"
    cfg.write_text(f"site_name: x\ndocs_dir: {docs}\nhooks:\n"
                   f"  - {ROOT / 'docs' / 'hooks' / 'config_reference.py'}\n")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(cfg),
                        "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "tabel" in r.stdout + r.stderr
