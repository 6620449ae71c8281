"""`offsetflow validate` (issue 29, item 5): malformed pipeline files, every error of every
file reported in one run with file, dotted field and line:column, exit 2; offline: no
socket opened, no Airflow imported (so no metadata database or airflow.cfg created)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from offsetflow.cli import main
from offsetflow.config import pipeline_json_schema

ROOT = Path(__file__).resolve().parents[3]
MALFORMED = Path(__file__).resolve().parent / "malformed"
PIPELINES = ROOT / "include" / "pipelines"

# every error of every malformed file: (file, line, column, field, words of the message)
EXPECTED = [
    ("bad_enums", 4, 20, "kafka.isolation_level", "did you mean 'read_committed'?"),
    ("bad_enums", 7, 14, "source.data_loss", "'ignore' is not one of ['continue', 'fail']"),
    ("bad_enums", 14, 9, "sink.mode", "did you mean 'upsert'?"),
    ("bad_enums", 15, 14, "bad_records", "did you mean 'dead_letter'?"),
    ("bad_enums", 17, 11, "spark.launch", "did you mean 'connect'?"),
    ("bad_identifiers", 1, 7, "name", "'Bad-Name' must match"),
    ("bad_identifiers", 7, 5, "format.schema.order-id", "not a valid column name"),
    ("bad_identifiers", 8, 5, "format.schema.offset", "reserved source column"),
    ("bad_identifiers", 12, 10, "sink.table", "not a valid table name"),
    ("bad_identifiers", 14, 9, "sink.key[0]", "not a valid column name"),
    ("bad_identifiers", 15, 20, "dead_letter_table", "'a.b.c' is not a valid table name"),
    ("bad_partitions", 13, 7, "sink.partition_by[0]", "'no_such_column' is not a column"),
    ("bad_partitions", 14, 7, "sink.partition_by[1]", "bucket needs a positive width"),
    ("bad_partitions", 15, 7, "sink.partition_by[2]", "unknown transform 'week'"),
    ("bad_partitions", 16, 7, "sink.partition_by[3]", "day takes no width"),
    ("bad_partitions", 17, 13, "sink.sort_by[0]", "is not a sort field"),
    ("bad_starting", 4, 18, "source.topic_pattern", "invalid regular expression"),
    ("bad_starting", 5, 25, "source.starting.timestamp", "'yesterday' is not an ISO-8601"),
    ("bad_topics", 6, 7, "source.topics[1]", "'bad topic' is not a valid Kafka topic name"),
    ("bad_topics", 7, 7, "source.topics[2]", "'a/b' is not a valid Kafka topic name"),
    ("both_exclusive", 4, 22, "kafka.bootstrap_servers", "give either kafka.conn_id or"),
    ("both_exclusive", 6, 3, "source.topics", "give exactly one of source.topics or"),
    ("both_exclusive", 11, 15, "sink.connection", "give either sink.conn_id or"),
    ("duplicate_keys", 6, 1, "sink", "duplicate key (also at line 5)"),
    ("empty", 1, 1, "<root>", "must be a YAML mapping; the file is empty"),
    ("forbidden_settings", 5, 5, "kafka.client.group.id", "managed by OffsetFlow"),
    ("forbidden_settings", 6, 5, "kafka.client.enable.auto.commit", "managed by OffsetFlow"),
    ("forbidden_settings", 12, 16, "spark.connect_url", "not a Spark Connect URL"),
    ("invalid_syntax", 5, 7, "<yaml>", "not valid YAML: expected ',' or ']'"),
    ("kafka_sink", 10, 3, "sink.table", "is for sink.type: postgres"),
    ("kafka_sink", 12, 17, "sink.replay_topic", "must differ from sink.topic"),
    ("kafka_sink", 13, 17, "sink.value_format",
     "'avor' is not one of ['avro', 'json', 'raw']; did you mean 'avro'?"),
    ("kafka_sink", 14, 15, "sink.key_column", "did you mean 'id'?"),
    ("kafka_sink", 16, 5, "sink.producer.transactional.id", "is set by OffsetFlow"),
    ("list_root", 1, 1, "<root>", "must be a YAML mapping; got a list"),
    ("missing_sections", 2, 1, "kafka", "is required"),
    ("missing_sections", 2, 1, "source", "is required"),
    ("missing_sections", 2, 1, "sink", "is required"),
    ("sections_not_mappings", 2, 8, "kafka", "must be a mapping, got str"),
    ("sections_not_mappings", 3, 1, "source", "must be a mapping, got list"),
    ("sections_not_mappings", 6, 10, "quality", "must be a mapping, got str"),
    ("tombstones", 5, 67, "sink.partition_by", "it is a field of sink.type iceberg"),
    ("tombstones", 6, 13, "tombstones", "not a tombstone policy of sink.mode append"),
    ("two_documents", 2, 1, "<yaml>", "expected a single document"),
    ("typo_fields", 2, 1, "shedule", "unknown field; did you mean 'schedule'?"),
    ("typo_fields", 4, 3, "kafka.bootstrap_server", "did you mean 'bootstrap_servers'?"),
    ("typo_fields", 7, 3, "source.startng", "did you mean 'starting'?"),
    ("typo_fields", 11, 1, "sink.table", "is required"),
    ("typo_fields", 13, 3, "sink.tabel", "unknown field; did you mean 'table'?"),
    ("unknown_types", 7, 9, "format.schema.id", "type 'uuid' is for format.type avro only"),
    ("unknown_types", 8, 13, "format.schema.amount", "did you mean 'double'?"),
    ("unknown_types", 9, 12, "transform", "must be a dotted path"),
    ("wrong_types", 2, 10, "retries", "must be an integer >= 0, got 'two'"),
    ("wrong_types", 3, 11, "schedule", "must be a cron expression"),
    ("wrong_types", 7, 30, "source.max_records_per_partition", "got -5"),
    ("wrong_types", 15, 25, "spark.max_offsets_per_task", "got 1.5"),
]


@pytest.fixture(scope="module")
def trap() -> Any:
    """A listening socket every service's address points at: a connection attempt from any
    layer (Python, libpq, librdkafka) shows up as a pending connection on it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    yield s
    s.close()


