"""Protobuf and JSON Schema reader schemas -> the Arrow form of their nested (`json`)
fields; and each format's staged JSON text parsed into that form (the Iceberg sink's
shared parse), value by value, with what does not fit refused by path."""

from __future__ import annotations

import base64
import json
from datetime import UTC, date, datetime
from typing import Any

import pyarrow as pa
from google.protobuf import descriptor_pb2, descriptor_pool, timestamp_pb2, wrappers_pb2
from google.protobuf.message_factory import GetMessageClass

from offsetflow.sinks.iceberg.nested import nested_column_types, nested_from_json
from offsetflow.source import nested_types
from offsetflow.source.protobuf import proto_value

FD = descriptor_pb2.FieldDescriptorProto
TS = pa.timestamp("us", tz="UTC")


def _proto_file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name="nested_formats_test.proto", package="shop",
                                           syntax="proto3")
    f.dependency.extend(["google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto"])
    line = f.message_type.add(name="Line")
    line.field.add(name="sku", number=1, type=FD.TYPE_ENUM, label=FD.LABEL_OPTIONAL,
                   type_name=".shop.Line.Sku")
    line.field.add(name="qty", number=2, type=FD.TYPE_UINT64, label=FD.LABEL_OPTIONAL)
    line.field.add(name="price", number=3, type=FD.TYPE_FLOAT, label=FD.LABEL_OPTIONAL)
    line.field.add(name="at", number=4, type=FD.TYPE_MESSAGE, label=FD.LABEL_OPTIONAL,
                   type_name=".google.protobuf.Timestamp")
    line.field.add(name="blob", number=5, type=FD.TYPE_BYTES, label=FD.LABEL_OPTIONAL)
    sku = line.enum_type.add(name="Sku")
    for i, n in enumerate(("A", "B")):
        sku.value.add(name=n, number=i)
    node = f.message_type.add(name="Node")
    node.field.add(name="kids", number=1, type=FD.TYPE_MESSAGE, label=FD.LABEL_REPEATED,
                   type_name=".shop.Node")
    order = f.message_type.add(name="Order")
    add = order.field.add
    add(name="id", number=1, type=FD.TYPE_INT64, label=FD.LABEL_OPTIONAL)
    add(name="lines", number=2, type=FD.TYPE_MESSAGE, label=FD.LABEL_REPEATED,
        type_name=".shop.Line")
    add(name="tags", number=3, type=FD.TYPE_MESSAGE, label=FD.LABEL_REPEATED,
        type_name=".shop.Order.TagsEntry")
    add(name="nums", number=4, type=FD.TYPE_SINT32, label=FD.LABEL_REPEATED)
    add(name="first", number=5, type=FD.TYPE_MESSAGE, label=FD.LABEL_OPTIONAL,
        type_name=".shop.Line")
    add(name="tree", number=6, type=FD.TYPE_MESSAGE, label=FD.LABEL_OPTIONAL,
        type_name=".shop.Node")
    add(name="note", number=7, type=FD.TYPE_MESSAGE, label=FD.LABEL_OPTIONAL,
        type_name=".google.protobuf.Int64Value")
    add(name="by_id", number=8, type=FD.TYPE_MESSAGE, label=FD.LABEL_REPEATED,
        type_name=".shop.Order.ByIdEntry")
    for entry, key, value, tname in (("TagsEntry", FD.TYPE_STRING, FD.TYPE_DOUBLE, ""),
                                     ("ByIdEntry", FD.TYPE_INT64, FD.TYPE_MESSAGE,
                                      ".shop.Line")):
        e = order.nested_type.add(name=entry)
        e.options.map_entry = True
        e.field.add(name="key", number=1, type=key, label=FD.LABEL_OPTIONAL)
        v = e.field.add(name="value", number=2, type=value, label=FD.LABEL_OPTIONAL)
        if tname:
            v.type_name = tname
    return f


