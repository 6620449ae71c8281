"""Nested values (a `json` column staged as JSON text) as the Iceberg table's struct, list
and map columns.

The decoders stage a record, array or map field as its JSON text (`source.json_text`:
decimals with every digit, dates and timestamps in ISO-8601, bytes as base64). Where the
table's column is a struct, list or map (a table this OffsetFlow created from the reader
schema, `source.avro_nested_types`), the text is parsed into that type here, value by
value; where it is a string (a table created before, or by hand) the text is written as it
is, so nothing changes under a running pipeline.

A value that does not fit the table's type (a decimal with more digits than its column
has, a null in a required field, a field the table's struct lacks) refuses that record
only: its row index and why, for the caller to make it a dead letter with its coordinates.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, time
from decimal import Decimal, InvalidOperation, localcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from offsetflow.errors import SchemaMismatchError

if TYPE_CHECKING:
    from pyiceberg.schema import Schema
    from pyiceberg.types import IcebergType


def is_nested(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) or _is_list(t) or pa.types.is_map(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def nested_from_json(texts: pa.Array | pa.ChunkedArray, typ: pa.DataType, column: str,
                     protobuf: bool = False) -> tuple[pa.Array, dict[int, str]]:
    """Each JSON text of `texts` as a value of `typ` (nested). Returns the array (a refused
    row is null in it) and the refused rows: index -> why, naming the column and the path
    inside it. `protobuf`: the texts are Protobuf's JSON mapping (`json_mapping_number`);
    other formats' strings are never read as numbers."""
    values: list[Any] = []
    refused: dict[int, str] = {}
    for i, text in enumerate(texts.to_pylist()):
        if text is None:
            values.append(None)
            continue
        try:
            doc = json.loads(text, parse_float=Decimal)
            values.append(_value(doc, typ, column, protobuf))
        except (ValueError, TypeError, OverflowError, InvalidOperation,
                binascii.Error) as e:
            refused[i] = f"column {column!r}: {e}"
            values.append(None)
    try:
        return pa.array(values, type=typ), refused
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        pass
    # something Arrow refuses that the checks above let through: find the rows one by one
    out: list[Any] = []
    for i, v in enumerate(values):
        try:
            pa.array([v], type=typ)
            out.append(v)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            refused[i] = f"column {column!r}: {e}"
            out.append(None)
    return pa.array(out, type=typ), refused


