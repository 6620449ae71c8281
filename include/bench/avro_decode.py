"""Decode speed alone (no Kafka, no Spark): the benchmark's records as Confluent-framed Avro
through `deserialize_avro` and as JSON through `deserialize_json`, in chunks of 10,000, in
this one process. CPU seconds of the process, not wall time: on a shared machine the wall
clock measures the others too.

    python include/bench/avro_decode.py [--records 50000] [--reader-v2]

`--reader-v2`: the reader schema is a later version (one more field, with a default), so
every record is resolved from its writer schema to it.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from typing import Any

from dataset import SCHEMA, record
from engines_avro import AVRO_SCHEMA, avro_record

from offsetflow.source import AvroDecoder, deserialize_avro, deserialize_json
from offsetflow.source.registry import RegisteredSchema

CHUNK = 10_000
READER_V2 = {**AVRO_SCHEMA, "fields": [*AVRO_SCHEMA["fields"],  # type: ignore[list-item]
                                       {"name": "extra", "type": ["null", "long"],
                                        "default": None}]}


class _Registry:
    """The writer schema as id 7 (a registry's answer, without one)."""

    shown = "in-process"

    def schema_by_id(self, schema_id: int) -> RegisteredSchema | None:
        return RegisteredSchema(7, "AVRO", json.dumps(AVRO_SCHEMA)) if schema_id == 7 else None


def _best(fn: Any, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    import fastavro

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--reader-v2", action="store_true")
    args = ap.parse_args()
    parsed = fastavro.parse_schema(AVRO_SCHEMA)

    def wire(i: int) -> bytes:
        buf = io.BytesIO()
        buf.write(b"\x00\x00\x00\x00\x07")
        fastavro.schemaless_writer(buf, parsed, avro_record(i))
        return buf.getvalue()

    n = args.records
    avro: list[bytes | None] = [wire(i) for i in range(n)]
    js: list[bytes | None] = [record(i) for i in range(n)]
    topics = ["t"] * n
    readers = {"t": (8, json.dumps(READER_V2)) if args.reader_v2 else None}

    def run_avro() -> None:
        decoder = AvroDecoder(_Registry(), readers)  # type: ignore[arg-type]
        for s in range(0, n, CHUNK):
            _, bad, _ = deserialize_avro(avro[s:s + CHUNK], topics[s:s + CHUNK], SCHEMA,
                                         decoder)
            assert not bad, bad[:1]

    def run_json() -> None:
        for s in range(0, n, CHUNK):
            _, bad, _ = deserialize_json(js[s:s + CHUNK], SCHEMA)
            assert not bad, bad[:1]

    for name, fn in (("avro", run_avro), ("json", run_json)):
        print(f"{name}: {n / _best(fn):,.0f} records/s (CPU time, {n:,} records, "
              f"{len(SCHEMA)} columns{', reader v2' if name == 'avro' and args.reader_v2 else ''})")


if __name__ == "__main__":
    main()
