"""docker-compose.yaml cannot run here (no Docker engine); check what can be checked without
one: the compose CLI's own `config` accepts it (when a compose CLI is installed: Debian's
docker-compose, `make system-browser`), and the file agrees with the project: the services
exist, start in order, host ports equal the local stack's, images carry the pinned versions,
the shipped pipeline's Spark Connect server is there, and the images install OffsetFlow as a
user would (not editable, runtime only, readable by their non-root users)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
AIRFLOW_SERVICES = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer")


def compose_cli() -> list[str] | None:
    """`docker compose` (the v2 plugin) or Debian's `docker-compose`, whichever is here."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=60).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@cache
def compose() -> dict[str, Any]:
    """The file as compose itself reads it (anchors, merges and ${VAR:-default} resolved), or
    as YAML when no compose CLI is installed."""
    cli = compose_cli()
    if cli is None:
        data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
        return data
    out = subprocess.run([*cli, "-f", str(ROOT / "docker-compose.yaml"), "config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(out.stdout)
    return data


def stack_setting(name: str) -> str:
    m = re.search(rf'^{name}="\$\{{[A-Z_]+:-([^}}]+)\}}"', (ROOT / "include/stack/stack.sh")
                  .read_text(), re.M)
    assert m, f"{name} not found in stack.sh"
    return m.group(1)


def pinned(package: str) -> str:
    m = re.search(rf"^{re.escape(package)}==(\S+)$", (ROOT / "requirements.txt").read_text(),
                  re.M | re.I)
    assert m, f"{package} is not pinned in requirements.txt"
    return m.group(1)


def host_ports(svc: dict[str, Any]) -> dict[int, int]:
    out = {}
    for p in svc.get("ports", []):
        if isinstance(p, dict):  # compose v2's long form
            host_ip, host, container = p.get("host_ip"), p["published"], p["target"]
        else:
            host_ip, host, container = str(p).split("/")[0].split(":")
        assert host_ip == "127.0.0.1", f"port {p} must bind to loopback"
        out[int(container)] = int(host)
    return out


def dockerfile(name: str) -> str:
    return (ROOT / "include/docker" / name).read_text()


def mounts(svc: dict[str, Any]) -> dict[str, str]:
    """host folder (relative to the project) -> container path"""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, dict):
            source, target = v["source"], v["target"]
        else:
            source, target = str(v).split(":")[:2]
        out["./" + str(Path(source).resolve().relative_to(ROOT)) if source.startswith("/")
            else source] = target
    return out


def test_the_compose_cli_accepts_the_file() -> None:
    if compose_cli() is None:
        pytest.skip("no compose CLI here (Debian's docker-compose: make system-browser)")
    assert compose()["services"]  # compose() asserts `config` exited 0


def test_services_present() -> None:
    services = set(compose()["services"])
    assert {"kafka", "kafka-init", "postgres", "airflow-init", "spark-connect",
            "spark-master", "spark-worker", *AIRFLOW_SERVICES} <= services


def test_airflow_starts_after_its_init_and_healthy_services() -> None:
    s = compose()["services"]
    for name in ("postgres", "kafka", "spark-connect"):
        assert s[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    init = s["airflow-init"]
    assert "airflow db migrate" in str(init["command"]) and \
        "offsetflow db upgrade" in str(init["command"])
    assert init["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert s["kafka-init"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert "--topic orders" in str(s["kafka-init"]["command"])
    for name in AIRFLOW_SERVICES:
        deps = s[name]["depends_on"]
        assert deps["airflow-init"]["condition"] == "service_completed_successfully", name
        assert deps["kafka-init"]["condition"] == "service_completed_successfully", name
        for healthy in ("postgres", "kafka", "spark-connect"):
            assert deps[healthy]["condition"] == "service_healthy", (name, healthy)


def test_the_shipped_pipeline_has_its_spark_connect_server() -> None:
    pipeline = yaml.safe_load((ROOT / "include/pipelines/orders.yaml").read_text())
    assert pipeline["spark"]["launch"] == "connect"
    url_var = re.fullmatch(r"\$\{(\w+)(:-[^}]*)?\}", pipeline["spark"]["connect_url"])
    assert url_var, pipeline["spark"]["connect_url"]
    s = compose()["services"]
    connect = s["spark-connect"]
    command = connect["command"]
    command = command if isinstance(command, list) else command.split()
    assert "org.apache.spark.sql.connect.service.SparkConnectServer" in command
    port = int(next(c.split("=")[1] for c in command
                    if c.startswith("spark.connect.grpc.binding.port=")))
    assert host_ports(connect)[port] == int(stack_setting("CONNECT_PORT"))
    for name in AIRFLOW_SERVICES:
        assert s[name]["environment"][url_var.group(1)] == f"sc://spark-connect:{port}", name
    # its Python workers run offsetflow from the Spark image, and it holds no credentials
    assert connect["image"] == s["spark-worker"]["image"]
    env = connect.get("environment") or {}
    assert not [k for k in env if re.search("DSN|PASSWORD|SECRET|TOKEN|^AIRFLOW_CONN", k)]


def test_host_ports_match_local_stack() -> None:
    s = compose()["services"]
    assert host_ports(s["kafka"])[19092] == int(stack_setting("KAFKA_PORT"))
    assert host_ports(s["postgres"])[5432] == int(stack_setting("PG_PORT"))
    assert host_ports(s["airflow-apiserver"])[8080] == int(stack_setting("AIRFLOW_PORT"))


def test_versions_match_pins() -> None:
    s = compose()["services"]
    pom = (ROOT / "include/stack/kafka/pom.xml").read_text()
    kafka_version = re.search(r"<kafka.version>([^<]+)</kafka.version>", pom)
    assert kafka_version and s["kafka"]["image"] == f"apache/kafka:{kafka_version.group(1)}"
    assert s["kafka-init"]["image"] == s["kafka"]["image"]
    assert f"apache/airflow:{pinned('apache-airflow')}-python3.11" in dockerfile(
        "Dockerfile.airflow")
    spark = dockerfile("Dockerfile.spark")
    assert f"apache/spark:{pinned('pyspark')}-python3" in spark
    # the executors' Python is the Airflow image's (Spark refuses workers of another minor)
    assert re.search(r"^FROM python:3\.11-", spark, re.M), "the Spark image's Python is not 3.11"


def test_kafka_supports_transactions_and_retention_tests() -> None:
    env = compose()["services"]["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert int(env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"]) == 1
    assert int(env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]) == 1
    assert str(env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]).lower() == "false"


