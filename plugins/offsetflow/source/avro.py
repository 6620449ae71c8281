"""Avro values in the Confluent wire format to typed Arrow columns, in the Spark task.

A value is one magic byte 0, the writer schema's 4-byte big-endian id in the registry, then
the Avro binary payload. The writer schema is fetched by that id once (`AvroDecoder`
caches it per id for the life of the Python worker: ids are immutable in a registry); the
reader schema is the topic's subject `<topic>-value` at the pipeline's reader version (its
latest when none is pinned), resolved once per batch run on the driver and shipped to the
tasks, so every task of a run decodes with the same one. fastavro's `schemaless_reader`
decodes a record (the per-record cost; the columns are then built in one pass).

What lands is `format.schema`: each declared column takes the top-level field of that name
(as the reader schema shapes it), converted to the declared type. Every record comes out as
a good row or a `BadRecord` whose reason names the schema id: no magic byte, an id the
registry does not have, a payload that does not decode (truncated, bytes left over) or a
value that does not fit its column. A registry that does not answer is not a record's
fault: `SchemaRegistryError` fails the batch, nothing is committed.
"""

from __future__ import annotations

import io
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa

from offsetflow.extras import require
from offsetflow.source.avro_fast import Resolution, resolution_fix, typed_columns
from offsetflow.source.avro_vector import Layout, decode_chunk, layout_of
from offsetflow.source.deserialize import (
    arrow_schema,
    decimal_value,
    json_text,
    rows_to_table,
    text_value,
)
from offsetflow.source.json_fast import BadRecord
from offsetflow.source.registry import RegisteredSchema, RegistryClient

MAGIC = 0
HEADER_BYTES = 5


def wire_schema_id(value: bytes) -> int:
    """The schema id of a Confluent wire-format record (magic byte 0, 4-byte big-endian
    id); ValueError saying why a record is not in that format."""
    if len(value) < HEADER_BYTES or value[0] != MAGIC:
        raise ValueError(
            f"not in the Confluent wire format: no magic byte 0 and 4-byte schema id "
            f"(first byte {value[:1].hex() or 'none'}, {len(value)} bytes)")
    return int.from_bytes(value[1:HEADER_BYTES], "big")
_ADDRESS = re.compile(r"\s*(from\s+)?<[^<>]* at 0x[0-9a-f]+>")


def subject_of(topic: str, part: str = "value") -> str:
    """The value (or key) subject of a topic under Confluent's default TopicNameStrategy."""
    return f"{topic}-{part}"


def reader_schemas(client: RegistryClient, topics: Sequence[str], version: int | None,
                   part: str = "value") -> dict[str, tuple[int, str] | None]:
    """topic -> (id, text) of its reader schema (`part`: value, or key for an Avro key);
    None where the subject has no schema and no version is pinned (records are then read
    with their writer schema). A pinned version the subject lacks is the config's error
    (SchemaRegistryError, not retriable)."""
    from offsetflow.errors import SchemaRegistryError

    out: dict[str, tuple[int, str] | None] = {}
    for topic in dict.fromkeys(topics):
        subject = subject_of(topic, part)
        found = client.subject_version(subject, version)
        if found is None and version is not None:
            raise SchemaRegistryError(
                client.shown, f"subject {subject!r} version {version}",
                "not found (format.schema_registry.reader_version pins a version the "
                "subject does not have)", retriable=False)
        if found is not None and found.schema_type != "AVRO":
            what = "format.type avro" if part == "value" else "format.key.type avro"
            raise SchemaRegistryError(
                client.shown, f"subject {subject!r}",
                f"holds a {found.schema_type} schema, not Avro ({what})", retriable=False)
        out[topic] = None if found is None else (found.schema_id, found.schema)
    return out


