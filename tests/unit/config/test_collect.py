"""The parser collects (issue 29, item 5): every error of a file in one ConfigError, each
with its field and, from a file, its line and column; a broken section stops only itself,
and an error is not repeated as the errors of what depends on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from offsetflow.config import check_file, check_pipeline, load_pipeline, parse_pipeline
from offsetflow.errors import ConfigError

ENV = {"OFFSETFLOW_PG_DSN": "postgresql://u@h/db"}


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:19092"},
        "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "string", "amount": "double"}},
        "sink": {"table": "raw.orders"},
    }
    d.update(over)
    return d


def fields(raw: Any, env: dict[str, str] | None = None) -> list[str]:
    return [e.field for e in check_pipeline(raw, "p.yaml", ENV if env is None else env).errors]


def test_one_config_error_carries_every_error() -> None:
    raw = base(retries="x", source={"topics": ["ok", "bad topic"], "data_loss": "ignore"},
               sink={"table": "t", "mode": "upsret"}, spark={"launch": "yarn"})
    with pytest.raises(ConfigError) as ei:
        parse_pipeline(raw, "p.yaml", ENV)
    e = ei.value
    assert [x.field for x in e.errors] == ["source.topics[1]", "source.data_loss", "sink.mode",
                                           "spark.launch", "retries"]
    assert (e.source, e.field) == ("p.yaml", "source.topics[1]")  # the first's, for callers
    assert str(e).splitlines() == [f"p.yaml: {x.field}: {x.message}" for x in e.errors]


def test_a_single_error_reads_as_before() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_pipeline(base(sink={"table": "t", "mode": "upsert"}), "p.yaml", ENV)
    assert ei.value.errors == (ei.value,)
    assert str(ei.value) == "p.yaml: sink.key: upsert mode needs a key (one or more columns)"


@pytest.mark.parametrize(("raw", "expected"), [
    # a section that is not a mapping stops that section only
    (base(source=["orders"], spark={"launch": "x"}), ["source", "spark.launch"]),
    # a bad format type is not followed by "json format needs a schema"
    (base(format={"type": "thrift"}), ["format.type"]),
    # nor a broken schema by key columns "not in format.schema"
    (base(format={"type": "json", "schema": ["id"]},
          sink={"table": "t", "mode": "upsert", "key": ["id"]}), ["format.schema"]),
    # a bad sink type: its fields are not "unknown", the other sinks' checks do not run
    (base(sink={"type": "kafak", "topic": "out", "table": "t"}), ["sink.type"]),
    # a bad mode: no tombstone policy "of mode append"
    (base(sink={"table": "t", "mode": "upsret"}, tombstones="delete"), ["sink.mode"]),
    # an invalid conn_id is not also "bootstrap_servers must not be empty"
    (base(kafka={"conn_id": "bad id!"}), ["kafka.conn_id"]),
    # a wrong type reads on as the default
    (base(source={"topics": ["o"], "max_records_per_partition": "many"}, retries=-1),
     ["source.max_records_per_partition", "retries"]),
])
def test_errors_do_not_cascade(raw: dict[str, Any], expected: list[str]) -> None:
    assert fields(raw) == expected


def test_unknown_fields_and_values_suggest_the_likely_one() -> None:
    found = {e.field: e.message for e in check_pipeline(
        base(sink={"tabel": "t", "table": "t"}, kafka={"isolation_level": "read_comitted"}),
        "p.yaml", ENV).errors}
    assert found["sink.tabel"].startswith("unknown field; did you mean 'table'? (allowed: [")
    assert found["kafka.isolation_level"].endswith("did you mean 'read_committed'?")
    nothing_close = check_pipeline(base(zz_probe=1), "p.yaml", ENV).errors[0].message
    assert nothing_close.startswith("unknown field (allowed: [")


def test_an_unset_variable_is_an_error_to_run_and_a_warning_to_validate() -> None:
    raw = base(kafka={"bootstrap_servers": "${BROKERS}"}, sink={"table": "t"})
    assert fields(raw, {}) == ["kafka.bootstrap_servers", "sink.connection"]
    lenient = check_pipeline(raw, "p.yaml", {}, strict_env=False)
    assert lenient.errors == () and lenient.config is not None
    assert [w.field for w in lenient.warnings] == ["kafka.bootstrap_servers", "sink.connection"]
    assert "BROKERS is not set here" in lenient.warnings[0].message
    # an unset variable in a field with allowed values is not also "not one of"
    assert check_pipeline(base(spark={"launch": "${LAUNCH}"}), "p.yaml", ENV,
                          strict_env=False).errors == ()


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def test_load_pipeline_locates_each_error_in_the_file(tmp_path: Path) -> None:
    f = write(tmp_path, """\
