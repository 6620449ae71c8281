"""A Kafka sink's JSON record values built in the task, byte for byte as PostgreSQL's
`row_to_json` builds them from the stage under the sink's `OUTPUT_SETTINGS` (TimeZone UTC,
extra_float_digits 3): so a record produced from a task file reads the same as one produced
from the stage (issue 32).

Column-wise in Arrow's kernels; the few values whose text Arrow does not write as
PostgreSQL does (a float in exponent form or outside [1e-4, 1e15), NaN and the infinities, a
string with a control character) are written per value by the rules of PostgreSQL's
`float8out`/`float4out` (src/common/d2s.c, f2s.c: shortest exact digits, fixed notation for
decimal exponents in [-4, 15) resp. [-4, 6), else d.ddde±XX) and `escape_json`.
`json_values` returns None for a column type it does not build (jsonb, numeric, bytea,
interval, ...) or a timestamp outside years 1-9999: the driver stages a batch with such a
column in PostgreSQL, as before (decided before the read), and a task makes the records
with such a timestamp bad records (`unbuildable`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from offsetflow.config import KafkaSinkConfig
from offsetflow.sinks.kafka.form import key_source, payload_columns
from offsetflow.stage import stage_form

# PostgreSQL type of a stage column -> how its JSON text is built here
_INTS = frozenset({"smallint", "integer", "bigint"})
_FLOATS = {"double precision": 15, "real": 6}  # fixed notation below 10**this
BUILT_TYPES = frozenset({"text", "boolean", "timestamptz", "timestamp", "date",
                         *_INTS, *_FLOATS})
_CONTROL = r"[\x00-\x1f]"
# PostgreSQL's identifiers (NAMEDATALEN - 1): a longer column name is truncated in the stage,
# so in row_to_json's keys; the builder writes names as given, so only up to this
NAME_BYTES = 63


def builds(columns: Mapping[str, str], value_columns: Sequence[str]) -> bool:
    """Whether every value column is of a type built here (else the stage path builds)."""
    return all(columns[c] in BUILT_TYPES for c in value_columns)


def json_values(batch: pa.RecordBatch, value_columns: Sequence[str],
                columns: Mapping[str, str]) -> pa.Array | None:
    """Each row's JSON value (binary; NULL where the source value is NULL: a tombstone),
    or None where a value is one this module does not build (see the module doc)."""
    pieces: list[pa.Array | pa.Scalar] = []
    for i, name in enumerate(value_columns):
        text = _column_json(batch.column(name), columns[name])
        if text is None:
            return None
        pieces.append(pa.scalar(("{" if i == 0 else ",") + json.dumps(name, ensure_ascii=False)
                                + ":"))
        pieces.append(text)
    pieces.append(pa.scalar("}"))
    if len(pieces) == 1:
        return None
    joined = pc.binary_join_element_wise(*pieces, "")
    if len(value_columns) and not isinstance(joined, pa.Array):
        joined = pa.array([joined.as_py()] * batch.num_rows, pa.string())
    if "value" in batch.schema.names:
        joined = pc.if_else(pc.is_null(batch.column("value")),
                            pa.scalar(None, pa.string()), joined)
    return joined.cast(pa.binary())


def _column_json(col: pa.Array, pg_type: str) -> pa.Array | None:
    """One column's JSON text per row ('null' for NULL), or None (not built here)."""
    if pg_type not in BUILT_TYPES:
        return None
    if pg_type == "text":
        s = col.cast(pa.string())
        quoted = pc.binary_join_element_wise(
            "\"", pc.replace_substring(pc.replace_substring(s, "\\", "\\\\"), "\"", "\\\""),
            "\"", "")
        ctl = pc.match_substring_regex(s, _CONTROL)
        if pc.any(ctl).as_py():
            quoted = _patch(quoted, ctl, s, _text_json)
    elif pg_type in _INTS or pg_type == "boolean":
        quoted = col.cast(pa.string())
    elif pg_type in _FLOATS:
        fixed_below = 10.0 ** _FLOATS[pg_type]
        f = col.cast(pa.float64())
        quoted = f.cast(pa.string()) if pg_type == "double precision" else col.cast(
            pa.string())
        mag = pc.abs(f)
        odd = pc.or_kleene(pc.or_kleene(
            pc.match_substring(quoted, "e"),
            pc.or_kleene(pc.greater_equal(mag, fixed_below),
                         pc.and_kleene(pc.less(mag, 1e-4), pc.not_equal(mag, 0.0)))),
            pc.or_kleene(pc.is_nan(f), pc.is_inf(f)))
        odd = pc.fill_null(odd, False)
        if pc.any(odd).as_py():
            quoted = _patch(quoted, odd, col,
                            lambda v: _float_json(v, pg_type == "real"))
    elif pg_type in ("timestamptz", "timestamp"):
        us = col.cast(pa.timestamp("us", "UTC" if pg_type == "timestamptz" else None))
        lo, hi = pc.min_max(us.cast(pa.int64())).values()
        if lo.is_valid and (lo.as_py() < _YEAR1_US or hi.as_py() >= _YEAR10000_US):
            return None
        # "YYYY-MM-DD HH:MM:SS.ffffff" (4-digit years: checked above), as PostgreSQL
        # writes it: a T, the fraction without its trailing zeros, none when it is zero
        # (slices and a trim: several times cheaper than strftime and a regex)
        iso = us.cast(pa.timestamp("us")).cast(pa.string())
        secs = pc.utf8_replace_slice(pc.utf8_slice_codeunits(iso, 0, 19), 10, 11, "T")
        frac = pc.utf8_rtrim(pc.utf8_slice_codeunits(iso, 20, 26), characters="0")
        text = pc.binary_join_element_wise(
            secs, pc.if_else(pc.equal(frac, ""), "",
                             pc.binary_join_element_wise(".", frac, "")), "")
        suffix = "+00:00\"" if pg_type == "timestamptz" else "\""
        quoted = pc.binary_join_element_wise("\"", text, suffix, "")
    else:  # date
        d = col.cast(pa.date32())
        lo, hi = pc.min_max(d.cast(pa.int32())).values()
        if lo.is_valid and (lo.as_py() < _YEAR1_DAYS or hi.as_py() >= _YEAR10000_DAYS):
            return None
        quoted = pc.binary_join_element_wise("\"", d.cast(pa.string()), "\"", "")
    return pc.fill_null(quoted.cast(pa.string()), "null")


