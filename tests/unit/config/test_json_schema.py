"""The editors' JSON Schema (`offsetflow schema`, issue 29 item 5) does not drift from the
parser: it is a valid draft 2020-12 schema, every shipped pipeline and every yaml config
example of the docs validates against it, it has exactly the fields the parser accepts in
each section (per sink type) with the parser's allowed values, and it refuses the malformed
files `offsetflow validate` is tested with, but for the rules only the parser knows."""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from offsetflow.config import check_pipeline, pipeline_json_schema
from offsetflow.config.kafka_sink import KAFKA_REFUSED
from offsetflow.config.tables import FIELDS, SINK_TYPES

ROOT = Path(__file__).resolve().parents[3]
MALFORMED = ROOT / "tests" / "unit" / "cli" / "malformed"
SCHEMA = pipeline_json_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
ENV = {"OFFSETFLOW_PG_DSN": "postgresql://u@h/db"}
PROBE = "zz_probe"


def _docs_hook() -> Any:
    """docs/hooks/config_reference.py: how the docs build reads a yaml example."""
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "docs" / "hooks" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOOK = _docs_hook()


def as_json(doc: Any) -> Any:
    """What an editor validates: YAML's timestamps are strings and keys are strings."""
    return json.loads(json.dumps(doc, default=str))


def schema_errors(doc: Any) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:200]}"
            for e in VALIDATOR.iter_errors(as_json(doc))]


def test_the_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("path", sorted((ROOT / "include" / "pipelines").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_shipped_pipelines_validate(path: Path) -> None:
    assert schema_errors(yaml.safe_load(path.read_text())) == []


def docs_examples() -> Iterator[tuple[str, dict[str, Any]]]:
    """Every ```yaml block of the docs and README.md, as the docs build parses it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        for m in HOOK.YAML_BLOCK.finditer(text):
            doc = yaml.safe_load(m.group(1))
            if "name" not in doc and not {"source", "sink"} <= set(doc):
                doc = {**copy.deepcopy(HOOK.EXAMPLE_BASE), **doc}
            yield f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", doc


def test_every_docs_example_validates() -> None:
    examples = list(docs_examples())
    assert len(examples) >= 7
    bad = {where: errs for where, doc in examples if (errs := schema_errors(doc))}
    assert bad == {}


# --- the fields: what the parser accepts is what the schema has ---------------------------

def base(sink: str) -> dict[str, Any]:
    return copy.deepcopy(HOOK.BASES[(sink, "append")])


def parser_keys(section: str, sink: str) -> set[str]:
    """The keys the parser takes in `section`, read from its refusal of an unknown one."""
    raw = base(sink)
    node = raw
    for part in filter(None, section.split(".")):
        node = node.setdefault(part, {})
    node[PROBE] = 1
    errors = check_pipeline(raw, "p.yaml", ENV).errors
    (err,) = [e for e in errors if e.field.endswith(PROBE)]
    m = re.search(r"allowed: (\[.*?\])", err.message)
    assert m is not None, err.message
    keys = set(ast.literal_eval(m.group(1)))
    return keys - KAFKA_REFUSED if section == "sink" and sink == "kafka" else keys


def schema_keys(section: str, sink: str) -> set[str]:
    node = SCHEMA
    for part in filter(None, section.split(".")):
        node = node["properties"][part]
    keys = set(node["properties"])
    for rule in node.get("allOf", []):
        if "if" in rule and jsonschema.Draft202012Validator(rule["if"]).is_valid(
                {"type": sink}):
            keys -= {k for k, v in rule["then"].get("properties", {}).items() if v is False}
    return keys


SECTIONS = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in FIELDS})


@pytest.mark.parametrize("sink", SINK_TYPES)
@pytest.mark.parametrize("section", SECTIONS)
def test_the_schema_has_the_fields_the_parser_accepts(section: str, sink: str) -> None:
    if section in FIELDS and sink not in FIELDS[section].sinks:
        pytest.skip(f"{section} is not a section of sink.type {sink}")
    assert schema_keys(section, sink) == parser_keys(section, sink)


def enum_at(dotted: str) -> set[str]:
    node: Any = SCHEMA
    for part in dotted.split("."):
        node = node["properties"][part]
    stack, found = [node], set()
    while stack:
        n = stack.pop()
        found |= set(n.get("enum", ())) - {None}
        stack.extend(n.get("anyOf", []))
    return found


@pytest.mark.parametrize("name", [n for n, s in FIELDS.items() if s.choices
                                  and n != "tombstones"])  # per sink mode: its own message
def test_the_schema_has_the_allowed_values_the_parser_checks(name: str) -> None:
    sink = next(t for t in SINK_TYPES if t in FIELDS[name].sinks)
    raw = base(sink)
    *parents, last = name.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = PROBE
    errors = [e for e in check_pipeline(raw, "p.yaml", ENV).errors if e.field == name]
    m = re.search(r"one of (\[.*?\])", errors[0].message if errors else "")
    assert m is not None, (name, errors)
    assert enum_at(name) == set(ast.literal_eval(m.group(1)))


# --- the malformed files -----------------------------------------------------------------------

# rules only the parser knows: partition transforms and their columns, regular expressions and
# times, duplicate keys (gone once the YAML is read)
PARSER_ONLY = {"bad_partitions", "bad_starting", "duplicate_keys"}
NOT_YAML = {"invalid_syntax", "two_documents"}


@pytest.mark.parametrize("path", sorted(MALFORMED.glob("*.yaml")), ids=lambda p: p.stem)
def test_the_schema_refuses_the_malformed_files(path: Path) -> None:
    if path.stem in NOT_YAML:
        with pytest.raises(yaml.YAMLError):
            yaml.safe_load(path.read_text())
        return
    refused = bool(schema_errors(yaml.safe_load(path.read_text())))
    assert refused == (path.stem not in PARSER_ONLY)