kafka:
  bootstrap_servers: h:1
  client:
    sasl.password: ${NOPE}
source:
  topics:
    - ok
    - "not ok"
format: {type: json, schema: {id: strng}}
sink: {table: t, mode: upsert}
""")
    with pytest.raises(ConfigError) as ei:
        load_pipeline(f, ENV)
    where = [(e.field, e.line, e.column) for e in ei.value.errors]
    assert where == [("kafka.client.sasl.password", 4, 20), ("source.topics[1]", 8, 7),
                     ("format.schema.id", 9, 35), ("sink.key", 10, 1)]


def test_locations_follow_yaml_last_key_and_merges(tmp_path: Path) -> None:
    """A merged `<<:` key and the key written after it: the error is at the one YAML keeps."""
    f = write(tmp_path, """\
x-common: &common {table: t, mode: append}
kafka: {bootstrap_servers: "h:1"}
source: {topics: [o]}
format: {type: raw}
sink:
  <<: *common
  mode: upsret
""")
    assert [(e.field, e.line, e.column) for e in check_file(f, ENV).errors] == [
        ("x-common", 1, 1), ("sink.mode", 7, 9)]


def test_duplicate_keys_are_an_error_to_validate_only(tmp_path: Path) -> None:
    f = write(tmp_path, "kafka: {bootstrap_servers: 'h:1'}\nsource: {topics: [a]}\n"
                        "format: {type: raw}\nsink: {table: t}\nsink: {table: u}\n")
    assert load_pipeline(f, ENV).sink.table == "u"  # as YAML (and every release) reads it
    dup = check_file(f, ENV, duplicate_keys=True).errors
    assert [(e.field, e.line, e.column) for e in dup] == [("sink", 5, 1)]
    assert "also at line 4" in dup[0].message


@pytest.mark.parametrize(("text", "field", "line", "words"), [
    ("", "<root>", 1, "the file is empty"),
    ("# only a comment\n", "<root>", 1, "the file is empty"),
    ("- a\n- b\n", "<root>", 1, "got a list"),
    ("just text\n", "<root>", 1, "got a string"),
    ("a: [1,\nb: 2\n", "<yaml>", 3, "expected ',' or ']'"),
    ("a: 1\n---\nb: 2\n", "<yaml>", 2, "expected a single document"),
    ("a:\n\tb: 1\n", "<yaml>", 2, "not valid YAML"),
])
def test_files_that_are_not_a_mapping(tmp_path: Path, text: str, field: str, line: int,
                                      words: str) -> None:
    (e,) = check_file(write(tmp_path, text), ENV).errors
    assert (e.field, e.line) == (field, line) and words in e.message, e


def test_yaml_errors_still_name_the_file_as_before(tmp_path: Path) -> None:
    f = write(tmp_path, "source: [unclosed", "broken.yaml")
    with pytest.raises(ConfigError, match="broken.yaml: <yaml>: not valid YAML") as ei:
        load_pipeline(f, ENV)
    assert (ei.value.line, ei.value.column) == (1, 18)