_YEAR1_US = -62_135_596_800_000_000  # 0001-01-01T00:00:00Z
_YEAR10000_US = 253_402_300_800_000_000  # 10000-01-01T00:00:00Z
_YEAR1_DAYS = -719_162
_YEAR10000_DAYS = 2_932_897


def _patch(text: pa.Array, mask: pa.Array, source: pa.Array, fmt: object) -> pa.Array:
    """`text` with the masked rows written by `fmt` from `source`'s values (rare rows)."""
    out = text.to_pylist()
    src = source.to_pylist()
    for i, m in enumerate(mask.to_pylist()):
        if m and src[i] is not None:
            out[i] = fmt(src[i])  # type: ignore[operator]
    return pa.array(out, pa.string())


def _text_json(s: str) -> str:
    """PostgreSQL's escape_json: \\b \\f \\n \\r \\t, other control characters \\u00xx,
    quote and backslash escaped, everything else (non-ASCII too) as is: json.dumps'."""
    return json.dumps(s, ensure_ascii=False)


def _float_json(v: float, single: bool) -> str:
    """A float's JSON text as PostgreSQL writes it (float8out/float4out, shortest exact)."""
    if math.isnan(v):
        return "\"NaN\""
    if math.isinf(v):
        return "\"Infinity\"" if v > 0 else "\"-Infinity\""
    if v == 0:
        return "-0" if math.copysign(1.0, v) < 0 else "0"
    if single:
        import numpy as np

        r = np.format_float_scientific(np.float32(v), unique=True, trim="-")
    else:
        r = repr(v)
    sign = "-" if r.startswith("-") else ""
    r = r.lstrip("-")
    mant, _, exp_s = r.partition("e")
    exp = int(exp_s) if exp_s else 0
    if "." in mant:
        ip, fp = mant.split(".")
    else:
        ip, fp = mant, ""
    digits = (ip + fp).lstrip("0")
    # decimal exponent of the first significant digit
    lead = len(ip.lstrip("0")) - 1 if ip.strip("0") else -(len(fp) - len(fp.lstrip("0")) + 1)
    exp10 = exp + lead
    digits = digits.rstrip("0") or "0"
    if -4 <= exp10 < (6 if single else 15):
        if exp10 >= 0:
            whole = digits[:exp10 + 1].ljust(exp10 + 1, "0")
            frac = digits[exp10 + 1:]
            return sign + whole + ("." + frac if frac else "")
        return sign + "0." + "0" * (-exp10 - 1) + digits
    m = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{m}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"


