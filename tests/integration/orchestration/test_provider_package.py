"""OffsetFlow as an Airflow provider, installed as a user installs it (issue 20 item 6, issue
29 item 1): the wheel built from the sources alone, installed with `pip install
'offsetflow[all]' -c requirements.txt` into a clean venv (nothing of this repo on the path)
gives exactly the tested runtime, the provider, the plugin page, the [offsetflow] settings and
the CLI; installed without extras it still validates an Iceberg pipeline, and running one
stops with an error naming the extra to install."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # builds a wheel and installs Airflow into two new venvs

ROOT = Path(__file__).resolve().parents[3]


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 600) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n" \
                              f"{p.stderr[-3000:]}"
    return p.stdout


def _uv(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 900) -> str:
    """A uv command from uv's cache alone (seconds: make venv filled it), or, when the cache
    lacks something, with the registry (a minute and more of index look-ups here)."""
    p = subprocess.run([*cmd, "--offline"], capture_output=True, text=True, env=env, cwd=cwd,
                       timeout=timeout)
    if p.returncode == 0:
        return p.stdout
    out = _run(cmd, env, cwd, timeout)
    # an install from the registry builds pyspark's sdist into a new cache entry (~1.8 GB)
    # each time: keep only the newest, or test runs fill the disk
    _run([cmd[0], "cache", "prune", "-q"], env, cwd, timeout)
    return out


def _json_rows(out: str) -> list[dict[str, object]]:
    """The JSON array an `airflow ... -o json` command printed (log lines may precede it)."""
    start = out.index("[")
    rows: list[dict[str, object]] = json.loads(out[start:])
    return rows


def _pins(text: str) -> dict[str, str]:
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in
            re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text, re.M)}


@dataclass
class Install:
    """A venv with the wheel installed, an AIRFLOW_HOME of its own and a working directory
    that holds nothing of the repo."""
    venv: Path
    home: Path
    work: Path
    env: dict[str, str]
    uv: str

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *cmd: str, timeout: int = 600) -> str:
        return _run([*cmd], self.env, self.work, timeout)

    def freeze(self) -> dict[str, str]:
        """name -> version of what the venv holds (the wheel itself as `offsetflow @ URL`)."""
        out = _run([self.uv, "pip", "freeze", "--python", self.bin("python")], self.env,
                   self.work)
        pins = _pins(out)
        for name, url in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*) @ (\S+)", out, re.M):
            pins[name.lower()] = url
        return pins


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """(uv, the wheel, a scratch folder): one build for the module."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (make venv installs it)")
    tmp = tmp_path_factory.mktemp("provider")
    dist = tmp / "dist"
    # a copy without the stack's state and venv: the wheel must come from the sources alone
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".stack", ".git", "__pycache__", "*.egg-info", "build", "bench-results",
        "dist"))
    _uv([uv, "build", "--wheel", "--out-dir", str(dist), str(src)], _base_env(), tmp)
    wheels = list(dist.glob("offsetflow-*.whl"))
    assert len(wheels) == 1, wheels
    yield uv, wheels[0], tmp


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("AIRFLOW", "OFFSETFLOW", "PYTHON", "VIRTUAL_ENV"))}