def rows_fit(table_types: Sequence[tuple[str, pa.DataType]], columns: dict[str, pa.Array],
             protobuf: bool = False) -> tuple[dict[str, pa.Array], dict[int, str]]:
    """`columns` (name -> staged column) with every string column whose table type is
    nested parsed into it; the refused rows (index -> why; the first reason a row has)."""
    refused: dict[int, str] = {}
    out = dict(columns)
    for name, typ in table_types:
        col = columns.get(name)
        if col is None or not is_nested(typ) or not (
                pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            continue
        arr, bad = nested_from_json(col, typ, name, protobuf)
        out[name] = arr
        for i, why in bad.items():
            refused.setdefault(i, why)
    return out, refused


def keep_mask(n: int, refused: dict[int, str]) -> pa.Array:
    """True for the rows not refused."""
    keep = np.ones(n, dtype=bool)
    keep[list(refused)] = False
    return pa.array(keep)


def _value(v: Any, t: pa.DataType, path: str, pb: bool) -> Any:
    if v is None:
        return None
    if pa.types.is_struct(t):
        if not isinstance(v, dict):
            raise ValueError(f"{path}: expected a record, got {type(v).__name__}")
        names = {t.field(i).name for i in range(t.num_fields)}
        extra = sorted(set(v) - names)
        if extra:
            raise ValueError(f"{path}: field(s) {extra} are not in the Iceberg table's "
                             f"struct (its fields: {sorted(names)})")
        out = {}
        for i in range(t.num_fields):
            f = t.field(i)
            x = v.get(f.name)
            if x is None and not f.nullable:
                raise ValueError(f"{path}.{f.name} is null, but the Iceberg table's field "
                                 f"is required")
            out[f.name] = _value(x, f.type, f"{path}.{f.name}", pb)
        return out
    if _is_list(t):
        if not isinstance(v, list):
            raise ValueError(f"{path}: expected an array, got {type(v).__name__}")
        f = t.value_field
        if not f.nullable and any(x is None for x in v):
            raise ValueError(f"{path}[{v.index(None)}] is null, but the Iceberg table's "
                             f"list element is required")
        return [_value(x, f.type, f"{path}[{j}]", pb) for j, x in enumerate(v)]
    if pa.types.is_map(t):
        if not isinstance(v, dict):
            raise ValueError(f"{path}: expected a map, got {type(v).__name__}")
        f = t.item_field
        out_items = []
        for k, x in v.items():
            if x is None and not f.nullable:
                raise ValueError(f"{path}[{k!r}] is null, but the Iceberg table's map "
                                 f"value is required")
            out_items.append((_value(k, t.key_type, f"{path} key", pb),
                              _value(x, f.type, f"{path}[{k!r}]", pb)))
        return out_items
    return _scalar(v, t, path, pb)


def _scalar(v: Any, t: pa.DataType, path: str, pb: bool) -> Any:
    if pb:  # a string is a number in Protobuf's JSON mapping only ("02134" stays a string)
        v = json_mapping_number(v, t)
    if pa.types.is_decimal(t):
        if isinstance(v, bool) or not isinstance(v, (int, Decimal)):
            raise ValueError(f"{path}: expected a decimal, got {v!r}")
        with localcontext() as ctx:
            ctx.prec = 2 * t.precision + 2  # quantize never rounds here, nor raises
            return _decimal(Decimal(v), t, path)
    return _other(v, t, path)


_JSON_INT = re.compile(r"-?[0-9]+")
_NON_FINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def json_mapping_number(v: Any, t: pa.DataType) -> Any:
    """Protobuf's JSON mapping (the staged text of a Protobuf message) writes 64-bit
    integers and integer map keys as strings, and non-finite floats as "NaN", "Infinity",
    "-Infinity": the number they name where the column is one; anything else as it is."""
    if isinstance(v, str):
        if pa.types.is_integer(t) and _JSON_INT.fullmatch(v):
            return int(v)
        if pa.types.is_floating(t) and v in _NON_FINITE:
            return _NON_FINITE[v]
    return v


def exact_double(v: int | Decimal, path: str) -> float:
    """A JSON number (every digit its producer wrote: `parse_float=Decimal`) as the double
    it names, when no digit is lost on the way: the double is the number itself, or reads
    as it when written with as many significant digits (`0.1`, or `0.10000000000000001` as
    a `%.17g` producer writes the same double). A number the double would round (2**53 + 1,
    a 20-digit price) or that is beyond its range is refused (its record: a dead letter),
    never landed changed; Avro's and Protobuf's doubles are written shortest, so they all
    pass."""
    d = Decimal(v)
    try:
        f = float(d)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ValueError(f"{path}: {v} is beyond the range of a double")
    if Decimal(f) == d:
        return f
    digits = len(d.normalize().as_tuple().digits)
    if digits <= 17 and Decimal(format(f, f".{digits}g")) == d:  # noqa: PLR2004 - a double's
        return f
    raise ValueError(f"{path}: {v} has more digits than a double holds (it would land as "
                     f"{f!r}); declare the field a decimal-typed string, or write fewer digits")


def _decimal(d: Decimal, t: pa.Decimal128Type, path: str) -> Decimal:
    if not d.is_finite():
        raise ValueError(f"{path}: {d} is not a finite decimal")
    if d and d.adjusted() >= t.precision - t.scale:
        raise ValueError(f"{path}: {d} does not fit in decimal({t.precision},{t.scale}) (at "
                         f"most {t.precision - t.scale} digits before the point)")
    q = d.quantize(Decimal(1).scaleb(-t.scale))
    if q != d:
        raise ValueError(f"{path}: {d} has more than {t.scale} digits after the point (the "
                         f"Iceberg column is decimal({t.precision},{t.scale}))")
    return q


def _other(v: Any, t: pa.DataType, path: str) -> Any:  # noqa: PLR0911 - one per type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if not isinstance(v, str):
            raise ValueError(f"{path}: expected a string, got {type(v).__name__}")
        return v
    if pa.types.is_boolean(t):
        if not isinstance(v, bool):
            raise ValueError(f"{path}: expected a boolean, got {v!r}")
        return v
    if pa.types.is_integer(t):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{path}: expected an integer, got {v!r}")
        limit = 2 ** (t.bit_width - 1)
        if not -limit <= v < limit:
            raise ValueError(f"{path}: {v} does not fit in {t}")
        return v
    if pa.types.is_floating(t):
        if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)):
            raise ValueError(f"{path}: expected a number, got {v!r}")
        f = v if isinstance(v, float) else exact_double(v, path)
        if pa.types.is_float32(t) and math.isfinite(f) and abs(f) > 3.4028234663852886e38:
            raise ValueError(f"{path}: {v} overflows float")
        return f
    if pa.types.is_timestamp(t):
        if not isinstance(v, str):
            raise ValueError(f"{path}: expected an ISO-8601 timestamp, got {v!r}")
        dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
        return dt if dt.tzinfo else dt.replace(tzinfo=UTC)
    if pa.types.is_date(t):
        if not isinstance(v, str):
            raise ValueError(f"{path}: expected an ISO-8601 date, got {v!r}")
        return date.fromisoformat(v)
    if pa.types.is_time(t):
        if not isinstance(v, str):
            raise ValueError(f"{path}: expected an ISO-8601 time, got {v!r}")
        return time.fromisoformat(v)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or \
            pa.types.is_fixed_size_binary(t):
        if not isinstance(v, str):
            raise ValueError(f"{path}: expected base64 bytes, got {v!r}")
        return base64.b64decode(v, validate=True)
    raise ValueError(f"{path}: no conversion to {t}")


