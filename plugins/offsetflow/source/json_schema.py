"""JSON Schema values in the Confluent wire format (`format.type: json_schema`), in the Spark
task: magic byte 0, the writer schema's 4-byte id, then the JSON text. The header is checked
and stripped, the id looked up in the registry once per worker (it must name a JSON schema:
an unknown id or another type is a dead letter), and the JSON text goes through the json
format's path (`deserialize_json`): same columns, same checks, same reasons, each prefixed
with the schema id. The payload is not validated against the JSON schema: the producer's
serializer did that; what lands is what fits format.schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa

from offsetflow.source.avro import HEADER_BYTES, AvroDecoder, fill_keys, wire_schema_id
from offsetflow.source.deserialize import deserialize_json
from offsetflow.source.json_fast import BadRecord
from offsetflow.source.registry import RegistryClient


class JsonSchemaIds:
    """Which schema ids a worker has seen, and why an id is unusable (None: usable)."""

    def __init__(self, client: RegistryClient) -> None:
        self.client = client
        self._why: dict[int, str | None] = {}

    def check(self, schema_id: int) -> str | None:
        if schema_id not in self._why:
            found = self.client.schema_by_id(schema_id)  # SchemaRegistryError: the batch's
            if found is None:
                why: str | None = (f"unknown schema id {schema_id} (the registry has no "
                                   f"schema with this id)")
            elif found.schema_type != "JSON":
                why = f"schema id {schema_id} is a {found.schema_type} schema, not JSON Schema"
            else:
                why = None
            self._why[schema_id] = why
        return self._why[schema_id]


def deserialize_json_schema(values: Sequence[bytes | None], topics: Sequence[str],
                            schema: Mapping[str, str], ids: JsonSchemaIds,
                            keys: Sequence[bytes | None] | None = None,
                            key_decoder: AvroDecoder | None = None
                            ) -> tuple[pa.Table, list[BadRecord], list[int]]:
    """Decode a chunk as `deserialize_avro` does (same return). Tombstones take their fields
    from a JSON key as in the json format, or from an Avro key (`key_decoder`)."""
    payloads: list[bytes | None] = []
    at: list[int] = []  # chunk index of each payload
    sids: list[int | None] = []
    bad: list[BadRecord] = []
    for i, v in enumerate(values):
        if v is None:
            payloads.append(None)
            at.append(i)
            sids.append(None)
            continue
        try:
            sid = wire_schema_id(v)
        except ValueError as e:
            bad.append(BadRecord(i, str(e)))
            continue
        why = ids.check(sid)
        if why is not None:
            bad.append(BadRecord(i, f"schema id {sid}: {why}"))
            continue
        payloads.append(v[HEADER_BYTES:])
        at.append(i)
        sids.append(sid)
    json_keys = None if keys is None or key_decoder is not None else [keys[i] for i in at]
    table, jbad, jgood = deserialize_json(payloads, schema, json_keys)
    bad += [BadRecord(at[b.index], f"schema id {sids[b.index]}: {b.reason}"
                      if sids[b.index] is not None else b.reason) for b in jbad]
    good = [at[g] for g in jgood]
    if key_decoder is not None and keys is not None:
        table, kbad, good = fill_keys(table, good, keys, topics, schema, key_decoder)
        bad += kbad
    return table, sorted(bad, key=lambda b: b.index), good