class AvroDecoder:
    """Decodes Confluent-framed Avro values. Per writer id (a registry's ids are immutable)
    it keeps the parsed writer schema and, per topic, how a record of that writer is read
    as the topic's reader schema: worked out once (`avro_fast.resolution_fix`), not by
    fastavro walking both schemas for every record."""

    def __init__(self, client: RegistryClient,
                 readers: Mapping[str, tuple[int, str] | None]) -> None:
        # in a Spark task: an executor environment without the avro extra is named as such
        self._fastavro = require("avro", "format.type: avro (the Spark tasks decode with it)")
        self._read = self._fastavro.schemaless_reader
        self.client = client
        self._writers: dict[int, Any] = {}  # id -> parsed schema, or the reason it is unusable
        self._texts: dict[int, str] = {}  # id -> the writer schema's text
        self._readers: dict[str, tuple[int, Any, str] | None] = {
            t: None if r is None else (r[0], self._parse(r[1]), r[1])
            for t, r in readers.items()}
        self._plans: dict[tuple[int, str], _Plan | str] = {}
        self._layouts: dict[int, Layout | None] = {}

    def _parse(self, text: str) -> Any:
        return self._fastavro.parse_schema(json.loads(text))

    def writer(self, schema_id: int) -> Any:
        """The parsed writer schema of `schema_id`, or a `str`: why it cannot be used."""
        if schema_id not in self._writers:
            found = self.client.schema_by_id(schema_id)  # SchemaRegistryError: the batch's
            self._writers[schema_id] = _usable(schema_id, found, self._parse)
            if found is not None:
                self._texts[schema_id] = found.schema
        return self._writers[schema_id]

    def plan(self, schema_id: int, topic: str) -> _Plan | str:
        """How records of writer `schema_id` on `topic` are read, or why they cannot be."""
        key = (schema_id, topic)
        found = self._plans.get(key)
        if found is None:
            writer = self.writer(schema_id)
            reader = self._readers.get(topic)
            if isinstance(writer, str):
                found = writer
            elif reader is None or reader[0] == schema_id:
                found = _Plan(writer, None, None, None)
            else:
                fix = resolution_fix(self._fastavro, self._texts[schema_id], reader[2])
                found = _Plan(writer, reader[1] if fix is None else None, fix, reader[1])
            self._plans[key] = found
        return found

    def vectorised(self, schema_id: int, topics: set[str]
                   ) -> tuple[Layout, Resolution] | None:
        """The column-wise layout of writer `schema_id` and how its records are resolved
        (the same on all `topics`), when it has one and fastavro need not resolve them."""
        fixes = []
        for topic in topics:
            plan = self.plan(schema_id, topic)
            if isinstance(plan, str) or plan.reader is not None:
                return None
            fixes.append(plan.fix or Resolution())
        if any(f != fixes[0] for f in fixes):
            return None
        if schema_id not in self._layouts:
            self._layouts[schema_id] = layout_of(json.loads(self._texts[schema_id]))
        layout = self._layouts[schema_id]
        return None if layout is None else (layout, fixes[0])

    def decode(self, value: bytes, topic: str) -> tuple[int | None, Any]:
        """(schema id, the decoded datum); raises ValueError naming what is wrong."""
        schema_id = wire_schema_id(value)
        plan = self._plans.get((schema_id, topic)) or self.plan(schema_id, topic)
        if isinstance(plan, str):
            raise _Bad(schema_id, plan)
        if plan.fix is not None:
            try:
                datum = self._exact(value, schema_id, plan.writer, None)
                plan.fix(datum)
                return schema_id, datum
            except Exception:  # noqa: BLE001 - fastavro's own resolution says what is wrong
                pass
            return schema_id, self._exact(value, schema_id, plan.writer, plan.resolve_with)
        return schema_id, self._exact(value, schema_id, plan.writer, plan.reader)

    def _exact(self, value: bytes, schema_id: int, writer: Any, reader: Any) -> Any:
        """The payload after the header, decoded and consumed exactly."""
        buf = io.BytesIO(value)
        buf.seek(HEADER_BYTES)
        try:
            datum = self._read(buf, writer, reader)
        except Exception as e:  # noqa: BLE001 - any failure to decode is the record's
            # no object addresses in a dead letter's reason: a replay writes the same one
            why = _ADDRESS.sub("", str(e))[:200] or "truncated"
            raise _Bad(schema_id, f"payload does not decode: {type(e).__name__}: "
                                  f"{why}") from None
        left = len(value) - buf.tell()
        if left:
            raise _Bad(schema_id, f"{left} bytes left after the record (not written with "
                                  f"the schema its id names?)")
        return datum


