"""Iceberg's Spark runtime next to OffsetFlow's Spark: where it comes from and how Spark
reaches the SQL catalog OffsetFlow's Iceberg sink writes.

No Iceberg Spark runtime runs on Spark 4.2 (OffsetFlow's pyspark): Maven Central has
`iceberg-spark-runtime-4.1_2.13:1.12.0` as the newest, and on pyspark 4.2.0 it cannot even be
loaded (`IncompatibleClassChangeError: class org.apache.iceberg.spark.source.SparkView can
not implement org.apache.spark.sql.connector.catalog.View, because it is not an interface`
for SparkCatalog; `Found interface org.apache.spark.sql.connector.catalog.CatalogManager,
but class was expected` for `spark.read.format("iceberg")`). So the Spark side of Iceberg
runs in an environment of its own, `.stack/iceberg-spark/` (pyspark 4.1 from PyPI with uv;
the runtime jar, Spark's Kafka source and the PostgreSQL driver from Maven Central through
`spark.jars.packages`, cached in Ivy's cache), used by the benchmark's
`spark-builtin-iceberg` engine and the reading recipe test of docs/sinks/iceberg.md.
Nothing here is on OffsetFlow's own path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psycopg2.extensions

ROOT = Path(__file__).resolve().parents[2]
ENV_DIR = ROOT / ".stack" / "iceberg-spark"
# the newest 4.1 whose Kafka source resolves from the Maven Central this was built against:
# spark-sql-kafka 4.1.4 and spark-token-provider-kafka 4.1.2 and 4.1.3 answered 404 there
PYSPARK = "4.1.1"
ICEBERG_RUNTIME = "org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.12.0"
KAFKA_PACKAGE = f"org.apache.spark:spark-sql-kafka-0-10_2.13:{PYSPARK}"
JDBC_PACKAGE = "org.postgresql:postgresql:42.7.8"
CHILD = Path(__file__).with_name("iceberg_spark_child.py")


class IcebergSparkUnavailable(RuntimeError):
    """The Iceberg Spark environment or one of its jars could not be fetched."""


def ensure_env(env_dir: Path = ENV_DIR) -> Path:
    """The environment's python, created with uv the first time (PyPI through uv's cache)."""
    python = env_dir / "bin" / "python"
    marker = env_dir / f".pyspark-{PYSPARK}"
    if marker.exists():
        return python
    uv = shutil.which("uv")
    if uv is None:
        raise IcebergSparkUnavailable("uv is not on PATH (make venv installs it)")
    steps = [[uv, "venv", "-q", "--allow-existing", "--python", "3.11", str(env_dir)],
             [uv, "pip", "install", "-q", "--python", str(python), f"pyspark=={PYSPARK}"]]
    for cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise IcebergSparkUnavailable(f"{' '.join(cmd[:3])} failed: "
                                          f"{(p.stderr or p.stdout).strip()[-400:]}")
    marker.touch()
    return python


def catalog_conf(catalog: str, dsn: str, warehouse: str) -> dict[str, str]:
    """Spark conf of an Iceberg JDBC catalog on the PostgreSQL database that pyiceberg's SQL
    catalog `catalog` uses (both keep tables in `iceberg_tables`, keyed by catalog name: the
    Spark catalog must carry the same name as `sink.catalog.name`)."""
    p = psycopg2.extensions.parse_dsn(dsn)
    key = f"spark.sql.catalog.{catalog}"
    return {key: "org.apache.iceberg.spark.SparkCatalog",
            f"{key}.catalog-impl": "org.apache.iceberg.jdbc.JdbcCatalog",
            f"{key}.uri": (f"jdbc:postgresql://{p.get('host', '127.0.0.1')}:"
                           f"{p.get('port', 5432)}/{p['dbname']}"),
            f"{key}.jdbc.user": p.get("user", ""),
            f"{key}.jdbc.password": p.get("password", ""),
            f"{key}.warehouse": warehouse}


def spark_conf(catalog: str, dsn: str, warehouse: str, kafka: bool = False) -> dict[str, str]:
    pkgs = [ICEBERG_RUNTIME, JDBC_PACKAGE] + ([KAFKA_PACKAGE] if kafka else [])
    return {"spark.jars.packages": ",".join(pkgs),
            "spark.sql.extensions":
                "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions",
            "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
            "spark.sql.session.timeZone": "UTC", "spark.sql.shuffle.partitions": "8",
            **catalog_conf(catalog, dsn, warehouse)}


def start_child(python: Path, mode: str, spec: dict[str, Any], work: Path
                ) -> tuple[subprocess.Popen[bytes], Path]:
    """Start the child in `mode` on `spec`: (the process, where its result will be)."""
    work.mkdir(parents=True, exist_ok=True)
    result = work / f"{mode}-result.json"
    result.unlink(missing_ok=True)
    spec_file = work / f"{mode}-spec.json"
    spec_file.touch(mode=0o600)  # the catalog's password is in the conf
    spec_file.write_text(json.dumps({**spec, "result_file": str(result)}))
    env = {**os.environ, "PYSPARK_PYTHON": str(python), "PYSPARK_DRIVER_PYTHON": str(python),
           "PYTHONPATH": ""}
    proc = subprocess.Popen([str(python), str(CHILD), mode, str(spec_file)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, result


def child_result(proc: subprocess.Popen[bytes], result: Path, timeout: float = 3600
                 ) -> dict[str, Any]:
    """The child's result; IcebergSparkUnavailable when it could not fetch its jars."""
    output, _ = proc.communicate(timeout=timeout)
    doc: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    text = output.decode(errors="replace")
    if proc.returncode != 0 and "UNRESOLVED DEPENDENCIES" in text:
        # Ivy's report on the JVM's stderr; pyspark itself only says JAVA_GATEWAY_EXITED
        missing = re.findall(r"::\s+(\S+#\S+;\S+: not found)", text)
        raise IcebergSparkUnavailable(
            f"Spark could not fetch {', '.join(missing) or 'its jars'} (spark.jars.packages "
            f"from Maven Central, cached in Ivy's cache)")
    if proc.returncode != 0:
        log = result.with_suffix(".log")
        log.write_text(text)
        # the JVM's stack traces bury the cause: show the exception lines, the full output
        # is kept beside the result
        causes = [ln for ln in text.splitlines() if not ln.startswith(("\t", " "))
                  and ("Exception" in ln or "Error" in ln)]
        raise RuntimeError(f"the Iceberg Spark child failed ({proc.returncode}; output in "
                           f"{log}):\n" + "\n".join(causes[-8:])[-3000:])
    return doc


def run_sql(python: Path, conf: dict[str, str], statements: list[str], work: Path
            ) -> list[list[dict[str, Any]]]:
    """Rows of each statement, run by Spark SQL with Iceberg's runtime."""
    proc, result = start_child(python, "sql", {"conf": conf, "statements": statements}, work)
    rows: list[list[dict[str, Any]]] = child_result(proc, result, timeout=900)["results"]
    return rows