def nested_column_types(format_type: str, columns: Sequence[tuple[str, str]],
                        readers: Mapping[str, tuple[int, str] | None] | None
                        ) -> dict[str, pa.DataType]:
    """The jsonb (format.schema `json`) columns whose reader schema (Avro; Protobuf and
    JSON Schema: the subject's latest), the same in every topic, gives them a struct, list
    or map form: name -> that Arrow type. Other formats (and a topic read with its writer
    schemas) keep JSON text."""
    if not readers:
        return {}
    from offsetflow.source import common_nested_types, nested_types

    json_cols = {c: "json" for c, t in columns if t == "jsonb"}
    if not json_cols or any(r is None for r in readers.values()):
        return {}
    return common_nested_types({topic: nested_types(format_type, r[1], json_cols)
                                for topic, r in readers.items() if r is not None})


def table_nested_types(schema: Schema) -> dict[str, pa.DataType]:
    """The table's struct, list and map columns: name -> Arrow type (with field ids)."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    arrow = schema_to_pyarrow(schema, include_field_ids=True)
    return {f.name: f.type for f in arrow if is_nested(f.type)}


def iceberg_type_of(arrow: pa.DataType) -> IcebergType:
    """An Arrow type (without field ids) as an Iceberg type, ids to be assigned by the
    schema update that adds it."""
    from pyiceberg.catalog import Catalog

    return Catalog._convert_schema_if_needed(  # noqa: SLF001 - pyiceberg's own conversion
        pa.schema([pa.field("x", arrow)])).fields[0].field_type  # type: ignore[union-attr]


def nested_additions(schema: Schema, nested: Mapping[str, pa.DataType]
                     ) -> list[tuple[tuple[str, ...], pa.DataType]]:
    """The fields of the reader's nested types (`nested`: column -> Arrow type) that the
    table's struct, list and map columns lack: (path, Arrow type), outermost first. A
    column the table holds as text, or not at all, adds nothing here."""
    if not nested:
        return []
    have = table_nested_types(schema)
    out: list[tuple[tuple[str, ...], pa.DataType]] = []
    for name, want in nested.items():
        if name in have:
            _missing(have[name], want, (name,), out)
    return out


def _missing(have: pa.DataType, want: pa.DataType, path: tuple[str, ...],
             out: list[tuple[tuple[str, ...], pa.DataType]]) -> None:
    if pa.types.is_struct(have) and pa.types.is_struct(want):
        names = {have.field(i).name: have.field(i) for i in range(have.num_fields)}
        folded = {n.lower(): n for n in names}
        for i in range(want.num_fields):
            w = want.field(i)
            if w.name in names:
                _missing(names[w.name].type, w.type, (*path, w.name), out)
                continue
            # Spark and Trino resolve nested fields without case too (as `evolve` guards a
            # top-level column): one differing from a field there only in case is refused
            clash = folded.get(w.name.lower())
            if clash is not None:
                raise SchemaMismatchError(
                    f"the reader schema's nested field {'.'.join((*path, w.name))!r} differs "
                    f"from the Iceberg table's field {'.'.join((*path, clash))!r} only in "
                    f"case: adding it would make the table ambiguous to engines that "
                    f"resolve names without case (Spark, Trino). Nothing was written; "
                    f"rename the table's field by hand, or rename the field in a new schema "
                    f"version")
            folded[w.name.lower()] = w.name
            out.append(((*path, w.name), w.type))
    elif _is_list(have) and _is_list(want):
        _missing(have.value_type, want.value_type, (*path, "element"), out)
    elif pa.types.is_map(have) and pa.types.is_map(want):
        _missing(have.item_type, want.item_type, (*path, "value"), out)


def nested_relaxations(schema: Schema, nested: Mapping[str, pa.DataType]
                       ) -> list[tuple[tuple[str, ...], IcebergType | None]]:
    """What the table's struct, list and map columns must loosen to take the reader's
    `nested` types (column -> Arrow type) as they are: (path, None) for a required field,
    list element or map value the reader makes optional or no longer has (its records
    carry null there), (path, the wider Iceberg type) for a field the reader promotes
    (int -> long, float -> double, a decimal's precision at the same scale). Without it a
    null the reader allows is a dead letter, and a double is cut to the table's float."""
    out: list[tuple[tuple[str, ...], IcebergType | None]] = []
    if not nested:
        return out
    from pyiceberg.types import ListType, MapType, StructType

    for name, want in nested.items():
        try:
            have = schema.find_field(name).field_type
        except ValueError:
            continue
        if isinstance(have, (StructType, ListType, MapType)):
            _loosen(have, iceberg_type_of(want), (name,), out)
    return out


def _loosen(have: IcebergType, want: IcebergType, path: tuple[str, ...],
            out: list[tuple[tuple[str, ...], IcebergType | None]]) -> None:
    from pyiceberg import types as t

    if isinstance(have, t.StructType) and isinstance(want, t.StructType):
        wanted = {f.name: f for f in want.fields}
        for h in have.fields:
            w = wanted.get(h.name)
            if h.required and (w is None or not w.required):
                out.append(((*path, h.name), None))
            if w is not None:
                _loosen(h.field_type, w.field_type, (*path, h.name), out)
    elif isinstance(have, t.ListType) and isinstance(want, t.ListType):
        if have.element_required and not want.element_required:
            out.append(((*path, "element"), None))
        _loosen(have.element_type, want.element_type, (*path, "element"), out)
    elif isinstance(have, t.MapType) and isinstance(want, t.MapType):
        if have.value_required and not want.value_required:
            out.append(((*path, "value"), None))
        _loosen(have.value_type, want.value_type, (*path, "value"), out)
    elif _promotes(have, want):
        out.append((path, want))


def _promotes(have: IcebergType, want: IcebergType) -> bool:
    """Iceberg's in-place promotions (as `evolve` makes them for a top-level column)."""
    from pyiceberg import types as t

    if isinstance(have, t.IntegerType) and isinstance(want, t.LongType):
        return True
    if isinstance(have, t.FloatType) and isinstance(want, t.DoubleType):
        return True
    return (isinstance(have, t.DecimalType) and isinstance(want, t.DecimalType)
            and have.scale == want.scale and want.precision > have.precision)


def check_nested(table_name: str, schema: Schema, nested: Mapping[str, pa.DataType],
                 batch_id: int) -> None:
    """Fields the reader schema has inside a nested column and the table's `schema` (with
    format.schema_evolution's update staged, which adds them under `add_columns`) lacks are
    never dropped, and a field the reader makes optional or wider is never a dead letter
    per null or a value cut to the narrower type (`nested_relaxations`; the update loosens
    them under `add_columns`): SchemaMismatchError naming them, before the tasks write."""
    missing = nested_additions(schema, nested)
    loose = nested_relaxations(schema, nested)
    if loose and not missing:
        what = ", ".join(f"{'.'.join(p)} ({'optional' if t is None else t})"
                         for p, t in loose)
        raise SchemaMismatchError(
            f"batch {batch_id}: the reader schema makes nested field(s) of Iceberg "
            f"table {table_name} optional or wider: {what}; the table's types would refuse "
            f"its nulls or cut its values. Nothing was written. Set "
            f"format.schema_evolution: add_columns (the batch's commit loosens them), or "
            f"change them by hand (e.g. Spark ALTER TABLE {table_name} ALTER COLUMN "
            f"{'.'.join(loose[0][0])} DROP NOT NULL / TYPE ...), or (Avro) pin "
            f"format.schema_registry.reader_version to the version the table was made from")
    if not missing:
        return
    what = ", ".join(f"{'.'.join(p)} ({t})" for p, t in missing)
    raise SchemaMismatchError(
        f"batch {batch_id}: the reader schema has nested field(s) {what} that Iceberg "
        f"table {table_name} does not have; their values would be lost. Nothing was "
        f"written. Set format.schema_evolution: add_columns (the batch's commit adds them), "
        f"or add them to the table by hand (e.g. Spark ALTER TABLE {table_name} ADD COLUMN "
        f"{'.'.join(missing[0][0])} ...), or (Avro) pin format.schema_registry.reader_version to "
        f"the version the table was made from")


def fit_table(data: pa.Table, schema: Schema, table_name: str, protobuf: bool = False
              ) -> tuple[pa.Table, dict[tuple[str, int, int], str]]:
    """Staged rows (`data`, read as the stage holds them: nested values as JSON text) with
    the table's struct, list and map columns parsed into their types; the rows that do not
    fit are taken out: (topic, partition, offset) -> why."""
    nested = table_nested_types(schema)
    if not nested or not data.num_rows:
        return data, {}
    cols = {n: data.column(n).combine_chunks() for n in data.column_names}
    fitted, refused = rows_fit(list(nested.items()), cols, protobuf)
    out = pa.table([fitted[n] for n in data.column_names], names=data.column_names)
    if not refused:
        return out, {}
    idx = sorted(refused)
    coords = data.select(["topic", "partition", "offset"]).take(pa.array(idx)).to_pylist()
    bad = {(c["topic"], int(c["partition"]), int(c["offset"])):
           f"iceberg {table_name}: {refused[i]}" for i, c in zip(idx, coords, strict=True)}
    return out.filter(keep_mask(data.num_rows, refused)), bad