def offline_env(trap: socket.socket, airflow_home: Path) -> dict[str, str]:
    """The environment of a machine whose services are all at the trap's port, with an
    Airflow home of its own, and this checkout's code on PYTHONPATH."""
    port = trap.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OFFSETFLOW_", "AIRFLOW", "_ARGCOMPLETE", "COMP_"))}
    env.update({
        "PYTHONPATH": f"{ROOT / 'plugins'}{os.pathsep}{ROOT}",
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"postgresql://u:p@127.0.0.1:{port}/airflow",
        "OFFSETFLOW_PG_DSN": f"postgresql://u:p@127.0.0.1:{port}/offsetflow",
        "OFFSETFLOW_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}",
        "OFFSETFLOW_SPARK_CONNECT_URL": f"sc://127.0.0.1:{port}",
        "HOME": str(airflow_home.parent),
    })
    return env


def no_connection_reached(trap: socket.socket) -> bool:
    try:
        conn, _ = trap.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


def validate(trap: socket.socket, tmp: Path, *args: str | Path
             ) -> subprocess.CompletedProcess[str]:
    home = tmp / "airflow"
    home.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "offsetflow.cli", "validate", *map(str, args)],
                       env=offline_env(trap, home), capture_output=True, text=True, timeout=60,
                       cwd=tmp)
    assert list(home.iterdir()) == [], "Airflow was initialised (airflow.cfg / airflow.db)"
    assert no_connection_reached(trap)
    return r