def test_airflow_services_mount_dags_and_include_and_agree_on_env() -> None:
    s = compose()["services"]
    for name in (*AIRFLOW_SERVICES, "airflow-init"):
        svc = s[name]
        mounted = mounts(svc)
        # OffsetFlow comes from the image's install: no plugins folder shadows it
        assert set(mounted) == {"./dags", "./include"}, f"{name} mounts {mounted}"
        for folder in mounted:
            assert (ROOT / folder).is_dir()
        env = svc["environment"]
        assert "AIRFLOW__CORE__PLUGINS_FOLDER" not in env
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == mounted["./dags"]
        assert env["AIRFLOW__OFFSETFLOW__PIPELINES_FOLDER"] == mounted["./include"] + "/pipelines"
        assert env["AIRFLOW__OFFSETFLOW__GX_ROOT"] == mounted["./include"]
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "False"
        assert env["OFFSETFLOW_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert "@postgres:5432/offsetflow" in env["OFFSETFLOW_PG_DSN"]
        assert "@postgres:5432/airflow" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        # spark.launch: submit pipelines go to the standalone master
        assert env["AIRFLOW_CONN_SPARK_DEFAULT"] == "spark://spark-master:7077"
    init_sql = (ROOT / "include/docker/init-databases.sql").read_text()
    assert "CREATE DATABASE airflow" in init_sql


def copied(text: str) -> list[str]:
    """The build-context sources of a Dockerfile's COPY lines (not those from a stage)."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            out += [w for w in words[1:-1] if not w.startswith("--")]
    return out


def test_images_install_offsetflow_as_a_user_would() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for name in ("Dockerfile.airflow", "Dockerfile.spark"):
        text = dockerfile(name)
        sources = copied(text)
        for src in sources:
            assert (ROOT / src).exists(), f"{name} copies {src}, which does not exist"
        # what building the package needs: its metadata's readme and license files
        for needed in ("pyproject.toml", project["readme"], *project["license-files"],
                       "plugins/offsetflow"):
            assert needed in sources, f"{name} does not copy {needed}"
        assert not re.search(r"pip install[^\n]*\s-e\s", text), f"{name}: editable install"
        assert "requirements-dev" not in text, f"{name} installs the development tools"
    airflow = dockerfile("Dockerfile.airflow")
    install = re.search(r"^RUN pip install (.*)", airflow, re.M)
    assert install and '"/opt/offsetflow[all]" -c /opt/offsetflow/requirements.txt' in \
        install.group(1), "the Airflow image installs the package with its extras and the " \
                          "constraints file"
    assert "-r " not in install.group(1)
    # as the image's non-root user, on files it owns
    before = airflow[:install.start()]
    assert before.rstrip().splitlines()[-1] == "USER airflow"
    assert all(line.startswith("COPY --chown=airflow:0 ")
               for line in airflow.splitlines() if line.startswith("COPY "))
    assert dockerfile("Dockerfile.spark").rstrip().splitlines()[-1] == "USER spark"
