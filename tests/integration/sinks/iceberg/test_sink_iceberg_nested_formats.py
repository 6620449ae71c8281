"""Nested Protobuf and JSON Schema values as Iceberg struct / list / map columns
(`sink_iceberg_nested`, beyond Avro), on real Kafka, Spark, PostgreSQL (ledger and SQL
catalog) and the stack's registry, records produced by confluent-kafka's
`ProtobufSerializer` and `JSONSerializer`.

One topic and one Iceberg append pipeline per format (a module fixture, one batch each):
  - the new table's columns are struct / list / map, the types inside as at top level
    (Protobuf: a message, `repeated`, `map<k, v>`, an enum, uint64, a Timestamp, bytes;
    JSON Schema: an object with `required`, an array of objects, an object of numbers
    (`additionalProperties`), date-time, date);
  - every value read back with pyiceberg equals what was produced;
  - a value that does not fit (a uint64 beyond int64 inside a list's message; an integer
    beyond int64, a required property missing) is a dead letter alone, with coordinates
    and the path inside the value;
then each subject gains a field inside the nested message / object:
  - without format.schema_evolution the batch is refused by name before the tasks write,
    positions unmoved;
  - under `add_columns` (a pipeline of its own) the field joins the struct in the batch's
    own catalog commit; the older rows read null there.
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from offsetflow.config import SUMMARY_BATCH
from offsetflow.errors import SchemaMismatchError
from offsetflow.job import run_batch
from offsetflow.ledger import Ledger
from tests.tooling import chaos
from tests.tooling.iceberg_rows import iceberg_table, snapshot_batches
from tests.tooling.nested_case import iceberg_pipeline
from tests.tooling.registry_case import (
    dynamic_message_classes,
    encode,
    json_serializer,
    new_topic,
    plan_batch,
    produce,
    protobuf_serializer,
    registry_url,
)

FD = descriptor_pb2.FieldDescriptorProto
T0 = datetime(2026, 11, 27, 6, 30, 0, 123000, tzinfo=UTC)
BIG = 2**64 - 1  # a uint64 beyond the int64 Iceberg has


# --- Protobuf ------------------------------------------------------------------------------

def _pb_file(country: bool = False) -> Any:
    f = descriptor_pb2.FileDescriptorProto(name=f"offsetflow_icenestpb{int(country)}.proto",
                                           package="offsetflow.icenestpb", syntax="proto3")
    f.dependency.append("google/protobuf/timestamp.proto")
    line = f.message_type.add(name="Line")
    line.field.add(name="sku", number=1, type=FD.TYPE_ENUM, label=FD.LABEL_OPTIONAL,
                   type_name=".offsetflow.icenestpb.Line.Sku")
    line.field.add(name="qty", number=2, type=FD.TYPE_UINT64, label=FD.LABEL_OPTIONAL)
    line.field.add(name="price", number=3, type=FD.TYPE_DOUBLE, label=FD.LABEL_OPTIONAL)
    line.field.add(name="at", number=4, type=FD.TYPE_MESSAGE, label=FD.LABEL_OPTIONAL,
                   type_name=".google.protobuf.Timestamp")
    line.field.add(name="blob", number=5, type=FD.TYPE_BYTES, label=FD.LABEL_OPTIONAL)
    sku = line.enum_type.add(name="Sku")
    for i, n in enumerate(("A", "B")):
        sku.value.add(name=n, number=i)
    addr = f.message_type.add(name="Address")
    addr.field.add(name="city", number=1, type=FD.TYPE_STRING, label=FD.LABEL_OPTIONAL)
    addr.field.add(name="zip", number=2, type=FD.TYPE_INT32, label=FD.LABEL_OPTIONAL)
    if country:
        addr.field.add(name="country", number=3, type=FD.TYPE_STRING,
                       label=FD.LABEL_OPTIONAL)
    order = f.message_type.add(name="Order")
    order.field.add(name="order_id", number=1, type=FD.TYPE_INT64, label=FD.LABEL_OPTIONAL)
    order.field.add(name="address", number=2, type=FD.TYPE_MESSAGE, label=FD.LABEL_OPTIONAL,
                    type_name=".offsetflow.icenestpb.Address")
    order.field.add(name="lines", number=3, type=FD.TYPE_MESSAGE, label=FD.LABEL_REPEATED,
                    type_name=".offsetflow.icenestpb.Line")
    order.field.add(name="counts", number=4, type=FD.TYPE_MESSAGE, label=FD.LABEL_REPEATED,
                    type_name=".offsetflow.icenestpb.Order.CountsEntry")
    order.field.add(name="tags", number=5, type=FD.TYPE_STRING, label=FD.LABEL_REPEATED)
    entry = order.nested_type.add(name="CountsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=FD.TYPE_STRING, label=FD.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=FD.TYPE_INT64, label=FD.LABEL_OPTIONAL)
    return f


def _pb_order(cls: Any, i: int, qty: int | None = None, country: str | None = None) -> Any:
    m = cls(order_id=i, tags=[f"t{i}", "x"][: i % 3])
    if i % 2:
        m.address.city = f"city{i}"
        m.address.zip = 1000 + i
        if country is not None:
            m.address.country = country
    for j in range(i % 3):
        ln = m.lines.add(sku=j % 2, qty=qty if qty is not None else 2**40 + i * 10 + j,
                         price=i + j / 4, blob=bytes([i, j, 255]))
        ln.at.FromDatetime(T0.replace(second=j, microsecond=i))
    if i % 2:
        m.counts["a"] = -(2**40) - i
        m.counts["b"] = i
    return m


def _pb_as_read(i: int, country: Any = ...) -> dict[str, Any]:
    """`_pb_order(i)` as pyiceberg reads it back: proto3 defaults for unset scalars, an
    unset message null, enums by name, a map as pairs."""
    address: dict[str, Any] | None = None
    if i % 2:
        address = {"city": f"city{i}", "zip": 1000 + i}
        if country is not ...:
            address["country"] = country
    return {"address": address,
            "lines": [{"sku": "AB"[j % 2], "qty": 2**40 + i * 10 + j, "price": i + j / 4,
                       "at": T0.replace(second=j, microsecond=i),
                       "blob": bytes([i, j, 255])} for j in range(i % 3)],
            "counts": sorted({"a": -(2**40) - i, "b": i}.items()) if i % 2 else [],
            "tags": [f"t{i}", "x"][: i % 3]}


# --- JSON Schema ---------------------------------------------------------------------------

def _js_schema(country: bool = False) -> dict[str, Any]:
    address: dict[str, Any] = {"type": "object", "properties": {
        "street": {"type": "string"}, "zip": {"type": ["integer", "null"]}},
        "required": ["street"]}
    if country:
        address["properties"]["country"] = {"type": "string"}
    return {
        "$schema": "http://json-schema.org/draft-07/schema#", "title": "IceNestJs",
        "type": "object", "properties": {
            "order_id": {"type": "integer"},
            "address": address,
            "lines": {"type": "array", "items": {"type": "object", "properties": {
                "qty": {"type": "integer"}, "price": {"type": "number"},
                "at": {"type": "string", "format": "date-time"},
                "day": {"type": "string", "format": "date"},
                "ok": {"type": "boolean"}}, "required": ["qty"]}},
            "tags": {"type": "object", "additionalProperties": {"type": "number"}}},
        "required": ["order_id"]}


def _js_order(i: int, qty: int | None = None, country: str | None = None) -> dict[str, Any]:
    address: dict[str, Any] = {"street": f"street {i}", "zip": None if i % 2 else 1000 + i}
    if country is not None:
        address["country"] = country
    return {"order_id": i, "address": address,
            "lines": [{"qty": qty if qty is not None else 2**40 + i * 10 + j,
                       "price": i + j / 4, "at": T0.replace(second=j).isoformat(),
                       "day": date(2026, 1, 1 + j).isoformat(), "ok": bool(j)}
                      for j in range(i % 3)],
            "tags": {"w": i / 4, "n": i} if i % 2 else {}}


def _js_as_read(i: int, country: Any = ...) -> dict[str, Any]:
    o = _js_order(i)
    address = dict(o["address"])
    if country is not ...:
        address["country"] = country
    return {"address": address,
            "lines": [{**ln, "at": datetime.fromisoformat(ln["at"]),
                       "day": date.fromisoformat(ln["day"]), "price": float(ln["price"])}
                      for ln in o["lines"]],
            "tags": sorted((k, float(v)) for k, v in o["tags"].items())}


def _js_raw(sid: int, doc: dict[str, Any]) -> bytes:
    """A JSON Schema record as a producer that does not validate writes it."""
    return b"\x00" + sid.to_bytes(4, "big") + json.dumps(doc).encode()


# --- the pipelines -------------------------------------------------------------------------

PB_COLUMNS = {"order_id": "long", "address": "json", "lines": "json", "counts": "json",
              "tags": "json"}
JS_COLUMNS = {"order_id": "long", "address": "json", "lines": "json", "tags": "json"}


def _pipeline(tmp: Any, pg_dsn: str, bootstrap: str, topic: str, prefix: str, fmt: str,
              columns: dict[str, str], **extra: Any) -> Any:
    return iceberg_pipeline(tmp, pg_dsn, bootstrap, topic, columns, prefix=prefix, fmt=fmt,
                            format=extra)


def _pb_values(topic: str, n: int, country: bool = False) -> list[bytes]:
    order = dynamic_message_classes(_pb_file(country))["Order"]
    ser = protobuf_serializer(registry_url(), order)
    return [encode(ser, topic, _pb_order(order, i, country="BE" if country else None))
            for i in range(n)]


@pytest.fixture(scope="module")
def nested(spark: Any, pg_dsn: str, kafka_bootstrap: str, tmp_path_factory: Any
           ) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("iceberg_nested_formats")
    # Protobuf: offsets 0-5, the record at offset 3 a uint64 beyond int64 inside `lines`
    pb_topic = new_topic(kafka_bootstrap, "icenestpb", 1)
    order = dynamic_message_classes(_pb_file())["Order"]
    ser = protobuf_serializer(registry_url(), order)
    pb = [encode(ser, pb_topic, _pb_order(order, i)) for i in range(5)]
    pb.insert(3, encode(ser, pb_topic, _pb_order(order, 98, qty=BIG)))
    produce(kafka_bootstrap, pb_topic, list(pb))
    # JSON Schema: offsets 0-6, at 3 an integer beyond int64 inside `lines` (valid JSON
    # Schema: integers are unbounded), at 5 `address.street` (required) missing
    js_topic = new_topic(kafka_bootstrap, "icenestjs", 1)
    jser = json_serializer(registry_url(), _js_schema())
    js: list[bytes] = [encode(jser, js_topic, _js_order(i)) for i in range(5)]
    sid = int.from_bytes(js[0][1:5], "big")
    js.insert(3, encode(jser, js_topic, _js_order(97, qty=2**63)))
    js.insert(5, _js_raw(sid, {**_js_order(96), "address": {"zip": 1}}))
    produce(kafka_bootstrap, js_topic, list(js))
    out: dict[str, Any] = {"tmp": tmp}
    for fmt, topic, columns in (("protobuf", pb_topic, PB_COLUMNS),
                                ("json_schema", js_topic, JS_COLUMNS)):
        cfg = _pipeline(tmp, pg_dsn, kafka_bootstrap, topic, "icenest" + fmt[:2], fmt,
                        columns)
        report = run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
        out[fmt] = {"cfg": cfg, "topic": topic, "report": report}
    return out


def _rows(cfg: Any, dsn: str) -> dict[int, dict[str, Any]]:
    return {r["order_id"]: r for r in iceberg_table(cfg, dsn).scan().to_arrow().to_pylist()}


def _types(cfg: Any, dsn: str) -> dict[str, str]:
    return {f.name: str(f.field_type) for f in iceberg_table(cfg, dsn).schema().fields}


def test_protobuf_messages_become_struct_list_and_map_columns(nested: dict[str, Any],
                                                              pg_dsn: str) -> None:
    case = nested["protobuf"]
    assert case["report"].result.status == "committed", case["report"].result
    fields = _types(case["cfg"], pg_dsn)
    assert "city: optional string" in fields["address"] and \
        "zip: optional int" in fields["address"], fields
    assert fields["lines"].startswith("list<struct<"), fields
    for inner in ("sku: optional string", "qty: optional long", "price: optional double",
                  "at: optional timestamptz", "blob: optional binary"):
        assert inner in fields["lines"], fields
    assert fields["counts"] == "map<string, long>", fields
    assert fields["tags"] == "list<string>", fields


def test_every_protobuf_nested_value_reads_back_as_produced(nested: dict[str, Any],
                                                            pg_dsn: str) -> None:
    rows = _rows(nested["protobuf"]["cfg"], pg_dsn)
    assert sorted(rows) == list(range(5))  # the misfit is not there
    for i in range(5):
        got = rows[i]
        assert {"address": got["address"], "lines": got["lines"],
                "counts": sorted(got["counts"]), "tags": got["tags"]} == _pb_as_read(i), i


def test_json_schema_objects_become_struct_list_and_map_columns(nested: dict[str, Any],
                                                                pg_dsn: str) -> None:
    case = nested["json_schema"]
    assert case["report"].result.status == "committed", case["report"].result
    fields = _types(case["cfg"], pg_dsn)
    assert "street: required string" in fields["address"] and \
        "zip: optional long" in fields["address"], fields
    assert fields["lines"].startswith("list<struct<"), fields
    for inner in ("qty: required long", "price: optional double", "at: optional timestamptz",
                  "day: optional date", "ok: optional boolean"):
        assert inner in fields["lines"], fields
    assert fields["tags"] == "map<string, double>", fields


def test_every_json_schema_nested_value_reads_back_as_produced(nested: dict[str, Any],
                                                               pg_dsn: str) -> None:
    rows = _rows(nested["json_schema"]["cfg"], pg_dsn)
    assert sorted(rows) == list(range(5))
    for i in range(5):
        got = rows[i]
        assert {"address": got["address"], "lines": got["lines"],
                "tags": sorted(got["tags"])} == _js_as_read(i), i


def test_a_nested_value_that_does_not_fit_is_a_dead_letter_alone(
        nested: dict[str, Any], pg_dsn: str) -> None:
    want = {"protobuf": {3: f"lines[0].qty: {BIG} does not fit in int64"},
            "json_schema": {3: f"lines[0].qty: {2**63} does not fit in int64",
                            5: "address.street is null, but the Iceberg table's field is "
                               "required"}}
    for fmt, reasons in want.items():
        cfg, topic = nested[fmt]["cfg"], nested[fmt]["topic"]
        dead = {d.offset: d for d in chaos.dead_letters(pg_dsn, cfg.dead_letter_table,
                                                        cfg.name)}
        assert sorted(dead) == sorted(reasons), (fmt, dead)
        for offset, why in reasons.items():
            assert (dead[offset].topic, dead[offset].partition) == (topic, 0)
            assert why in dead[offset].error, (fmt, dead[offset])
        with Ledger(pg_dsn) as ledger:
            assert ledger.positions(cfg.name) == {(topic, 0): 5 + len(reasons)}


def test_a_field_added_inside_a_message_or_object_is_refused_by_name_without_evolution(
        nested: dict[str, Any], pg_dsn: str, kafka_bootstrap: str, spark: Any) -> None:
    pb, js = nested["protobuf"], nested["json_schema"]
    produce(kafka_bootstrap, pb["topic"], _pb_values(pb["topic"], 2, country=True)[1:])
    jser = json_serializer(registry_url(), _js_schema(country=True))
    produce(kafka_bootstrap, js["topic"],
            [encode(jser, js["topic"], _js_order(7, country="BE"))])
    for case in (pb, js):
        cfg = case["cfg"]
        table = iceberg_table(cfg, pg_dsn)
        schema, head = table.schema(), table.current_snapshot().snapshot_id
        with Ledger(pg_dsn) as ledger:
            before = ledger.positions(cfg.name)
        bid = plan_batch(cfg, pg_dsn)
        with pytest.raises(SchemaMismatchError, match=r"address\.country") as e:
            run_batch(spark, cfg, bid, pg_dsn)
        assert "schema_evolution: add_columns" in str(e.value)
        table = iceberg_table(cfg, pg_dsn)
        assert table.schema() == schema and table.current_snapshot().snapshot_id == head
        with Ledger(pg_dsn) as ledger:
            assert ledger.positions(cfg.name) == before


@pytest.mark.parametrize("fmt", ["protobuf", "json_schema"])
def test_a_field_added_inside_a_message_or_object_joins_the_struct_in_the_batchs_commit(
        fmt: str, pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any) -> None:
    topic = new_topic(kafka_bootstrap, f"icenestevo{fmt[:2]}", 1)
    # v2 is registered (by its first record's encoding) after the first batch ran
    if fmt == "protobuf":
        old = _pb_values(topic, 4)
        columns, as_read = PB_COLUMNS, _pb_as_read

        def v2_record() -> bytes:
            return _pb_values(topic, 6, country=True)[5]
    else:
        v1 = json_serializer(registry_url(), _js_schema())
        old = [encode(v1, topic, _js_order(i)) for i in range(4)]
        columns, as_read = JS_COLUMNS, _js_as_read

        def v2_record() -> bytes:
            v2 = json_serializer(registry_url(), _js_schema(country=True))
            return encode(v2, topic, _js_order(5, country="BE"))
    produce(kafka_bootstrap, topic, old[:3])
    cfg = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, "icenestevo" + fmt[:2], fmt,
                    columns, schema_evolution="add_columns")
    first = plan_batch(cfg, pg_dsn)
    assert run_batch(spark, cfg, first, pg_dsn).result.status == "committed"
    produce(kafka_bootstrap, topic, [old[3], v2_record()])  # v1's record 3, v2's 5
    bid = plan_batch(cfg, pg_dsn)
    report = run_batch(spark, cfg, bid, pg_dsn)
    assert report.result.status == "committed", report.result
    table = iceberg_table(cfg, pg_dsn)
    assert "country: optional string" in str(table.schema().find_field("address").field_type)
    snaps = {int(s.summary.additional_properties[SUMMARY_BATCH]): s
             for s in table.snapshots() if s.summary and
             SUMMARY_BATCH in s.summary.additional_properties}
    schemas = table.schemas()
    assert "address.country" in schemas[snaps[bid].schema_id].column_names
    assert "address.country" not in schemas[snaps[first].schema_id].column_names
    assert snapshot_batches(cfg, pg_dsn) == [first, bid]
    rows = _rows(cfg, pg_dsn)
    assert sorted(rows) == [0, 1, 2, 3, 5]
    for i in range(4):  # batch 1's rows, and v1's record in batch 2: null there
        assert rows[i]["address"] == as_read(i, None)["address"], i
    assert rows[5]["address"] == as_read(5, "BE")["address"]
    assert rows[5]["lines"] == as_read(5)["lines"]
    assert not chaos.dead_letters(pg_dsn, cfg.dead_letter_table, cfg.name)



def test_a_json_schema_number_a_double_cannot_hold_is_a_dead_letter_not_rounded(
        pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any) -> None:
    """JSON Schema `number` is a double column inside a struct/list/map, but a JSON number
    has every digit the producer wrote: one the double cannot hold exactly (2**53 + 1, a
    price with 20 significant digits, 1e400) is its record's dead letter naming the path,
    never landed rounded (or infinite); one it holds (0.1, 2**53) lands as produced."""
    topic = new_topic(kafka_bootstrap, "icenestjsnum", 1)
    jser = json_serializer(registry_url(), _js_schema())
    sid = int.from_bytes(encode(jser, topic, _js_order(0))[1:5], "big")

    def order(i: int, price: str, tag: str) -> bytes:
        """Order i with its numbers written as the producer wrote them (digit by digit:
        json.dumps of a float would round them first)."""
        doc = {**_js_order(i), "lines": [{"qty": i, "price": "__P__"}],
               "tags": {"t": "__T__"}}
        text = json.dumps(doc).replace('"__P__"', price).replace('"__T__"', tag)
        return b"\x00" + sid.to_bytes(4, "big") + text.encode()

    values = {1: ("0.1", "9007199254740992"),         # both fit a double exactly
              2: ("9007199254740993", "1"),           # 2**53 + 1: not a double
              3: ("1", "12345.678901234567891"),      # 20 significant digits
              4: ("1e400", "1")}                      # beyond a double's range
    produce(kafka_bootstrap, topic, [order(i, p, t) for i, (p, t) in values.items()])
    cfg = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, "icenestjsnum", "json_schema",
                    JS_COLUMNS)
    report = run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
    assert report.result.status == "committed", report.result
    rows = _rows(cfg, pg_dsn)
    landed = {i: (r["lines"][0]["price"], dict(r["tags"])["t"]) for i, r in rows.items()}
    dead = {d.offset: d.error for d in chaos.dead_letters(pg_dsn, cfg.dead_letter_table,
                                                          cfg.name)}
    # offset n holds order n + 1
    assert landed == {1: (0.1, 9007199254740992.0)}, (landed, dead)
    assert sorted(dead) == [1, 2, 3], dead
    assert "lines[0].price" in dead[1] and "9007199254740993" in dead[1], dead
    assert "tags" in dead[2] and "12345.678901234567891" in dead[2], dead
    assert "lines[0].price" in dead[3] and "beyond the range of a double" in dead[3], dead


def test_a_json_schema_string_in_a_numeric_field_is_a_dead_letter_not_a_number(
        pg_dsn: str, kafka_bootstrap: str, spark: Any, tmp_path: Any) -> None:
    """Only Protobuf's JSON mapping writes numbers as strings: a JSON Schema record whose
    producer does not validate and sends `"0042"` for an `integer` (or `"NaN"` for a
    `number`) inside an object is its record's dead letter naming the path, as at top
    level, never landed as 42 (or NaN)."""
    topic = new_topic(kafka_bootstrap, "icenestjsstr", 1)
    jser = json_serializer(registry_url(), _js_schema())
    sid = int.from_bytes(encode(jser, topic, _js_order(0))[1:5], "big")
    docs = [{**_js_order(1), "lines": [{"qty": 1, "price": 0.5}]},
            {**_js_order(2), "lines": [{"qty": "0042", "price": 0.5}]},
            {**_js_order(3), "tags": {"t": "NaN"}}]
    produce(kafka_bootstrap, topic, [_js_raw(sid, d) for d in docs])
    cfg = _pipeline(tmp_path, pg_dsn, kafka_bootstrap, topic, "icenestjsstr", "json_schema",
                    JS_COLUMNS)
    report = run_batch(spark, cfg, plan_batch(cfg, pg_dsn), pg_dsn)
    assert report.result.status == "committed", report.result
    rows = _rows(cfg, pg_dsn)
    dead = {d.offset: d.error for d in chaos.dead_letters(pg_dsn, cfg.dead_letter_table,
                                                          cfg.name)}
    assert sorted(rows) == [1], ({i: (r["lines"], r["tags"]) for i, r in rows.items()}, dead)
    assert sorted(dead) == [1, 2], dead
    assert "lines[0].qty: expected an integer, got '0042'" in dead[1], dead
    assert "tags['t']: expected a number, got 'NaN'" in dead[2], dead