@dataclass(frozen=True)
class _Plan:
    """`writer` parsed; `reader`: what fastavro resolves each record to (None: read as
    written); `fix`: the resolution to `resolve_with` compiled once, applied to the
    writer's record (a record it cannot take is read by fastavro's resolution instead)."""

    writer: Any
    reader: Any
    fix: Resolution | None
    resolve_with: Any


class _Bad(ValueError):
    def __init__(self, schema_id: int | None, reason: str) -> None:
        super().__init__(reason)
        self.schema_id = schema_id


def _usable(schema_id: int, found: RegisteredSchema | None, parse: Any) -> Any:
    if found is None:
        return f"unknown schema id {schema_id} (the registry has no schema with this id)"
    if found.schema_type != "AVRO":
        return f"schema id {schema_id} is a {found.schema_type} schema, not Avro"
    try:
        return parse(found.schema)
    except Exception as e:  # noqa: BLE001 - e.g. references to other subjects
        refs = " (schema references are not supported yet)" if found.has_references else ""
        return f"schema id {schema_id} cannot be parsed{refs}: {e}"


def record_fields(datum: Any, schema: Mapping[str, str], only_present: bool = False
                  ) -> dict[str, Any]:
    """A decoded Avro record's top-level fields as format.schema's columns (`only_present`:
    just the declared fields the record has, as a key's fields that fill columns)."""
    if not isinstance(datum, dict):
        raise ValueError(f"the schema is not a record (got {type(datum).__name__}); "
                         f"format.schema names fields of a record")
    row = {}
    for name, t in schema.items():
        if only_present and name not in datum:
            continue
        try:
            row[name] = avro_value(datum.get(name), t)
        except (ValueError, TypeError, OverflowError) as e:
            raise ValueError(f"field {name!r}: {e}") from None
    return row


def field_defaults(readers: Mapping[str, tuple[int, str] | None],
                   columns: Mapping[str, str]) -> dict[str, Any]:
    """column -> the value a record written without that field gets when read with the
    reader schema (Avro resolution fills the field's default), converted as a row's value
    (`avro_value`). Why: the rows already in the target when schema evolution adds the
    column hold it, as a replay of their window, decoded with this reader, writes them.
    Left out (NULL): a null default, a field some topic's reader lacks or defaults
    otherwise, or one whose default cannot be resolved alone (a named type defined in
    another field)."""
    fastavro = require("avro", "format.type: avro (the Spark tasks decode with it)")
    found: dict[str, list[Any]] = {}
    texts = [r[1] for _, r in sorted(readers.items()) if r is not None]
    for text in texts:
        doc = json.loads(text)
        shell = {k: v for k, v in doc.items() if k != "fields"}
        for f in doc.get("fields") or []:
            name = str(f.get("name"))
            if name not in columns or f.get("default") is None:
                continue
            try:
                datum = fastavro.schemaless_reader(
                    io.BytesIO(b""), fastavro.parse_schema({**shell, "fields": []}),
                    fastavro.parse_schema({**shell, "fields": [f]}))
                found.setdefault(name, []).append(avro_value(datum.get(name), columns[name]))
            except Exception:  # noqa: BLE001 - such a column is added without a value
                continue
    return {name: vs[0] for name, vs in found.items()
            if len(vs) == len(texts) and all(v == vs[0] for v in vs)}


def key_fields(key: bytes | None, topic: str, schema: Mapping[str, str],
               decoder: AvroDecoder) -> dict[str, Any]:
    """format.key avro: the declared columns a Confluent wire-format Avro key fills (its
    record's fields of those names; a null key fills none). ValueError (a dead letter)
    names the key, its schema id and why."""
    if key is None:
        return {}
    schema_id: int | None = None
    try:
        schema_id, datum = decoder.decode(key, topic)
        return record_fields(datum, schema, only_present=True)
    except ValueError as e:
        sid = getattr(e, "schema_id", schema_id)
        raise ValueError(f"key: schema id {sid}: {e}" if sid is not None
                         else f"key: {e}") from None


