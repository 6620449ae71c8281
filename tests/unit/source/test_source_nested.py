"""Avro reader schemas -> the Arrow form of their nested (`json`) fields."""

from __future__ import annotations

import json

import pyarrow as pa

from offsetflow.source import avro_nested_types, common_nested_types

ADDRESS = {"type": "record", "name": "Address", "fields": [
    {"name": "street", "type": "string"},
    {"name": "zip", "type": ["null", "int"], "default": None},
]}
SCHEMA = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "long"},
    {"name": "address", "type": ADDRESS},
    {"name": "billing", "type": ["null", "Address"], "default": None},
    {"name": "lines", "type": {"type": "array", "items": {
        "type": "record", "name": "Line", "fields": [
            {"name": "sku", "type": {"type": "enum", "name": "Sku", "symbols": ["A", "B"]}},
            {"name": "price", "type": {"type": "bytes", "logicalType": "decimal",
                                       "precision": 9, "scale": 2}},
            {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
            {"name": "day", "type": {"type": "int", "logicalType": "date"}},
            {"name": "ref", "type": {"type": "string", "logicalType": "uuid"}},
        ]}}},
    {"name": "tags", "type": {"type": "map", "values": ["null", "double"]}},
    {"name": "either", "type": ["int", "string"]},
    {"name": "tree", "type": {"type": "record", "name": "Node", "fields": [
        {"name": "kids", "type": {"type": "array", "items": "Node"}}]}},
]}
COLUMNS = {"id": "long", "address": "json", "billing": "json", "lines": "json",
           "tags": "json", "either": "json", "tree": "json"}


def test_records_arrays_maps_and_logical_types_inside() -> None:
    got = avro_nested_types(json.dumps(SCHEMA), COLUMNS)
    assert got["address"] == pa.struct([pa.field("street", pa.string(), nullable=False),
                                        pa.field("zip", pa.int32())])
    assert got["billing"] == got["address"]  # a named type used again
    line = pa.struct([pa.field("sku", pa.string(), nullable=False),
                      pa.field("price", pa.decimal128(9, 2), nullable=False),
                      pa.field("at", pa.timestamp("us", tz="UTC"), nullable=False),
                      pa.field("day", pa.date32(), nullable=False),
                      pa.field("ref", pa.string(), nullable=False)])
    assert got["lines"] == pa.list_(pa.field("element", line, nullable=False))
    assert got["tags"] == pa.map_(pa.string(), pa.field("value", pa.float64()))


def test_what_has_no_typed_form_stays_json_text() -> None:
    got = avro_nested_types(json.dumps(SCHEMA), COLUMNS)
    assert "either" not in got  # a union of two types
    assert "tree" not in got  # a recursive record
    assert "id" not in got  # not declared json


def test_topics_that_disagree_keep_json_text() -> None:
    a = {"t1": {"x": pa.struct([pa.field("a", pa.int32())])},
         "t2": {"x": pa.struct([pa.field("a", pa.int64())])}}
    assert common_nested_types(a) == {}
    a["t2"] = dict(a["t1"])
    assert common_nested_types(a) == a["t1"]


def test_topics_one_of_which_adds_a_field_inside_get_the_union() -> None:
    """A topic whose producers moved to a version adding a field inside a record first:
    the run's type has it (optional), so the table is checked and evolved against it; a
    field only one side has, or optional on one, is optional; anything else disagreeing
    (a scalar type, two names differing in case) keeps JSON text."""
    v1 = pa.struct([pa.field("street", pa.string(), nullable=False),
                    pa.field("zip", pa.int32())])
    v2 = pa.struct([*v1, pa.field("country", pa.string(), nullable=False)])
    union = pa.struct([*v1, pa.field("country", pa.string())])
    for one, two in ((v1, v2), (v2, v1)):
        assert common_nested_types({"a": {"x": one}, "b": {"x": two}}) == {"x": union}
        lists = {t: {"x": pa.list_(pa.field("element", s, nullable=False))}
                 for t, s in (("a", one), ("b", two))}
        assert common_nested_types(lists) == {
            "x": pa.list_(pa.field("element", union, nullable=False))}
        maps = {t: {"x": pa.map_(pa.string(), pa.field("value", s))}
                for t, s in (("a", one), ("b", two))}
        assert common_nested_types(maps) == {"x": pa.map_(pa.string(),
                                                          pa.field("value", union))}
    cased = pa.struct([*v1, pa.field("Zip", pa.int32())])
    assert common_nested_types({"a": {"x": v1}, "b": {"x": cased}}) == {}
    assert common_nested_types({"a": {"x": v1}, "b": {"x": pa.list_(v1)}}) == {}
    assert common_nested_types({"a": {"x": v1}, "b": {}}) == {}  # b: no nested form
