"""pyproject.toml, requirements.txt and requirements-dev.txt agree: the runtime pins are what
resolving the package with every extra against them gives (no test or lint tool among them,
none missing), the tools are only in requirements-dev.txt, and the stack's constraints (one
pyspark, pandas 2, the Airflow minor, pyiceberg's minor) hold in both."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def project() -> dict[str, object]:
    data: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return data


def requirement(name: str, extra: str | None = None) -> Requirement:
    p = project()
    reqs = p["optional-dependencies"][extra] if extra else p["dependencies"]  # type: ignore[index]
    found = [Requirement(r) for r in reqs if Requirement(r).name == name]  # type: ignore[union-attr]
    assert len(found) == 1, f"{name} is not a requirement of {extra or 'the base'}"
    return found[0]


def test_dev_requirements_extend_the_runtime_and_hold_only_tools() -> None:
    dev = (ROOT / "requirements-dev.txt").read_text()
    assert "\n-r requirements.txt\n" in f"\n{dev}"
    runtime, tools = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-dev.txt")
    assert not set(runtime) & set(tools), set(runtime) & set(tools)
    for tool in ("pytest", "pytest-xdist", "mypy", "ruff", "import-linter", "playwright",
                 "duckdb", "matplotlib", "mkdocs"):
        assert tool in tools and tool not in runtime, tool


def test_runtime_pins_are_the_resolution_of_the_package_with_every_extra() -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (make venv installs it)")
    cmd = [uv, "pip", "compile", "pyproject.toml", "--all-extras", "-c", "requirements.txt",
           "--python-version", "3.11", "--no-header", "--no-annotate", "--quiet"]
    # uv's cache (make venv filled it) answers offline; the registry only when it cannot
    out = subprocess.run([*cmd, "--offline"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    if out.returncode != 0:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    resolved = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in
                re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", out.stdout, re.M)}
    runtime = pins(ROOT / "requirements.txt")
    assert {n: v for n, v in resolved.items() if runtime.get(n) != v} == {}, \
        "resolved to versions requirements.txt does not pin"
    assert sorted(set(runtime) - set(resolved)) == [], \
        "pinned in requirements.txt but needed by no runtime requirement: requirements-dev.txt?"


def test_one_pyspark_at_the_pinned_version_and_pandas_2() -> None:
    runtime = pins(ROOT / "requirements.txt")
    spark, client = requirement("pyspark"), requirement("pyspark-client")
    assert str(spark.specifier) == str(client.specifier) == f"=={runtime['pyspark']}"
    assert runtime["pyspark-client"] == runtime["pyspark"]
    pandas = requirement("pandas")
    assert not pandas.specifier.contains("3.0.0") and pandas.specifier.contains(
        runtime["pandas"]), pandas


def test_airflow_range_holds_the_tested_version_and_no_other_minor() -> None:
    tested = Version(pins(ROOT / "requirements.txt")["apache-airflow"])
    spec = requirement("apache-airflow").specifier
    assert spec.contains(str(tested))
    assert not spec.contains(f"{tested.major}.{tested.minor + 1}.0")
    assert not spec.contains(f"{tested.major}.{tested.minor - 1}.0")


def test_pyiceberg_pinned_to_the_minor_whose_private_functions_the_sink_imports() -> None:
    private = [m for f in sorted((ROOT / "plugins/offsetflow/sinks/iceberg").glob("*.py"))
               for m in re.findall(r"from pyiceberg[\w.]* import (_\w+)", f.read_text())]
    assert private, "the Iceberg sink imports no private pyiceberg function any more: " \
                    "the extra may allow the next minor"
    tested = Version(pins(ROOT / "requirements.txt")["pyiceberg"])
    spec = requirement("pyiceberg", "iceberg").specifier
    assert spec.contains(str(tested))
    assert not spec.contains(f"{tested.major}.{tested.minor + 1}.0")
    assert not spec.contains(f"{tested.major}.{tested.minor - 1}.0")
