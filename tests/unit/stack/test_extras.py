"""The optional parts (pyproject's extras): a pipeline that uses one whose library is not
installed stops with a MissingExtraError naming the extra, before anything is planned or any
service reached; and `offsetflow.extras` agrees with pyproject.toml. The real install without
extras: tests/integration/orchestration/test_provider_package.py."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from offsetflow.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[3]

# a pipeline whose optional library is hidden (None in sys.modules: its import fails as a
# missing module would), planned against a PostgreSQL port nobody listens on: the error
# must come first
CODE = """
import sys
sys.modules[{module!r}] = None
from offsetflow.config import parse_pipeline
from offsetflow.errors import MissingExtraError
from offsetflow.ops import plan_only
cfg = parse_pipeline({{'name': 'p', 'kafka': {{'bootstrap_servers': '127.0.0.1:1'}},
    'source': {{'topics': ['t']}}, 'format': {{'type': 'json', 'schema': {{'a': 'string'}}}},
    'sink': {sink!r}, **{top!r}}}, 'p.yaml', {{}})
try:
    plan_only(cfg, 'postgresql://u@127.0.0.1:1/db')
except MissingExtraError as e:
    print(e)
else:
    raise SystemExit('planned without ' + {module!r})
"""


def missing(module: str, sink: dict[str, object], **top: object) -> str:
    out = subprocess.run(
        [sys.executable, "-c", CODE.format(module=module, sink=sink, top=top)],
        capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": f"{ROOT / 'plugins'}:{ROOT}"})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def test_an_iceberg_pipeline_without_pyiceberg_names_the_iceberg_extra() -> None:
    msg = missing("pyiceberg", {"type": "iceberg", "connection": "postgresql://h/db",
                                "table": "db.events", "catalog": {"warehouse": "/tmp/w"}})
    assert msg == (
        "p.yaml: sink.type: iceberg (pipeline p) needs pyiceberg, which this Python cannot "
        "import: install OffsetFlow's iceberg extra into this environment, pip install "
        "'offsetflow[iceberg]' -c requirements.txt (the constraints file of the tested "
        "versions, docs/deployment.md), or 'offsetflow[all]' for every optional part"), msg


def test_a_quality_suite_without_great_expectations_names_the_quality_extra() -> None:
    msg = missing("great_expectations", {"connection": "postgresql://h/db", "table": "t"},
                  quality={"suite": "amounts"})
    assert msg.startswith("p.yaml: quality.suite (pipeline p) needs great_expectations, "
                          "which this Python cannot import: install OffsetFlow's quality "
                          "extra into this environment, pip install 'offsetflow[quality]'"), msg


def test_an_avro_pipeline_without_fastavro_names_the_avro_extra() -> None:
    msg = missing("fastavro", {"connection": "postgresql://h/db", "table": "t"},
                  format={"type": "avro", "schema": {"a": "string"},
                          "schema_registry": {"url": "http://127.0.0.1:1"}})
    assert msg.startswith("p.yaml: format.type: avro (pipeline p) needs fastavro, which this "
                          "Python cannot import: install OffsetFlow's avro extra into this "
                          "environment, pip install 'offsetflow[avro]'"), msg


def test_each_extra_is_declared_with_its_library_and_all_holds_every_extra() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra, module in EXTRAS.items():
        library = module.replace("_", "-")
        assert any(req.startswith(library) for req in declared[extra]), declared[extra]
    m = re.fullmatch(r"offsetflow\[(.+)\]", " ".join(declared["all"]))
    assert m and set(m.group(1).split(",")) == set(declared) - {"all"}, declared["all"]


def test_the_install_docs_name_every_extra_and_setting() -> None:
    from offsetflow.config.settings import SETTINGS

    page = (ROOT / "docs/deployment.md").read_text()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra in declared:
        assert f"`offsetflow[{extra}]`" in page, extra
    for s in SETTINGS:
        assert f"| `{s.option}` | `{s.default}` |" in page, s.option
        assert s.legacy_env is None or f"`{s.legacy_env}`" in page, s.legacy_env