PROTO_COLUMNS = {"id": "long", "lines": "json", "tags": "json", "nums": "json",
                 "first": "json", "tree": "json", "note": "json", "by_id": "json"}
LINE = pa.struct([pa.field("sku", pa.string()), pa.field("qty", pa.int64()),
                  pa.field("price", pa.float32()), pa.field("at", TS),
                  pa.field("blob", pa.binary())])


def _serialized(f: descriptor_pb2.FileDescriptorProto) -> str:
    return base64.b64encode(f.SerializeToString()).decode()


def test_protobuf_messages_repeated_and_maps_inside() -> None:
    got = nested_types("protobuf", _serialized(_proto_file()), PROTO_COLUMNS)
    assert got["first"] == LINE  # every field optional: an older writer may lack it
    assert got["lines"] == pa.list_(pa.field("element", LINE, nullable=False))
    assert got["tags"] == pa.map_(pa.string(), pa.field("value", pa.float64(),
                                                        nullable=False))
    assert got["nums"] == pa.list_(pa.field("element", pa.int32(), nullable=False))
    assert got["by_id"] == pa.map_(pa.int64(), pa.field("value", LINE, nullable=False))
    assert "tree" not in got  # a recursive message: JSON text
    assert "note" not in got  # a wrapper is a scalar, not nested: the column stays text
    assert "id" not in got


def _classes() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    for mod in (timestamp_pb2, wrappers_pb2):
        p = descriptor_pb2.FileDescriptorProto()
        mod.DESCRIPTOR.CopyToProto(p)
        pool.Add(p)
    fd = pool.Add(_proto_file())
    return {n: GetMessageClass(d) for n, d in fd.message_types_by_name.items()}


def test_protobuf_values_as_staged_parse_into_their_types_value_by_value() -> None:
    """The staged text is Protobuf's JSON mapping (64-bit integers and integer map keys as
    strings, enums as names, NaN as "NaN"): each value reads back as it was produced."""
    order_cls = _classes()["Order"]
    m = order_cls(id=1, nums=[-1, 0, 7])
    ln = m.lines.add(sku=1, qty=2**63 - 1, price=float("nan"), blob=b"\x00\xff")
    ln.at.FromDatetime(datetime(2026, 11, 27, 6, 30, 1, 5, tzinfo=UTC))
    m.lines.add()  # every field at its default
    m.tags["w"] = 0.25
    m.by_id[-5].qty = 3
    types = nested_types("protobuf", _serialized(_proto_file()), PROTO_COLUMNS)
    got = {c: nested_from_json(pa.array([proto_value(m, c, "json")]), t, c, True)
           for c, t in types.items()}
    assert all(refused == {} for _, refused in got.values()), got
    lines = got["lines"][0].to_pylist()[0]
    assert lines[0]["sku"] == "B" and lines[0]["qty"] == 2**63 - 1
    assert lines[0]["price"] != lines[0]["price"]  # NaN
    assert lines[0]["at"] == datetime(2026, 11, 27, 6, 30, 1, 5, tzinfo=UTC)
    assert lines[0]["blob"] == b"\x00\xff"
    assert lines[1] == {"sku": "A", "qty": 0, "price": 0.0, "at": None, "blob": b""}
    assert got["tags"][0].to_pylist() == [[("w", 0.25)]]
    assert got["nums"][0].to_pylist() == [[-1, 0, 7]]
    assert got["by_id"][0].to_pylist()[0][0][0] == -5
    assert got["first"][0].to_pylist() == [None]  # an unset message


def test_a_protobuf_value_that_does_not_fit_is_refused_with_its_path() -> None:
    m = _classes()["Order"](id=1)
    m.lines.add(qty=2**64 - 1)  # uint64 beyond the int64 Iceberg has
    t = nested_types("protobuf", _serialized(_proto_file()), PROTO_COLUMNS)["lines"]
    arr, refused = nested_from_json(pa.array([proto_value(m, "lines", "json")]), t, "lines",
                                    True)
    assert arr.to_pylist() == [None]
    assert "lines[0].qty: 18446744073709551615 does not fit in int64" in refused[0]


