"""A pipeline file read as a YAML document whose nodes keep their marks, so an error's dotted
field (`sink.partition_by[1]`, `kafka.client.sasl.password`) is shown at its line and column,
and a key written twice (YAML keeps the last one silently) can be found. Pure: the text is
given.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from offsetflow.errors import ConfigError

_INDEX = re.compile(r"\[(\d+)\]\.?")


@dataclass(frozen=True)
class Document:
    data: Any  # what yaml.safe_load gives
    root: yaml.Node | None  # None: an empty file
    duplicates: tuple[ConfigError, ...]  # keys written twice (see `duplicate_keys`)


def compose(text: str, source: str) -> Document:
    """The document's data, its node tree and its duplicate keys; a YAML syntax error is a
    ConfigError at field `<yaml>` with the line and column of the problem."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        # before constructing: that merges `<<:` keys into the mappings' nodes
        duplicates = tuple(duplicate_keys(root, source))
        return Document(loader.construct_document(root) if root is not None else None, root,
                        duplicates)
    except yaml.YAMLError as e:
        raise yaml_error(e, source) from e
    finally:
        loader.dispose()


def yaml_error(e: yaml.YAMLError, source: str) -> ConfigError:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        msg = str(e.problem)
        if e.context:
            ctx = e.context_mark
            at = f" at line {ctx.line + 1}, column {ctx.column + 1}" if ctx is not None else ""
            msg += f" ({e.context}{at})"
    else:
        msg = str(e)
    err = ConfigError(source, "<yaml>", f"not valid YAML: {msg}")
    if mark is not None:
        err.line, err.column = mark.line + 1, mark.column + 1
    return err


def _walk(node: yaml.Node, field: str) -> tuple[yaml.Node | None, yaml.Node, bool]:
    """(the key node of the deepest entry reached, its value node, whether `field` was
    reached to its end). Keys may hold dots (`kafka.client.sasl.password`): the longest key
    that prefixes the rest wins, and of equal keys the last (the one YAML keeps)."""
    key: yaml.Node | None = None
    rest = field
    while rest:
        if isinstance(node, yaml.SequenceNode):
            m = _INDEX.match(rest)
            if m is None or int(m.group(1)) >= len(node.value):
                return key, node, False
            key, node, rest = None, node.value[int(m.group(1))], rest[m.end():]
            continue
        if not isinstance(node, yaml.MappingNode):
            return key, node, False
        best: tuple[yaml.Node, yaml.Node] | None = None
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            if name is not None and (rest == name or rest.startswith((name + ".", name + "[")))\
                    and (best is None or len(name) >= len(best[0].value)):
                best = (k, v)
        if best is None:
            return key, node, False
        key, node = best
        rest = rest[len(key.value):]
        rest = rest[1:] if rest.startswith(".") else rest
    return key, node, True


def locate(error: ConfigError, root: yaml.Node | None) -> None:
    """Set `error.line`/`error.column` (1-based) to where its field is in the document: the
    value of a scalar, the key of a section or of an unknown field, and for a field that is
    missing the section it belongs in."""
    if error.line is not None or error.field in ("<file>", "<yaml>"):
        return
    if root is None or error.field == "<root>":
        error.line, error.column = (1, 1) if root is None else (
            root.start_mark.line + 1, root.start_mark.column + 1)
        return
    key, value, reached = _walk(root, error.field)
    at = value
    if key is not None and (not reached or error.at_key
                            or not isinstance(value, yaml.ScalarNode)):
        at = key
    error.line, error.column = at.start_mark.line + 1, at.start_mark.column + 1


def duplicate_keys(root: yaml.Node | None, source: str) -> Iterator[ConfigError]:
    """A key written twice in one mapping: YAML keeps the last silently, so the first (a whole
    section, perhaps) is ignored. Run it before the document is constructed (merges)."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            seen: dict[str, yaml.Node] = {}
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else None
                here = f"{path}.{name}" if path else str(name)
                if name is not None and name in seen:
                    first = seen[name].start_mark
                    err = ConfigError(source, here, f"duplicate key (also at line "
                                                    f"{first.line + 1}); YAML keeps only this "
                                                    f"last one", at_key=True)
                    err.line, err.column = k.start_mark.line + 1, k.start_mark.column + 1
                    yield err
                if name is not None:
                    seen[name] = k
                stack.append((v, here))