def deserialize_avro(values: Sequence[bytes | None], topics: Sequence[str],
                     schema: Mapping[str, str], decoder: AvroDecoder,
                     keys: Sequence[bytes | None] | None = None,
                     key_decoder: AvroDecoder | None = None
                     ) -> tuple[pa.Table, list[BadRecord], list[int]]:
    """Decode a chunk (`topics[i]`: record i's topic). Returns the good rows' table in the
    declared schema, the bad records, and the chunk indices of the good rows. A null value
    (a tombstone) is a good row of nulls: the tombstone policy decides its fate. With
    `key_decoder` (format.key avro) the fields of each Avro key fill the columns of their
    names, over the value's (upsert keys; a tombstone's delete key).

    Each payload is decoded once; the columns are then built column by column
    (`avro_fast.typed_columns`). A chunk with a value that does not fit its column, or a
    key that does not decode, is converted record by record from the decoded payloads,
    which names each bad record and why."""
    target = arrow_schema(schema)
    if key_decoder is None and values:
        vector = _vectorised(values, topics, schema, decoder, target)
        if vector is not None:
            return vector, [], list(range(len(values)))
    bad: list[BadRecord] = []
    decoded: list[tuple[int, int | None, Any]] = []  # (index, schema id, datum)
    for i, v in enumerate(values):
        if v is None:
            decoded.append((i, None, None))
            continue
        try:
            schema_id, datum = decoder.decode(v, topics[i])
        except ValueError as e:
            sid = getattr(e, "schema_id", None)
            bad.append(BadRecord(i, f"schema id {sid}: {e}" if sid is not None else str(e)))
            continue
        decoded.append((i, schema_id, datum))
    table = None
    if all(d is None or type(d) is dict for _, _, d in decoded):
        keyed = None if key_decoder is None or keys is None \
            else _key_records(decoded, keys, topics, key_decoder)
        if key_decoder is None or keys is None or keyed is not None:
            table = typed_columns([d for _, _, d in decoded], keyed, schema, target,
                                  avro_value)
    if table is not None:
        return table, bad, [i for i, _, _ in decoded]
    rows: list[dict[str, Any]] = []
    good: list[int] = []
    for i, schema_id, datum in decoded:
        try:
            row = dict.fromkeys(schema) if values[i] is None else record_fields(datum, schema)
            if key_decoder is not None and keys is not None:
                row.update(key_fields(keys[i], topics[i], schema, key_decoder))
        except ValueError as e:
            why = str(e)  # a key's reason names the key's schema id itself
            bad.append(BadRecord(i, f"schema id {schema_id}: {why}" if schema_id is not None
                                 and not why.startswith("key: ") else why))
            continue
        rows.append(row)
        good.append(i)
    table, refused = rows_to_table(rows, target)
    if refused:
        gone = dict(refused)
        bad += [BadRecord(good[j], why) for j, why in refused]
        good = [g for j, g in enumerate(good) if j not in gone]
    return table, sorted(bad, key=lambda b: b.index), good


def _vectorised(values: Sequence[bytes | None], topics: Sequence[str],
                schema: Mapping[str, str], decoder: AvroDecoder, target: pa.Schema
                ) -> pa.Table | None:
    """The chunk through `avro_vector` when every value is framed with one writer id whose
    records are read as written and whose layout it takes; else None."""
    first = values[0]
    if first is None or len(first) < HEADER_BYTES or first[0] != MAGIC:
        return None
    head = first[:HEADER_BYTES]
    if not all(v is not None and v[:HEADER_BYTES] == head for v in values):
        return None
    found = decoder.vectorised(int.from_bytes(head[1:], "big"), set(topics))
    if found is None:
        return None
    return decode_chunk(values, found[0], schema, target, found[1],  # type: ignore[arg-type]
                        avro_value)


