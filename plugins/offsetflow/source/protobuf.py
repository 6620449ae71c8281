"""Protobuf values in the Confluent wire format (`format.type: protobuf`), in the Spark task:
magic byte 0, the writer schema's 4-byte id, the message indexes (a zigzag varint count,
then that many zigzag varints; a single 0 means the file's first message), then the
Protobuf binary. The schema is fetched by id once per worker as its serialized
FileDescriptorProto (`?format=serialized`), built into a descriptor pool of its own (imports
of Google's well-known types are resolved from the installed protobuf package; other imports
-- schema references -- are not supported yet) and the message class made dynamically.

Columns: each `format.schema` column takes the message's top-level field of that name:
scalars as they are (proto3 fields without presence read as their default), enums as their
name in a string column, `google.protobuf.Timestamp` as a timestamp, messages, repeated
fields and maps as `json`. Bad input is a dead letter naming the schema id, as for Avro.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from datetime import UTC
from typing import Any

import pyarrow as pa

from offsetflow.source.avro import (
    HEADER_BYTES,
    AvroDecoder,
    avro_value,
    json_text,
    wire_schema_id,
)
from offsetflow.source.deserialize import arrow_schema, rows_to_table
from offsetflow.source.json_fast import BadRecord
from offsetflow.source.registry import RegistryClient


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zigzag-encoded varint at `pos`: (value, next position); ValueError if cut short."""
    shift = raw = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("the message indexes are cut short")
        b = buf[pos]
        pos += 1
        raw |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return (raw >> 1) ^ -(raw & 1), pos


class ProtobufDecoder:
    """Decodes Confluent-framed Protobuf values; descriptors cached per schema id."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client
        self._files: dict[int, Any] = {}  # id -> (pool, FileDescriptorProto) or a reason

    def file(self, schema_id: int) -> Any:
        if schema_id not in self._files:
            found = self.client.schema_by_id(schema_id, serialized=True)
            if found is None:
                self._files[schema_id] = (f"unknown schema id {schema_id} (the registry has "
                                          f"no schema with this id)")
            elif found.schema_type != "PROTOBUF":
                self._files[schema_id] = (f"schema id {schema_id} is a {found.schema_type} "
                                          f"schema, not Protobuf")
            else:
                self._files[schema_id] = _build(schema_id, found.schema)
        return self._files[schema_id]

    def decode(self, value: bytes) -> tuple[int | None, Any]:
        """(schema id, the message); ValueError (with `schema_id`) naming what is wrong."""
        from google.protobuf.message import DecodeError
        from google.protobuf.message_factory import GetMessageClass

        sid = wire_schema_id(value)
        built = self.file(sid)
        if isinstance(built, str):
            raise _bad(sid, built)
        pool, proto = built
        try:
            count, pos = read_varint(value, HEADER_BYTES)
            indexes = [0] if count == 0 else []
            for _ in range(count):
                i, pos = read_varint(value, pos)
                indexes.append(i)
            msgs = proto.message_type
            name = proto.package
            for i in indexes:
                if not 0 <= i < len(msgs):
                    raise ValueError(f"message index {indexes} names no message of the schema")
                name = f"{name}.{msgs[i].name}" if name else msgs[i].name
                msgs = msgs[i].nested_type
            desc = pool.FindMessageTypeByName(name)
        except (ValueError, KeyError) as e:
            raise _bad(sid, str(e)) from None
        try:
            msg = GetMessageClass(desc).FromString(value[pos:])
        except (DecodeError, RuntimeError, ValueError) as e:
            raise _bad(sid, f"payload does not decode: {type(e).__name__}: {e}") from None
        return sid, msg


def _bad(schema_id: int, reason: str) -> ValueError:
    e = ValueError(reason)
    e.schema_id = schema_id  # type: ignore[attr-defined]
    return e


def _build(schema_id: int, text: str) -> Any:
    """(pool, FileDescriptorProto) from the registry's serialized schema, or why not."""
    from google.protobuf import descriptor_pb2, descriptor_pool

    try:
        proto = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(text,
                                                                               validate=True))
        pool = descriptor_pool.DescriptorPool()
        for dep in proto.dependency:
            known = _well_known(dep)
            if known is None:
                return (f"schema id {schema_id} imports {dep!r} (schema references are not "
                        f"supported yet)")
            pool.Add(known)
        pool.Add(proto)
        return pool, proto
    except Exception as e:  # noqa: BLE001 - .proto text from a registry without
        # ?format=serialized, or a descriptor the pool refuses
        return f"schema id {schema_id} cannot be parsed as a serialized Protobuf file: {e}"


