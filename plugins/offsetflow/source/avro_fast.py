"""The fast parts of Avro decoding (`offsetflow.source.avro`), each held to the answer of the
record-by-record path it replaces (`tests/unit/source/test_avro_fast.py`):

- `resolution_fix`: Avro's writer -> reader resolution compiled once per (writer schema,
  reader schema) for the common top-level changes (fields added with a default, fields
  removed, numeric promotions, a field made nullable). fastavro resolves per record by
  walking both schemas (measured: a third of the records/s of a plain decode); decoding
  with the writer schema and patching the record's top-level fields gives the same datum.
  Anything else (nested changes, aliases, renamed records) returns None: fastavro resolves.
- `typed_columns`: a chunk's decoded records as the declared Arrow columns, one column at a
  time (a type check over the column, then one pyarrow conversion), instead of one Python
  conversion per value. It returns None as soon as a column holds anything it does not take
  exactly as `avro_value` would; the caller then converts record by record, which names
  the record and the reason.
"""

from __future__ import annotations

import copy
import io
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from offsetflow.source.deserialize import json_text, text_value

# writer type -> reader type: Avro's promotions of numbers (to float/double: float(v))
_PROMOTIONS = {("int", "long"), ("int", "float"), ("int", "double"), ("long", "float"),
               ("long", "double"), ("float", "double")}
_IMMUTABLE = (type(None), bool, int, float, str, bytes, Decimal, date, datetime, uuid.UUID)


@dataclass(frozen=True)
class Resolution:
    """Avro resolution of a writer's record to a reader schema, as top-level patches:
    fields the reader lacks dropped, fields promoted (name -> the reader's type), fields the
    writer lacks given the reader's default (as fastavro decodes it)."""

    drop: tuple[str, ...] = ()
    promote: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, d: dict[str, Any]) -> None:
        for n in self.drop:
            d.pop(n, None)
        for n, rt in self.promote.items():
            if rt in ("float", "double"):  # int -> long: the same Python int
                d[n] = float(d[n])
        for n, v in self.defaults.items():  # each record its own list or dict
            d[n] = v if isinstance(v, _IMMUTABLE) else copy.deepcopy(v)


def resolution_fix(fastavro: Any, writer_text: str, reader_text: str) -> Resolution | None:
    """How a record decoded with the writer schema becomes the record fastavro gives when
    it resolves it to the reader schema, or None when the difference is not one this
    compiles (then fastavro resolves each record)."""
    try:
        return _compile(fastavro, json.loads(writer_text), json.loads(reader_text))
    except Exception:  # noqa: BLE001 - anything unexpected: resolve record by record
        return None


def _compile(fastavro: Any, w: Any, r: Any) -> Resolution | None:
    from fastavro.schema import expand_schema

    if not (isinstance(w, dict) and isinstance(r, dict) and w.get("type") == "record"
            and r.get("type") == "record"):
        return None
    we: dict[str, Any] = expand_schema(w)  # type: ignore[assignment]
    re_: dict[str, Any] = expand_schema(r)  # type: ignore[assignment]
    if we.get("name") != re_.get("name") or r.get("aliases"):
        return None
    wf = {f["name"]: f for f in we["fields"]}
    rf = {f["name"]: f for f in re_["fields"]}
    if any(f.get("aliases") for f in re_["fields"]) or len(wf) != len(we["fields"]):
        return None
    drop = tuple(n for n in wf if n not in rf)
    promote: dict[str, str] = {}
    added: list[dict[str, Any]] = []
    for name, f in rf.items():
        if name not in wf:
            if "default" not in f:
                return None  # fastavro says why per record (no default): a dead letter
            added.append(next(x for x in r["fields"] if x.get("name") == name))
            continue
        wt, rt = wf[name]["type"], f["type"]
        if wt == rt:
            continue
        if isinstance(wt, str) and isinstance(rt, str) and (wt, rt) in _PROMOTIONS:
            promote[name] = rt
            continue
        # made nullable: the writer's type is the union's other branch (no earlier branch
        # it could be promoted to instead)
        if isinstance(rt, list) and not isinstance(wt, list) and len(rt) == 2 \
                and "null" in rt and wt in rt:
            continue
        return None
    defaults: dict[str, Any] = {}
    if added:  # fastavro fills them once, from an empty record: the same values it gives
        shell = {k: v for k, v in r.items() if k != "fields"}
        got = fastavro.schemaless_reader(
            io.BytesIO(b""), fastavro.parse_schema({**shell, "fields": []}),
            fastavro.parse_schema({**shell, "fields": added}))
        defaults = {str(f["name"]): got[f["name"]] for f in added}
    return Resolution(drop, promote, defaults)