def _key_records(decoded: Sequence[tuple[int, int | None, Any]], keys: Sequence[bytes | None],
                 topics: Sequence[str], key_decoder: AvroDecoder
                 ) -> list[dict[str, Any] | None] | None:
    """Each decoded record's key record (None: a null key), or None when a key is not a
    record that decodes (the record-by-record path then says why)."""
    out: list[dict[str, Any] | None] = []
    for i, _, _ in decoded:
        k = keys[i]
        if k is None:
            out.append(None)
            continue
        try:
            _, datum = key_decoder.decode(k, topics[i])
        except ValueError:
            return None
        if type(datum) is not dict:
            return None
        out.append(datum)
    return out


def avro_value(v: Any, t: str) -> Any:
    """One decoded Avro value as column type `t` (format.schema); ValueError says why not.
    fastavro gives records and maps as dict, arrays as list, enums as str, logical types as
    Decimal, date, datetime (UTC), time and UUID."""
    if v is None:
        return None
    if t == "json":
        return json_text(v)
    if t == "uuid":
        if isinstance(v, uuid.UUID):
            return str(v)
        if isinstance(v, str):
            return str(uuid.UUID(v))
        raise ValueError(f"expected a uuid, got {type(v).__name__}")
    if t == "string":
        if isinstance(v, uuid.UUID):
            return str(v)
        if not isinstance(v, str):
            raise ValueError(f"expected a string or enum, got {type(v).__name__} (declare "
                             f"it json for a record, array or map)")
        return text_value(v)
    if t in ("long", "int"):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {type(v).__name__}")
        limit = 2**63 if t == "long" else 2**31
        if not -limit <= v < limit:
            raise ValueError(f"{v} does not fit in {t}")
        return v
    if t in ("double", "float"):
        if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)):
            raise ValueError(f"expected a number, got {type(v).__name__}")
        f = float(v)
        if t == "float" and math.isfinite(f) and abs(f) > 3.4028234663852886e38:
            raise ValueError(f"{v} overflows float")
        return f
    if t == "boolean":
        if not isinstance(v, bool):
            raise ValueError(f"expected a boolean, got {type(v).__name__}")
        return v
    if t == "timestamp":
        if not isinstance(v, datetime):
            raise ValueError(f"expected a timestamp (timestamp-millis/micros), got "
                             f"{type(v).__name__}")
        return v if v.tzinfo else v.replace(tzinfo=UTC)  # local-timestamp-*: as UTC
    if t == "date":
        if isinstance(v, datetime) or not isinstance(v, date):
            raise ValueError(f"expected a date, got {type(v).__name__}")
        return v
    if t.startswith("decimal("):
        if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)):
            raise ValueError(f"expected a decimal, got {type(v).__name__}")
        return decimal_value(v, t)
    raise ValueError(f"unsupported type {t}")


def fill_keys(table: pa.Table, good: list[int], keys: Sequence[bytes | None],
              topics: Sequence[str], schema: Mapping[str, str], key_decoder: AvroDecoder
              ) -> tuple[pa.Table, list[BadRecord], list[int]]:
    """format.key avro over rows another format decoded (`good`: their chunk indices): each
    Avro key's fields fill the columns of their names; a poison key makes its record a
    dead letter. Returns the table, the new bad records and the remaining good indices."""
    rows = table.to_pylist()
    kept: list[dict[str, Any]] = []
    still: list[int] = []
    bad: list[BadRecord] = []
    for row, i in zip(rows, good, strict=True):
        try:
            row.update(key_fields(keys[i], topics[i], schema, key_decoder))
        except ValueError as e:
            bad.append(BadRecord(i, str(e)))
            continue
        kept.append(row)
        still.append(i)
    out, refused = rows_to_table(kept, arrow_schema(schema))
    if refused:
        gone = dict(refused)
        bad += [BadRecord(still[j], why) for j, why in refused]
        still = [g for j, g in enumerate(still) if j not in gone]
    return out, bad, still