def _install(built: tuple[str, Path, Path], name: str, extras: str) -> Install:
    uv, wheel, tmp = built
    base_env = _base_env()
    venv = tmp / name
    _run([uv, "venv", str(venv), "--python", "3.11"], base_env, tmp)
    # as docs/deployment.md says: the package (with extras) and the constraints file
    _uv([uv, "pip", "install", "--python", str(venv / "bin" / "python"),
         f"offsetflow{extras} @ {wheel.as_uri()}", "-c", str(ROOT / "requirements.txt")],
        base_env, tmp)
    home = tmp / f"{name}-airflow-home"
    home.mkdir()
    work = tmp / f"{name}-elsewhere"  # nothing of the repo in the working directory
    work.mkdir()
    env = {**base_env, "PATH": f"{venv / 'bin'}{os.pathsep}{base_env.get('PATH', '')}",
           "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "VIRTUAL_ENV": str(venv)}
    return Install(venv, home, work, env, uv)


@pytest.fixture(scope="module")
def full(built: tuple[str, Path, Path]) -> Install:
    return _install(built, "venv-all", "[all]")


@pytest.fixture(scope="module")
def bare(built: tuple[str, Path, Path]) -> Install:
    return _install(built, "venv-bare", "")


def test_the_wheel_carries_what_it_needs(built: tuple[str, Path, Path]) -> None:
    names = set(zipfile.ZipFile(built[1]).namelist())
    for needed in ("offsetflow/migrations/", "offsetflow/orchestration/templates/",
                   "offsetflow/spark_app/run_batch.py",
                   "offsetflow/orchestration/provider_info.py", "offsetflow/py.typed"):
        assert any(n.startswith(needed) for n in names), f"{needed} is not in the wheel"
    assert any(n.startswith("offsetflow/migrations/") and n.endswith(".sql") for n in names)
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    ep_text = zipfile.ZipFile(built[1]).read(f"{dist_info}/entry_points.txt").decode()
    assert "[apache_airflow_provider]" in ep_text and "[airflow.plugins]" in ep_text, ep_text
    assert f"{dist_info}/licenses/LICENSE" in names
    meta = zipfile.ZipFile(built[1]).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta
    for extra in ("avro", "iceberg", "quality", "statsd", "all"):
        assert f"Provides-Extra: {extra}" in meta


def test_installed_with_all_extras_into_clean_airflow_venv_is_the_tested_runtime(
        full: Install) -> None:
    # exactly requirements.txt: what the constraints file pins is what the package needs
    installed = full.freeze()
    assert installed.pop("offsetflow").endswith("offsetflow-0.1.0-py3-none-any.whl")
    tested = _pins((ROOT / "requirements.txt").read_text())
    assert installed == tested, {
        "installed, not pinned": sorted(set(installed) - set(tested)),
        "pinned, not installed": sorted(set(tested) - set(installed)),
        "other version": sorted(n for n in installed if n in tested
                                and installed[n] != tested[n])}

    where = full.run(full.bin("python"), "-c", "import offsetflow, offsetflow.orchestration."
                     "operators as s; print(offsetflow.__file__); print(s.SPARK_JOB)")
    site = str(full.venv / "lib")
    assert all(line.startswith(site) for line in where.split()), where
    assert Path(where.split()[1]).is_file()

    providers = _json_rows(full.run(full.bin("airflow"), "providers", "list", "-o", "json"))
    ours = [r for r in providers if r.get("package_name") == "offsetflow"]
    assert ours, f"offsetflow is not among the providers: {providers}"
    assert ours[0]["version"] == "0.1.0"

    plugins = _json_rows(full.run(full.bin("airflow"), "plugins", "-o", "json"))
    plugin = [r for r in plugins if r.get("name") == "offsetflow"]
    assert plugin, f"the offsetflow plugin is not listed: {plugins}"
    assert "offsetflow.orchestration.plugin:OffsetFlowPlugin" in str(plugin[0]["source"])
    assert "/offsetflow" in str(plugin[0])

    cli = full.run(full.bin("offsetflow"), "--help")
    assert "run-batch" in cli

    # the [offsetflow] section (issue 29): declared by the provider, shown by Airflow, and
    # folders relative to Airflow's dags_folder, never inside site-packages
    section = full.run(full.bin("airflow"), "config", "list", "--section", "offsetflow",
                       "--show-values")
    assert "pipelines_folder = {dags_folder}/../include/pipelines" in section, section
    assert "spark_conn_id = spark_default" in section, section
    home = full.home
    p = subprocess.run([full.bin("offsetflow"), "dags", "sync"], capture_output=True,
                       text=True, env=full.env, cwd=full.work, timeout=120)
    assert p.returncode == 2, p
    assert f"[offsetflow] pipelines_folder (airflow.cfg, AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER" \
           f" or OFFSETFLOW_PIPELINES_DIR) is {home / 'include' / 'pipelines'}, which is not a " \
           f"folder" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (full.venv / "lib" / "python3.11" / "dags").exists()
    (home / "dags").mkdir()
    (home / "include" / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "include" / "pipelines" / "orders.yaml", home / "include" / "pipelines")
    synced = full.run(full.bin("offsetflow"), "dags", "sync")
    assert (home / "dags" / "pipelines" / "orders.py").is_file(), synced


def test_installed_without_extras_an_iceberg_pipeline_names_the_missing_extra(
        bare: Install) -> None:
    installed = bare.freeze()
    tested = _pins((ROOT / "requirements.txt").read_text())
    # the base install is the tested stack (one pyspark, pandas 2) without the optional parts
    for name in ("pyspark", "pyspark-client", "pandas", "apache-airflow"):
        assert installed[name] == tested[name], name
    assert not {"pyiceberg", "fastavro", "great-expectations", "statsd"} & set(installed), \
        installed

    pipeline = bare.work / "events.yaml"
    # a PostgreSQL nobody listens on: the error must come before any service is reached
    dsn = "postgresql://offsetflow@127.0.0.1:1/offsetflow"
    pipeline.write_text(yaml.safe_dump({
        "name": "events", "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "source": {"topics": ["events"]},
        "format": {"type": "json", "schema": {"event_id": "string"}},
        "sink": {"type": "iceberg", "connection": dsn, "table": "lake.events",
                 "catalog": {"warehouse": str(bare.work / "warehouse")}}}))
    # offline validation needs no optional part
    bare.run(bare.bin("offsetflow"), "validate", str(pipeline))

    p = subprocess.run([bare.bin("offsetflow"), "plan", "--pipeline-file", str(pipeline)],
                       capture_output=True, text=True, env=bare.env, cwd=bare.work, timeout=120)
    assert p.returncode == 2, p
    assert p.stderr.strip() == (
        f"offsetflow: error: {pipeline}: sink.type: iceberg (pipeline events) needs pyiceberg, "
        f"which this Python cannot import: install OffsetFlow's iceberg extra into this "
        f"environment, pip install 'offsetflow[iceberg]' -c requirements.txt (the constraints "
        f"file of the tested versions, docs/deployment.md), or 'offsetflow[all]' for every "
        f"optional part"), p.stderr


def test_installed_with_all_extras_runs_a_scheduled_dag_run_from_airflow_connections(
        full: Install, kafka_bootstrap: str, admin_dsn: str) -> None:
    """Issue 29's user, end to end: only Airflow config (the [offsetflow] folders, a
    metadata database) and Connections (SCRAM Kafka, a password PostgreSQL role) set; a
    pipeline synced from the user's folder; a scheduled DAG run by the installed Airflow
    (`airflow dags test`, spark-submit from the installed pyspark) commits every record once,
    and neither password shows in its output."""
    import contextlib
    import uuid

    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.tooling.airflow_standalone import own_database
    from tests.tooling.pipeline_data import SCHEMA, produce_plain, query
    from tests.tooling.secured_services import (
        conn_env,
        kafka_connection,
        password_database,
        scram_user,
    )

    uid = uuid.uuid4().hex[:8]
    topic, name = f"inst-{uid}", f"inst_{uid}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    with contextlib.ExitStack() as stack:
        stack.callback(admin.delete_topics, [topic])
        user, kafka_pw = stack.enter_context(scram_user(kafka_bootstrap))
        pg = stack.enter_context(password_database(admin_dsn))
        metadata = stack.enter_context(own_database(os.environ))
        project = full.work / f"project-{uid}"  # the user's: dags/ beside include/pipelines/
        (project / "dags").mkdir(parents=True)
        (project / "include" / "pipelines").mkdir(parents=True)
        kafka_id, pg_id = f"inst_kafka_{uid}", f"inst_pg_{uid}"
        (project / "include" / "pipelines" / f"{name}.yaml").write_text(yaml.safe_dump({
            "name": name, "schedule": "@daily", "retries": 0, "kafka": {"conn_id": kafka_id},
            "source": {"topics": [topic]}, "format": {"type": "json", "schema": dict(SCHEMA)},
            "sink": {"conn_id": pg_id, "table": f"inst_{uid}"}}))
        env = {**full.env, **dict([conn_env(kafka_id, kafka_connection(user, kafka_pw)),
                                   conn_env(pg_id, pg.connection())]),
               "AIRFLOW__CORE__DAGS_FOLDER": str(project / "dags"),
               "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN":
                   metadata["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"],
               # the Spark workers of the installed OffsetFlow run its own Python
               "PYSPARK_PYTHON": full.bin("python"), "PYSPARK_DRIVER_PYTHON": full.bin("python")}
        if os.environ.get("AIRFLOW__CORE__FERNET_KEY"):  # the template's copied connections
            env["AIRFLOW__CORE__FERNET_KEY"] = os.environ["AIRFLOW__CORE__FERNET_KEY"]
        synced = _run([full.bin("offsetflow"), "dags", "sync"], env, full.work)
        assert (project / "dags" / "pipelines" / f"{name}.py").is_file(), synced
        produce_plain(kafka_bootstrap, topic, 300, f"inst{uid}", 2)
        p = subprocess.run([full.bin("airflow"), "dags", "test", f"offsetflow_{name}"],
                           capture_output=True, text=True, env=env, cwd=full.work, timeout=900)
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-6000:]
        rows = query(pg.dsn, f"SELECT count(*), count(DISTINCT (partition, \"offset\")) "
                             f"FROM inst_{uid}")
        assert rows == [(300, 300)], out[-4000:]
        assert kafka_pw not in out and pg.password not in out