def unbuildable(sink: KafkaSinkConfig, columns: Mapping[str, str],
                batch: pa.RecordBatch) -> dict[int, str]:
    """The rows whose record cannot be built here though their columns' types are (a
    timestamp or date outside years 1-9999 in a column the sink reads: the readers refuse
    them first today), each with why: the task makes them bad records, so one such value
    never fails the task on every attempt (review s39-kfiles item 9)."""
    key_col, _ = key_source(sink, columns)
    read = ([sink.value_column] if sink.value_format == "raw" else
            list(sink.value_columns) or payload_columns(list(columns)))
    out: dict[int, str] = {}
    for name in dict.fromkeys([*read, *([key_col] if key_col else [])]):
        pg_type = columns[name]
        if pg_type in ("timestamptz", "timestamp"):
            v = batch.column(name).cast(pa.timestamp("us")).cast(pa.int64())
            lo, hi = _YEAR1_US, _YEAR10000_US
        elif pg_type == "date":
            v = batch.column(name).cast(pa.date32()).cast(pa.int32())
            lo, hi = _YEAR1_DAYS, _YEAR10000_DAYS
        else:
            continue
        outside = pc.fill_null(pc.or_(pc.less(v, lo), pc.greater_equal(v, hi)), False)
        if not pc.any(outside).as_py():
            continue
        for i in pc.indices_nonzero(outside).to_pylist():
            out.setdefault(i, f"kafka sink task files: column {name!r} ({pg_type}) holds a "
                              f"value outside years 1-9999, which the task does not write "
                              f"as PostgreSQL would")
    return out


def finished_records(sink: KafkaSinkConfig, columns: Mapping[str, str],
                     batch: pa.RecordBatch) -> pa.RecordBatch | None:
    """A stage-form batch's records as the produce loop takes them (`taskfile.FILE_SCHEMA`),
    each field as the sink's stage query (`form.select_sql`) gives it: the key's bytes (a
    bytea as is, text as UTF-8, else its JSON scalar text), the value (JSON as
    `json_values`, or the raw value column's bytes; a tombstone a NULL value), the
    staged headers as JSON text when carried, the timestamp in epoch ms rounded half away
    from zero (`(extract(epoch ...) * 1000)::bigint`). None: a column the sink reads is of
    a type not built here (the stage path builds those records)."""
    key_col, _ = key_source(sink, columns)
    key = (pa.nulls(batch.num_rows, pa.binary()) if key_col is None
           else _scalar_bytes(batch.column(key_col), columns[key_col]))
    if sink.value_format == "raw":
        value = _scalar_bytes(batch.column(sink.value_column), columns[sink.value_column])
    else:
        value = json_values(batch, list(sink.value_columns)
                            or payload_columns(list(columns)), columns)
    if key is None or value is None:
        return None
    if sink.headers == "carry" and "headers" in columns:
        h = batch.column("headers")
        headers = h.cast(pa.string()) if pa.types.is_string(h.type) else stage_form(
            pa.RecordBatch.from_arrays([h], names=["headers"])).column(0)
    else:
        headers = pa.nulls(batch.num_rows, pa.string())
    if columns.get("timestamp", "").startswith("timestamp"):
        us = batch.column("timestamp").cast(pa.timestamp("us")).cast(pa.int64())
        ms = pc.multiply(pc.sign(us), pc.divide(pc.add(pc.abs(us), 500), 1000))
    else:
        ms = pa.nulls(batch.num_rows, pa.int64())
    return pa.RecordBatch.from_arrays(
        [batch.column("topic").cast(pa.string()), batch.column("partition").cast(pa.int32()),
         batch.column("offset").cast(pa.int64()), key, value, headers, ms.cast(pa.int64())],
        names=["topic", "partition", "offset", "key", "value", "headers", "ts"])


def _scalar_bytes(col: pa.Array, pg_type: str) -> pa.Array | None:
    """A column as record bytes (`form._as_bytes`): bytea as is, text as UTF-8, else its JSON
    scalar text without quotes (`to_json(x) #>> '{}'`); None: not built here."""
    if pg_type == "bytea":
        return col.cast(pa.binary())
    if pg_type == "text":
        return col.cast(pa.string()).cast(pa.binary())
    text = _column_json(col, pg_type)
    if text is None:
        return None
    # NULL stays NULL (not 'null'); a quoted scalar (a timestamp, a date, NaN) unquoted
    text = pc.if_else(pc.is_null(col), pa.scalar(None, pa.string()), text)
    unquoted = pc.utf8_slice_codeunits(text, 1, -1)
    text = pc.if_else(pc.starts_with(text, "\""), unquoted, text)
    return text.cast(pa.binary())