def protobuf_builds(schema_id: int, text: str) -> bool:
    """Whether the tasks can build the registry's serialized schema `text` (else each of
    its records is a dead letter naming why)."""
    return not isinstance(_build(schema_id, text), str)


def _well_known(name: str) -> Any:
    import importlib

    from google.protobuf import descriptor_pb2, descriptor_pool

    if not name.startswith("google/protobuf/"):
        return None
    try:
        importlib.import_module("google.protobuf." + name.rsplit("/", 1)[1]
                                .removesuffix(".proto") + "_pb2")
        fd = descriptor_pool.Default().FindFileByName(name)
    except (ImportError, KeyError):
        return None
    out = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(out)
    return out


def proto_value(msg: Any, name: str, t: str) -> Any:
    """Field `name` of `msg` as column type `t`; None when the message has no such field or
    it is unset (where the field tracks presence)."""
    from google.protobuf.json_format import MessageToDict

    field = msg.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        return None
    v = getattr(msg, name)
    repeated = getattr(field, "is_repeated", None)
    is_repeated = repeated if repeated is not None else field.label == field.LABEL_REPEATED
    if not is_repeated and field.has_presence and not msg.HasField(name):
        return None
    if is_repeated or field.message_type is not None:
        if (not is_repeated and field.message_type.full_name
                == "google.protobuf.Timestamp" and t == "timestamp"):
            return v.ToDatetime(tzinfo=UTC)
        doc = MessageToDict(msg, preserving_proto_field_name=True,
                            always_print_fields_with_no_presence=True).get(name)
        return json_text(doc) if t == "json" else avro_value(doc, t)
    if field.enum_type is not None and t == "string":
        ev = field.enum_type.values_by_number.get(v)
        return ev.name if ev is not None else str(v)
    return avro_value(v, t)


def deserialize_protobuf(values: Sequence[bytes | None], topics: Sequence[str],
                         schema: Mapping[str, str], decoder: ProtobufDecoder,
                         keys: Sequence[bytes | None] | None = None,
                         key_decoder: AvroDecoder | None = None
                         ) -> tuple[pa.Table, list[BadRecord], list[int]]:
    """Decode a chunk as `deserialize_avro` does (same return, same tombstones and keys)."""
    from offsetflow.source.avro import key_fields

    rows: list[dict[str, Any]] = []
    good: list[int] = []
    bad: list[BadRecord] = []
    for i, v in enumerate(values):
        sid: int | None = None
        try:
            row: dict[str, Any] = dict.fromkeys(schema)
            if v is not None:
                sid, msg = decoder.decode(v)
                for name, t in schema.items():
                    try:
                        row[name] = proto_value(msg, name, t)
                    except (ValueError, TypeError, OverflowError) as e:
                        raise ValueError(f"field {name!r}: {e}") from None
            if key_decoder is not None and keys is not None:
                row.update(key_fields(keys[i], topics[i], schema, key_decoder))
        except ValueError as e:
            sid = getattr(e, "schema_id", sid)
            why = str(e)
            bad.append(BadRecord(i, f"schema id {sid}: {why}" if sid is not None
                                 and not why.startswith("key: ") else why))
            continue
        rows.append(row)
        good.append(i)
    table, refused = rows_to_table(rows, arrow_schema(schema))
    if refused:
        gone = dict(refused)
        bad = sorted(bad + [BadRecord(good[j], why) for j, why in refused],
                     key=lambda b: b.index)
        good = [g for j, g in enumerate(good) if j not in gone]
    return table, bad, good