def test_every_error_of_every_malformed_file_in_one_run(trap: socket.socket,
                                                        tmp_path: Path) -> None:
    files = sorted(MALFORMED.glob("*.yaml"))
    assert len(files) >= 15
    t = time.monotonic()
    r = validate(trap, tmp_path, *files)
    took = time.monotonic() - t
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    reported = [line for line in lines if ": error: " in line]
    for name, line, column, field, words in EXPECTED:
        prefix = f"{MALFORMED / name}.yaml:{line}:{column}: error: {field}: "
        assert any(x.startswith(prefix) and words in x for x in reported), \
            f"not reported: {prefix}... {words}\n" + r.stdout
    assert len(reported) == len(EXPECTED), r.stdout  # nothing reported twice or unexpected
    assert {name for name, *_ in EXPECTED} == {f.stem for f in files}  # every file has errors
    assert lines[-1] == f"{len(files)} of {len(files)} files invalid: {len(EXPECTED)} errors"
    assert took < 20, f"validate took {took:.1f}s: did it wait on a service?"


def test_valid_files_exit_0_and_a_folder_stands_for_its_files(trap: socket.socket,
                                                              tmp_path: Path) -> None:
    (tmp_path / "other.yml").write_text((PIPELINES / "orders.yaml").read_text()
                                        .replace("name: orders", "name: other"))
    r = validate(trap, tmp_path, PIPELINES, tmp_path / "other.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(list(PIPELINES.glob("*.yaml"))) + 1
    assert r.stdout.splitlines() == [f"{n} files valid"]


def test_an_unset_variable_is_a_warning_unless_env_strict(trap: socket.socket,
                                                          tmp_path: Path) -> None:
    """The file is valid; the variable is the deployment's. --env-strict: an error."""
    f = tmp_path / "secrets.yaml"
    f.write_text("kafka:\n  bootstrap_servers: broker:9092\n"
                 "  client: {sasl.password: '${NOT_SET_ANYWHERE}'}\n"
                 "source: {topics: [orders]}\nformat: {type: raw}\n"
                 "sink: {table: orders}\n")
    r = validate(trap, tmp_path, f)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        f"{f}:3:27: warning: kafka.client.sasl.password: environment variable "
        f"NOT_SET_ANYWHERE is not set here; it must be where the pipeline runs",
        "1 file valid (1 warning)"]
    strict = validate(trap, tmp_path, "--env-strict", f)
    assert strict.returncode == 2
    assert strict.stdout.splitlines()[0] == (
        f"{f}:3:27: error: kafka.client.sasl.password: environment variable NOT_SET_ANYWHERE "
        f"is not set")


def test_validate_never_imports_airflow_spark_or_a_kafka_client(trap: socket.socket,
                                                                 tmp_path: Path) -> None:
    home = tmp_path / "airflow"
    home.mkdir()
    code = ("import sys\nfrom offsetflow.cli import main\n"
            f"rc = main(['validate', {str(MALFORMED)!r}, {str(PIPELINES)!r}])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'airflow', 'pyspark', 'confluent_kafka', 'sqlalchemy', 'pyiceberg'}), rc)\n")
    r = subprocess.run([sys.executable, "-c", code], env=offline_env(trap, home),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines()[-1] == "[] 2", r.stdout[-2000:] + r.stderr[-2000:]
    assert list(home.iterdir()) == []
    assert no_connection_reached(trap)


def test_validate_opens_no_socket_in_process(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"validate tried to connect: {args[1:]}")

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    assert main(["validate", str(MALFORMED), str(PIPELINES)]) == 2
    out = capsys.readouterr().out
    assert "invalid" in out.splitlines()[-1]


def test_a_missing_file_and_an_empty_folder_are_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["validate", str(tmp_path / "nope.yaml"), str(tmp_path / "empty")]) == 2
    out = capsys.readouterr().out.splitlines()
    assert f"{tmp_path / 'nope.yaml'}: error: <file>: cannot read: No such file or " \
           f"directory" in out
    assert f"{tmp_path / 'empty'}: error: <file>: no pipeline file (*.yaml, *.yml) in this " \
           f"folder" in out


def test_schema_prints_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == pipeline_json_schema()
