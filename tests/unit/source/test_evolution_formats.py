"""Schema evolution's rules for Protobuf and JSON Schema (`offsetflow.source.evolution`):
which columns the subject's latest schema adds, and which changes stop a batch."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from offsetflow.config import parse_pipeline
from offsetflow.source import evolved_columns, incompatibilities, schema_fields, unreadable

FD = descriptor_pb2.FieldDescriptorProto


def _proto(*fields: tuple[str, int, int, int]) -> str:
    """The registry's serialized form of a file whose root message Order has `fields`
    (name, number, type, label), after a message Address when a field uses it."""
    f = descriptor_pb2.FileDescriptorProto(name="o.proto", package="t", syntax="proto3")
    if any(t == FD.TYPE_MESSAGE for _, _, t, _ in fields):
        f.message_type.add(name="Address").field.add(name="city", number=1, type=9, label=1)
    order = f.message_type.add(name="Order")
    for name, number, type_, label in fields:
        extra = {"type_name": ".t.Address"} if type_ == FD.TYPE_MESSAGE else {}
        order.field.add(name=name, number=number, type=type_, label=label, **extra)
    return base64.b64encode(f.SerializeToString()).decode()


P1 = (("order_id", 1, FD.TYPE_INT64, 1), ("qty", 2, FD.TYPE_INT32, 1))


def test_protobuf_root_message_fields_become_columns() -> None:
    latest = _proto(*P1, ("coupon", 3, FD.TYPE_STRING, 1), ("tags", 4, FD.TYPE_STRING, 3),
                    ("address", 5, FD.TYPE_MESSAGE, 1), ("ok", 6, FD.TYPE_BOOL, 1),
                    ("score", 7, FD.TYPE_DOUBLE, 1))
    assert evolved_columns({"t": latest}, {"order_id": "long"}, {"topic"}, "PROTOBUF") == {
        "qty": "int", "coupon": "string", "tags": "json", "address": "json",
        "ok": "boolean", "score": "double"}  # Address is not the root: Order uses it


def test_protobuf_root_is_the_first_message_no_other_uses() -> None:
    f = descriptor_pb2.FileDescriptorProto(name="o.proto", package="t", syntax="proto3")
    f.message_type.add(name="A").field.add(name="a", number=1, type=9, label=1)
    f.message_type.add(name="B").field.add(name="b", number=1, type=9, label=1)
    text = base64.b64encode(f.SerializeToString()).decode()
    assert list(schema_fields(text, "PROTOBUF")) == ["a"]  # message index [0], the default


@pytest.mark.parametrize("new, why", [
    (_proto(*P1, ("coupon", 3, FD.TYPE_STRING, 1)), []),  # added: compatible
    (_proto(P1[0]), []),  # removed (proto3: not required): compatible
    (_proto(P1[0], ("qty", 2, FD.TYPE_INT64, 1)), []),  # int32 -> int64: wire-compatible
    (_proto(P1[0], ("qty", 2, FD.TYPE_STRING, 1)),
     ["field 'qty' changed from int32 to string (not a widening)"]),
    (_proto(P1[0], ("qty", 2, FD.TYPE_SINT32, 1)),
     ["field 'qty' changed from int32 to sint32 (not a widening)"]),
    (_proto(P1[0], ("qty", 9, FD.TYPE_INT32, 1)),
     ["field 'qty' changed its number from 2 to 9 (records of the older schema carry it "
      "under the old one)"]),
])
def test_protobuf_incompatibilities(new: str, why: list[str]) -> None:
    assert incompatibilities(_proto(*P1), new, "PROTOBUF") == why


def test_protobuf_required_fields_proto2() -> None:
    req = _proto(P1[0], ("qty", 2, FD.TYPE_INT32, FD.LABEL_REQUIRED))
    assert incompatibilities(req, _proto(P1[0]), "PROTOBUF") == ["required field 'qty' removed"]
    assert unreadable(_proto(P1[0]), req, "PROTOBUF") == [
        "field 'qty' added as required (records of the older schema have no value for it)"]


def test_protobuf_text_is_not_a_serialized_file() -> None:
    with pytest.raises(ValueError, match="not a serialized Protobuf file"):
        schema_fields('syntax = "proto3"; message A {}', "PROTOBUF")


def _js(props: dict[str, Any], required: tuple[str, ...] = ("order_id",)) -> str:
    return json.dumps({"type": "object", "properties": props, "required": list(required)})


J1 = {"order_id": {"type": "integer"}, "qty": {"type": "integer"}}


def test_json_schema_properties_become_columns() -> None:
    latest = _js({**J1, "coupon": {"type": ["null", "string"]}, "amount": {"type": "number"},
                  "at": {"type": "string", "format": "date-time"}, "day": {
                      "type": "string", "format": "date"}, "tags": {"type": "array"},
                  "ok": {"type": "boolean"}, "any": {}})
    assert evolved_columns({"t": latest}, {"order_id": "long"}, {"topic"}, "JSON") == {
        "qty": "long", "coupon": "string", "amount": "double", "at": "timestamp",
        "day": "date", "tags": "json", "ok": "boolean", "any": "json"}


@pytest.mark.parametrize("new, why", [
    (_js({**J1, "coupon": {"type": "string"}}), []),  # an optional property added
    (_js({**J1, "qty": {"type": "number"}}), []),  # integer -> number: a widening
    (_js({"order_id": J1["order_id"]}), []),  # an optional property removed
    (_js({**J1, "coupon": {"type": "string"}}, ("order_id", "coupon")),
     ["field 'coupon' added as required (records of the older schema have no value for "
      "it)"]),
    (_js({**J1, "qty": {"type": "string"}}),
     ["field 'qty' changed from integer to string (not a widening)"]),
    (_js({"qty": J1["qty"]}, ()), ["required field 'order_id' removed"]),
])
def test_json_schema_incompatibilities(new: str, why: list[str]) -> None:
    assert incompatibilities(_js(J1), new, "JSON") == why


def test_json_schema_null_no_longer_allowed() -> None:
    old = _js({**J1, "note": {"type": ["string", "null"]}})
    assert incompatibilities(old, _js({**J1, "note": {"type": "string"}}), "JSON") == [
        "field 'note' no longer allows null"]


@pytest.mark.parametrize("fmt", ["protobuf", "json_schema"])
def test_schema_evolution_config_accepts_protobuf_and_json_schema(fmt: str) -> None:
    cfg = parse_pipeline({
        "name": "p", "kafka": {}, "source": {"topics": ["t"]},
        "format": {"type": fmt, "schema": {"id": "long"}, "schema_evolution": "add_columns",
                   "schema_registry": {"url": "http://r:8081"}},
        "sink": {"table": "t"}}, "p.yaml", {"OFFSETFLOW_PG_DSN": "postgresql://x@y/z"})
    assert cfg.schema_evolution == "add_columns"



def test_protobuf_self_referencing_and_mutually_referencing_messages_have_a_root() -> None:
    f = descriptor_pb2.FileDescriptorProto(name="n.proto", package="t", syntax="proto3")
    node = f.message_type.add(name="Node")
    node.field.add(name="id", number=1, type=FD.TYPE_INT64, label=1)
    node.field.add(name="parent", number=2, type=FD.TYPE_MESSAGE, label=1, type_name=".t.Node")
    tree = base64.b64encode(f.SerializeToString()).decode()
    assert {n: x.column for n, x in schema_fields(tree, "PROTOBUF").items()} == {
        "id": "long", "parent": "json"}
    # A <-> B: the first message, as a record's default message index [0] names it
    g = descriptor_pb2.FileDescriptorProto(name="ab.proto", package="t", syntax="proto3")
    g.message_type.add(name="A").field.add(name="b", number=1, type=FD.TYPE_MESSAGE, label=1,
                                           type_name=".t.B")
    g.message_type.add(name="B").field.add(name="a", number=1, type=FD.TYPE_MESSAGE, label=1,
                                           type_name=".t.A")
    assert list(schema_fields(base64.b64encode(g.SerializeToString()).decode(),
                              "PROTOBUF")) == ["b"]


@pytest.mark.parametrize("root", [["object", "null"], ["null", "object"], ["object"]])
def test_json_schema_root_object_or_null_is_read(root: list[str]) -> None:
    text = json.dumps({"type": root, "properties": {"coupon": {"type": "string"}}})
    assert list(schema_fields(text, "JSON")) == ["coupon"]


@pytest.mark.parametrize("root", [["object", "string"], "array", ["null"]])
def test_json_schema_root_not_an_object_is_not_read(root: Any) -> None:
    with pytest.raises(ValueError, match="not an object"):
        schema_fields(json.dumps({"type": root, "properties": {}}), "JSON")


def test_protobuf_root_message_switched_is_incompatible() -> None:
    v1 = _proto(*P1)
    f = descriptor_pb2.FileDescriptorProto(name="o.proto", package="t", syntax="proto3")
    f.message_type.add(name="Note").field.add(name="text", number=1, type=9, label=1)
    order = f.message_type.add(name="Order")
    for name, number, type_, label in P1:
        order.field.add(name=name, number=number, type=type_, label=label)
    v2 = base64.b64encode(f.SerializeToString()).decode()
    assert "the root message changed from t.Order to t.Note" in \
        incompatibilities(v1, v2, "PROTOBUF")[0]
    assert incompatibilities(v1, v1, "PROTOBUF") == []