def typed_columns(records: Sequence[Mapping[str, Any] | None],
                  keys: Sequence[Mapping[str, Any] | None] | None,
                  schema: Mapping[str, str], target: pa.Schema,
                  convert: Callable[[Any, str], Any]) -> pa.Table | None:
    """The declared columns of decoded records (None: a tombstone, all null) with each
    key record's fields over the value's (`keys`), or None when a value does not fit its
    column (the record-by-record conversion then names the record and why). `convert` is
    that conversion of one value (`avro_value`): a column the vectorised checks do not
    take is converted value by value with it, as the slow path does."""
    cols = []
    for name, t in schema.items():
        at = target.field(name).type
        values = [None if d is None else d.get(name) for d in records]
        if keys is not None and any(k is not None and name in k for k in keys):
            # record by record, the value's field is converted before the key's fills
            # its column: one that does not fit makes the record a dead letter there, so
            # it must here too (else a record's fate would hang on its chunk neighbours)
            if _typed(values, t, at, convert) is None:
                return None
            values = [k[name] if k is not None and name in k else v
                      for v, k in zip(values, keys, strict=True)]
        col = _typed(values, t, at, convert)
        if col is None:
            return None
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=target)


def _typed(values: list[Any], t: str, at: pa.DataType, convert: Callable[[Any, str], Any]
           ) -> pa.Array | None:
    """One column: column-wise when `_column` takes it, else value by value with
    `convert`; None when a value does not fit."""
    try:
        col = _column(values, t, at)
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        col = None
    if col is None:
        try:
            col = pa.array([convert(v, t) for v in values], at)
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            return None
    return col


def _column(values: list[Any], t: str, at: pa.DataType) -> pa.Array | None:
    """The column in one pyarrow conversion when its values' Python types make that equal
    to `avro_value` value by value then `pa.array` (the slow path); else None."""
    kinds = set(map(type, values))
    kinds.discard(type(None))
    if t in ("long", "int"):  # pyarrow refuses what does not fit (then the slow path)
        return pa.array(values, at) if kinds <= {int} else None
    if t == "double":
        return pa.array(values, at) if kinds <= {int, float} else None
    if t == "float":
        if not kinds <= {float}:
            return None
        wide = pa.array(values, pa.float64())
        big = pc.and_(pc.is_finite(wide), pc.greater(pc.abs(wide), 3.4028234663852886e38))
        return None if pc.any(big).as_py() else pa.array(values, at)
    if t == "boolean":
        return pa.array(values, at) if kinds <= {bool} else None
    if t == "string":
        if not kinds <= {str}:
            return None
        arr = pa.array(values, at)  # a lone surrogate raises
        return None if pc.any(pc.match_substring(arr, "\x00")).as_py() else arr
    if t == "uuid":
        if not kinds <= {uuid.UUID}:
            return None
        return pa.array([None if v is None else str(v) for v in values], at)
    if t == "timestamp":  # a naive datetime (local-timestamp-*) as UTC, as avro_value
        return pa.array(values, at) if kinds <= {datetime} else None
    if t == "date":
        return pa.array(values, at) if kinds <= {date} else None
    if t.startswith("decimal("):
        # pyarrow rescales only without loss and refuses more digits than the precision:
        # what it takes equals `decimal_value`'s half-up quantize
        return pa.array(values, at) if kinds <= {Decimal} else None
    if t == "json":
        return pa.array([None if v is None else _json(v) for v in values], at)
    return None


def _json(v: Any) -> str:
    """`json_text`, without its walk of the value when JSON takes the value as it is (no
    bytes, decimals, dates, UUIDs or non-finite floats inside)."""
    try:
        text = json.dumps(v, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError):
        return json_text(v)
    if "\\u0000" in text:  # NUL, or what looks like json_text's decimal marker
        return json_text(v)
    return text_value(text)
