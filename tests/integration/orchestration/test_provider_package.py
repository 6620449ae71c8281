"""OffsetFlow as an Airflow provider (issue 20 item 6): the built wheel, installed into a
clean venv with Airflow and nothing of this repo on the path, gives the provider, the plugin
page and the CLI, in an AIRFLOW_HOME of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a wheel and installs Airflow into a new venv

ROOT = Path(__file__).resolve().parents[3]


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 600) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n" \
                              f"{p.stderr[-3000:]}"
    return p.stdout


def _json_rows(out: str) -> list[dict[str, object]]:
    """The JSON array an `airflow ... -o json` command printed (log lines may precede it)."""
    start = out.index("[")
    rows: list[dict[str, object]] = json.loads(out[start:])
    return rows


def test_wheel_installed_into_clean_airflow_venv_lists_provider_plugin_and_cli(
        tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (make venv installs it)")
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("AIRFLOW", "OFFSETFLOW", "PYTHON", "VIRTUAL_ENV"))}
    dist = tmp_path / "dist"
    # a copy without the stack's state and venv: the wheel must come from the sources alone
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".stack", ".git", "__pycache__", "*.egg-info", "build", "bench-results"))
    _run([uv, "build", "--wheel", "--out-dir", str(dist), str(src)], base_env, tmp_path)
    wheels = list(dist.glob("offsetflow-*.whl"))
    assert len(wheels) == 1, wheels
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    for needed in ("offsetflow/migrations/", "offsetflow/orchestration/templates/",
                   "offsetflow/spark_app/run_batch.py",
                   "offsetflow/orchestration/provider_info.py"):
        assert any(n.startswith(needed) for n in names), f"{needed} is not in the wheel"
    assert any(n.startswith("offsetflow/migrations/") and n.endswith(".sql") for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    ep_text = zipfile.ZipFile(wheels[0]).read(entry_points).decode()
    assert "[apache_airflow_provider]" in ep_text and "[airflow.plugins]" in ep_text, ep_text

    venv = tmp_path / "venv"
    _run([uv, "venv", str(venv), "--python", "3.11"], base_env, tmp_path)
    py = venv / "bin" / "python"
    # the same pins as the project's own venv, from uv's cache
    _run([uv, "pip", "install", "--python", str(py), "-r", str(ROOT / "requirements.txt"),
          str(wheels[0])], base_env, tmp_path, timeout=900)

    home = tmp_path / "airflow-home"
    home.mkdir()
    work = tmp_path / "elsewhere"  # nothing of the repo in the working directory
    work.mkdir()
    env = {**base_env, "PATH": f"{venv / 'bin'}{os.pathsep}{base_env.get('PATH', '')}",
           "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "VIRTUAL_ENV": str(venv)}
    where = _run([str(py), "-c", "import offsetflow, offsetflow.orchestration.operators as s; "
                  "print(offsetflow.__file__); print(s.SPARK_JOB)"], env, work)
    site = str(venv / "lib")
    assert all(line.startswith(site) for line in where.split()), where
    assert Path(where.split()[1]).is_file()

    providers = _json_rows(_run([str(venv / "bin" / "airflow"), "providers", "list",
                                 "-o", "json"], env, work))
    ours = [r for r in providers if r.get("package_name") == "offsetflow"]
    assert ours, f"offsetflow is not among the providers: {providers}"
    assert ours[0]["version"] == "0.1.0"

    plugins = _json_rows(_run([str(venv / "bin" / "airflow"), "plugins", "-o", "json"],
                              env, work))
    plugin = [r for r in plugins if r.get("name") == "offsetflow"]
    assert plugin, f"the offsetflow plugin is not listed: {plugins}"
    assert "offsetflow.orchestration.plugin:OffsetFlowPlugin" in str(plugin[0]["source"])
    assert "/offsetflow" in str(plugin[0])

    cli = _run([str(venv / "bin" / "offsetflow"), "--help"], env, work)
    assert "run-batch" in cli

    # the [offsetflow] section (issue 29): declared by the provider, shown by Airflow, and
    # folders relative to Airflow's dags_folder, never inside site-packages
    section = _run([str(venv / "bin" / "airflow"), "config", "list", "--section", "offsetflow",
                    "--show-values"], env, work)
    assert "pipelines_folder = {dags_folder}/../include/pipelines" in section, section
    assert "spark_conn_id = spark_default" in section, section
    offsetflow = str(venv / "bin" / "offsetflow")
    p = subprocess.run([offsetflow, "dags", "sync"], capture_output=True, text=True, env=env,
                       cwd=work, timeout=120)
    assert p.returncode == 2, p
    assert f"[offsetflow] pipelines_folder (airflow.cfg, AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER" \
           f" or OFFSETFLOW_PIPELINES_DIR) is {home / 'include' / 'pipelines'}, which is not a " \
           f"folder" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (venv / "lib" / "python3.11" / "dags").exists()
    (home / "dags").mkdir()
    (home / "include" / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "include" / "pipelines" / "orders.yaml", home / "include" / "pipelines")
    synced = _run([offsetflow, "dags", "sync"], env, work)
    assert (home / "dags" / "pipelines" / "orders.py").is_file(), synced
