"""Pure parts of the commit protocol: tombstone policy config, guard index names."""

from __future__ import annotations

from typing import Any

import pytest

from offsetflow.commit.tables import canonical_table, index_name
from offsetflow.config import parse_pipeline
from offsetflow.errors import ConfigError

ENV = {"OFFSETFLOW_PG_DSN": "postgresql://u:secret@h:1/db"}


def raw(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "kafka": {"bootstrap_servers": "127.0.0.1:19092"}, "source": {"topics": ["orders"]},
        "format": {"type": "json", "schema": {"id": "string", "amount": "double"}},
        "sink": {"table": "raw.orders"}}
    d.update(over)
    return d


def test_tombstone_policy_defaults_by_mode() -> None:
    assert parse_pipeline(raw(), "o.yaml", ENV).tombstone_policy == "dead_letter"
    up = parse_pipeline(raw(sink={"table": "t", "mode": "upsert", "key": ["id"]}), "o.yaml",
                        ENV)
    assert up.tombstone_policy == "delete"
    assert parse_pipeline(raw(tombstones="null_row"), "o.yaml", ENV).tombstone_policy == \
        "null_row"


def test_raw_append_keeps_writing_tombstones_as_rows_by_default() -> None:
    """main wrote a raw record with a null value as a row with value NULL: the default stays
    so for raw append; JSON append (where main made it a bad record) routes it."""
    raw_fmt = raw(format={"type": "raw"})
    assert parse_pipeline(raw_fmt, "o.yaml", ENV).tombstone_policy == "null_row"
    assert parse_pipeline({**raw_fmt, "tombstones": "dead_letter"}, "o.yaml",
                          ENV).tombstone_policy == "dead_letter"
    plain = parse_pipeline(raw_fmt, "o.yaml", ENV)
    explicit = parse_pipeline({**raw_fmt, "tombstones": "null_row"}, "o.yaml", ENV)
    assert plain.fingerprint() == explicit.fingerprint()


@pytest.mark.parametrize("mode, bad", [("append", "delete"), ("upsert", "null_row"),
                                       ("append", "drop")])
def test_tombstone_policy_must_fit_the_mode(mode: str, bad: str) -> None:
    sink = {"table": "t", "mode": mode, **({"key": ["id"]} if mode == "upsert" else {})}
    with pytest.raises(ConfigError, match=rf"o.yaml: tombstones: '{bad}' is not a tombstone "
                                          rf"policy of sink.mode {mode}"):
        parse_pipeline(raw(sink=sink, tombstones=bad), "o.yaml", ENV)


def test_tombstone_policy_changes_the_fingerprint_only_when_not_the_default() -> None:
    plain = parse_pipeline(raw(), "o.yaml", ENV)
    explicit = parse_pipeline(raw(tombstones="dead_letter"), "o.yaml", ENV)
    other = parse_pipeline(raw(tombstones="null_row"), "o.yaml", ENV)
    assert plain.fingerprint() == explicit.fingerprint() != other.fingerprint()


def test_index_names_are_unique_and_fit_63_bytes() -> None:
    assert index_name("orders", "coords_uq") == "orders_coords_uq"  # short: unchanged
    stem = "t" + "x" * 54
    names = {index_name(t, "coords_uq") for t in (stem, stem + "_coords_", f"a.{stem}",
                                                  stem + "y" * 8, "é" * 40)}
    assert len(names) == 5
    assert all(len(n.encode()) <= 63 and n.endswith("_coords_uq") for n in names)


def test_canonical_table_names_one_table_one_way() -> None:
    assert canonical_table("orders") == canonical_table("public.orders") == "public.orders"
    assert canonical_table("raw.orders") == "raw.orders"
