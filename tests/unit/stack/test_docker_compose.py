"""docker-compose.yaml cannot run here; check it agrees with the project's own configuration:
the services exist, host ports equal the local stack's, the project is mounted, the images
carry the versions the project pins, and the environment names the same settings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yaml").read_text())


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
        host_ip, host, container = str(p).split(":")
        assert host_ip == "127.0.0.1", f"port {p} must bind to loopback"
        out[int(container)] = int(host)
    return out


def test_services_present() -> None:
    services = set(compose()["services"])
    assert {"kafka", "postgres", "airflow-apiserver", "airflow-scheduler",
            "airflow-dag-processor", "airflow-triggerer", "spark-master",
            "spark-worker"} <= services


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
    dockerfile = (ROOT / "include/docker/Dockerfile.airflow").read_text()
    assert f"apache/airflow:{pinned('apache-airflow')}-python3.11" in dockerfile
    spark_df = (ROOT / "include/docker/Dockerfile.spark").read_text()
    assert f"apache/spark:{pinned('pyspark')}-python3" in spark_df


def test_kafka_supports_transactions_and_retention_tests() -> None:
    env = compose()["services"]["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert int(env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"]) == 1
    assert int(env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"]) == 1
    assert str(env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]).lower() == "false"


def test_airflow_services_mount_project_and_agree_on_env() -> None:
    s = compose()["services"]
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                 "airflow-triggerer"):
        svc = s[name]
        mounts = {v.split(":")[0]: v.split(":")[1] for v in svc["volumes"]}
        for folder in ("./dags", "./plugins", "./include", "./spark_jobs"):
            assert folder in mounts, f"{name} does not mount {folder}"
            assert (ROOT / folder).is_dir()
        env = svc["environment"]
        assert env["AIRFLOW__CORE__DAGS_FOLDER"] == mounts["./dags"]
        assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == mounts["./plugins"]
        assert env["OFFSETFLOW_PIPELINES_DIR"] == mounts["./include"] + "/pipelines"
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"] == "False"
        assert env["OFFSETFLOW_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert "@postgres:5432/offsetflow" in env["OFFSETFLOW_PG_DSN"]
        assert "@postgres:5432/airflow" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        # in compose the Spark connection points at the standalone master: only it differs
        assert env["AIRFLOW_CONN_SPARK_DEFAULT"] == "spark://spark-master:7077"
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
    init_sql = (ROOT / "include/docker/init-databases.sql").read_text()
    assert "CREATE DATABASE airflow" in init_sql