JS = {"type": "object", "definitions": {
    "Address": {"type": "object", "properties": {
        "street": {"type": "string"}, "zip": {"type": ["integer", "null"]}},
        "required": ["street", "zip"]}},
    "properties": {
        "id": {"type": "integer"},
        "address": {"$ref": "#/definitions/Address"},
        "billing": {"oneOf": [{"type": "null"}, {"$ref": "#/definitions/Address"}]},
        "lines": {"type": "array", "items": {"type": "object", "properties": {
            "qty": {"type": "integer"}, "price": {"type": "number"},
            "at": {"type": "string", "format": "date-time"},
            "day": {"type": "string", "format": "date"}, "ok": {"type": "boolean"}},
            "required": ["qty"]}},
        "tags": {"type": "object", "additionalProperties": {"type": "number"}},
        "either": {"type": ["integer", "string"]},
        "loose": {"type": "object"},
        "tree": {"$ref": "#"},
        "any_of": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    }}
JS_COLUMNS = {"id": "long", **{c: "json" for c in (
    "address", "billing", "lines", "tags", "either", "loose", "tree", "any_of")}}
ADDRESS = pa.struct([pa.field("street", pa.string(), nullable=False),
                     pa.field("zip", pa.int64())])


def test_json_schema_objects_arrays_and_maps_inside() -> None:
    got = nested_types("json_schema", json.dumps(JS), JS_COLUMNS)
    assert got["address"] == ADDRESS
    assert got["billing"] == ADDRESS
    line = pa.struct([pa.field("qty", pa.int64(), nullable=False),
                      pa.field("price", pa.float64()), pa.field("at", TS),
                      pa.field("day", pa.date32()), pa.field("ok", pa.bool_())])
    assert got["lines"] == pa.list_(pa.field("element", line, nullable=False))
    assert got["tags"] == pa.map_(pa.string(), pa.field("value", pa.float64(),
                                                        nullable=False))
    # several types, an object without properties, a $ref cycle, anyOf of two types
    assert set(got) == {"address", "billing", "lines", "tags"}


def test_json_schema_values_parse_and_misfits_are_refused_by_path() -> None:
    got = nested_types("json_schema", json.dumps(JS), JS_COLUMNS)
    texts = ['[{"qty":1,"price":2,"at":"2026-11-27T07:00:00.5+01:00","day":"2026-11-27",'
             '"ok":true},{"qty":2,"price":0.1}]',
             '[{"qty":9223372036854775808}]',  # out of int64
             '[{"price":1.5}]',  # a required property missing
             '[{"qty":1,"colour":"red"}]']  # a property the schema does not have
    arr, refused = nested_from_json(pa.array(texts), got["lines"], "lines")
    assert arr.to_pylist()[0] == [
        {"qty": 1, "price": 2.0, "at": datetime(2026, 11, 27, 6, 0, 0, 500000, tzinfo=UTC),
         "day": date(2026, 11, 27), "ok": True},
        {"qty": 2, "price": 0.1, "at": None, "day": None, "ok": None}]
    assert "lines[0].qty: 9223372036854775808 does not fit in int64" in refused[1]
    assert "lines[0].qty is null, but the Iceberg table's field is required" in refused[2]
    assert "lines[0]: field(s) ['colour'] are not in the Iceberg table's struct" in \
        refused[3]
    assert sorted(refused) == [1, 2, 3]


def test_the_sink_takes_each_formats_reader_schemas() -> None:
    columns = [("id", "bigint"), ("address", "jsonb"), ("either", "jsonb")]
    readers: dict[str, tuple[int, str] | None] = {"a": (1, json.dumps(JS)),
                                                  "b": (2, json.dumps(JS))}
    assert nested_column_types("json_schema", columns, readers) == {"address": ADDRESS}
    assert nested_column_types("json_schema", columns, {**readers, "c": None}) == {}
    assert nested_column_types("json", columns, readers) == {}
