"""Pure rules of the Kafka topic sink (`offsetflow.sink_kafka` does the I/O).

- Names (`CommitMark`): the `transactional.id` and the consumer group a batch's transaction
  commits its source positions to, per pipeline and ledger. Live batches share the
  pipeline's (stable across attempts, so `init_transactions` of a newer attempt fences a
  zombie of an older one); a replay or backfill batch has its own, so it neither fences the
  live run nor overwrites the live batch's record of its commit. The groups are
  `offsetflow-sink-...`, never the lag publisher's `offsetflow-<pipeline>`.
- The record of a commit: each committed offset carries `CommitMark.metadata` (pipeline,
  batch id, ledger, output topic), so `find` tells this batch's commit from any other (an
  earlier batch that ended at the same offset after a position reset, a replay of the same
  range, another ledger's batch of the same number).
- What a staged row becomes: one SELECT (`select_sql`) lets PostgreSQL build key and value
  bytes per chunk, in offset order, so the driver's per-row work is one `produce` call.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from psycopg2 import sql

from offsetflow.config_schema import RESERVED_COLUMNS, KafkaSinkConfig
from offsetflow.errors import ConfigError, KafkaSinkError
from offsetflow.ledger_batch import Batch

BATCH_HEADER = "offsetflow.batch"
SOURCE_HEADER = "offsetflow.source"  # topic/partition/offset of the source record
_NOT_PRODUCED = "not_produced="
# sizes as the producer and broker count them (librdkafka's worst-case v2 record overhead;
# per header two varints; a record batch's header, which the topic's limit includes)
RECORD_OVERHEAD = 36
HEADER_OVERHEAD = 10
BATCH_OVERHEAD = 61
PRODUCER_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes
# the broker refuses offset metadata over offset.metadata.max.bytes (4096 by default)
METADATA_MAX_BYTES = 4000


@dataclass(frozen=True)
class NotProduced:
    """A staged row the output topic can never take: over the record size limit (`size`),
    or without a key for a compacted topic (`size` None). It goes to the dead-letter table
    and into the commit's offset metadata, never into the topic."""

    topic: str
    partition: int
    offset: int
    size: int | None

    def error(self, out: str, limit: int | None) -> str:
        if self.size is None:
            return (f"kafka sink: not produced to {out}: a record without a key, and {out} "
                    f"is compacted (cleanup.policy=compact), which refuses keyless records")
        over = f" over the limit of {limit} bytes" if limit else " over the record size limit"
        return (f"kafka sink: not produced to {out}: the record is {self.size} bytes,{over} "
                f"(the producer's message.max.bytes, sink.producer, and the topic's "
                f"max.message.bytes)")


def record_limit(producer: Mapping[str, Any], topic_max: int | None) -> int:
    """The largest record the sink can produce to the topic: the producer's
    message.max.bytes, and the topic's max.message.bytes unless records are compressed
    (the broker counts compressed batches; the producer still refuses at its own limit)."""
    limit = int(producer.get("message.max.bytes", PRODUCER_MAX_BYTES))
    compressed = str(producer.get("compression.type",
                                  producer.get("compression.codec", "none"))) != "none"
    if topic_max is not None and not compressed:
        limit = min(limit, topic_max - BATCH_OVERHEAD)
    return limit


def record_size(key: bytes | None, value: bytes | str | None,
                headers: Sequence[tuple[str, bytes | str | None]]) -> int:
    """An upper bound of a record's size as librdkafka checks it against message.max.bytes
    (a str as its UTF-8 bytes)."""
    return (RECORD_OVERHEAD + _len(key) + _len(value)
            + sum(HEADER_OVERHEAD + len(k.encode()) + _len(v) for k, v in headers))


def _len(v: bytes | str | None) -> int:
    return 0 if v is None else len(v.encode()) if isinstance(v, str) else len(v)


def is_live(batch: Batch) -> bool:
    return batch.moves_positions and batch.kind == "scheduled"


@dataclass(frozen=True)
class CommitMark:
    """Whose commit a committed offset records: the pipeline, the ledger
    (`offsetflow.ledger_identity`) and the output topic. Two ledgers running a pipeline of
    the same name on one cluster have their own transactional.id and group and never match
    each other's offsets. `ledger` None: the format before the ledger identity (pipeline and
    batch only), looked up for batches planned before it (`legacy`)."""

    pipeline: str
    ledger: str | None
    topic: str | None

    @staticmethod
    def legacy(pipeline: str) -> CommitMark:
        return CommitMark(pipeline, None, None)

    def _base(self, batch: Batch) -> str:
        base = f"offsetflow-sink-{self.pipeline}"
        if self.ledger is not None:
            base = f"{base}.{self.ledger}"
        return base if is_live(batch) else f"{base}-{batch.kind}-{batch.batch_id}"

    def transactional_id(self, batch: Batch) -> str:
        """Stable across a live batch's attempts (`init_transactions` of a newer attempt
        fences a zombie of an older one); a replay's own."""
        return self._base(batch)

    def group(self, batch: Batch) -> str:
        """The group the batch's transaction commits its until positions to (KIP-98)."""
        return self._base(batch)

    def metadata(self, batch_id: int, skipped: Sequence[NotProduced] = (),
                 records: int | None = None) -> str:
        """The batch's mark on each committed offset; with the partition's staged records
        (`records`: the ledger's counts when `offsetflow complete` takes the batch from this
        record, its stage gone) and those the topic could not take (so a run that finds the
        commit routes the same ones)."""
        base = f"offsetflow pipeline={self.pipeline} batch={batch_id}"
        if self.ledger is not None:
            base = f"{base} ledger={self.ledger} topic={self.topic}"
            if records is not None:
                # glued to the topic (no Kafka topic name holds a comma): a release before
                # the count reads `topic=<t>,records=<n>` as another topic and refuses the
                # batch (naming both) after a downgrade, never takes it for uncommitted
                base = f"{base},records={records}"
        if not skipped:
            return base
        return f"{base} {_NOT_PRODUCED}" + ",".join(
            f"{s.offset}:{'nullkey' if s.size is None else s.size}" for s in skipped)


# pipeline names have no blanks, Kafka topic names neither (legal: [a-zA-Z0-9._-])
_METADATA_RE = re.compile(r"offsetflow pipeline=(\S+) batch=(\d+)"
                          r"(?: ledger=(\S+) topic=([^\s,]+)(?:,records=(\d+))?)?"
                          r"(?: " + _NOT_PRODUCED + r"(\S*))?")


@dataclass(frozen=True)
class _Meta:
    pipeline: str
    batch_id: int
    ledger: str | None
    topic: str | None
    records: int | None  # None: committed before the count was recorded
    not_produced: str | None


def _parse(meta: str | None) -> _Meta | None:
    m = _METADATA_RE.fullmatch(meta or "")
    if m is None:
        return None
    return _Meta(m[1], int(m[2]), m[3], m[4], None if m[5] is None else int(m[5]), m[6])


def output_topic(sink: KafkaSinkConfig, batch: Batch, source_file: str) -> str:
    """The live topic for live batches; a replay or backfill goes to `replay_topic` only:
    written to the live topic it would put its records there a second time."""
    if is_live(batch):
        return sink.topic
    if sink.replay_topic is None:
        raise ConfigError(
            source_file, "sink.replay_topic",
            f"batch {batch.batch_id} is a {batch.kind} of offsets the pipeline already wrote "
            f"to its live output topic {sink.topic}; writing them there again would "
            f"duplicate them (Kafka cannot delete records). Name a side topic in "
            f"sink.replay_topic and run the batch again, or abandon it")
    return sink.replay_topic


def replay_target(sink: KafkaSinkConfig | None, table: str) -> str:
    """What a replay or backfill batch records as its target (assets and lineage name it):
    the side topic it writes to, not the live one (`table`, `kafka:<topic>`)."""
    if sink is None or sink.replay_topic is None:
        return table
    return f"kafka:{sink.replay_topic}"


def committed_state(batch: Batch, mark: CommitMark,
                    found: Mapping[tuple[str, int], tuple[int, str | None]]) -> bool:
    """Whether the group's committed offsets are this batch's commit: every non-empty range
    at its `until_offset` with this batch's metadata of this ledger (True), none of them
    (False). Anything in between is not a state one Kafka transaction leaves: refused,
    naming the group. This ledger's commit of the batch to another topic than `mark`'s
    (sink.topic changed between attempts) is refused too: producing it again would put the
    batch in two topics, completing the ledger would name the wrong one."""

    def hit(got: tuple[int, str | None] | None, until: int) -> bool:
        meta = _parse(got[1]) if got is not None and got[0] == until else None
        if meta is None or (meta.pipeline, meta.batch_id, meta.ledger) != (
                mark.pipeline, batch.batch_id, mark.ledger):
            return False
        if meta.topic != mark.topic:
            raise KafkaSinkError(
                f"batch {batch.batch_id} is committed in Kafka to topic {meta.topic}, but the "
                f"config now writes it to {mark.topic}; restore sink.topic (or "
                f"sink.replay_topic) to {meta.topic} to complete the batch in the ledger: "
                f"producing it again would put its records in both topics")
        return True

    ranges = [r for r in batch.ranges if r.until_offset > r.from_offset]
    hits = [hit(found.get(r.topic_partition), r.until_offset) for r in ranges]
    if ranges and all(hits):
        return True
    if not any(hits):
        return False
    missing = [f"{r.topic}[{r.partition}]" for r, h in zip(ranges, hits, strict=True) if not h]
    raise KafkaSinkError(
        f"batch {batch.batch_id}: the sink's consumer group {mark.group(batch)} holds this "
        f"batch's committed offsets for some partitions but not for {missing}; one Kafka "
        f"transaction commits all or none, so the group was changed by hand (or its offsets "
        f"expired). Check the output topic for the batch's records (header "
        f"{BATCH_HEADER}={batch.batch_id}) before abandoning or re-running it")


def commit_batch_ids(found: Mapping[tuple[str, int], tuple[int, str | None]]) -> list[int]:
    """The batch ids the group's committed offsets name (whose commits the ledger may know)."""
    return sorted({m.batch_id for _, raw in found.values() if (m := _parse(raw)) is not None})


def refuse_group_ahead(batch: Batch, mark: CommitMark,
                       found: Mapping[tuple[str, int], tuple[int, str | None]],
                       known: Set[tuple[int, str, int, int]]) -> None:
    """Refuse a batch not committed in Kafka (`committed_state` False) whose group holds,
    above one of its from_offsets, a commit of this ledger the ledger has no record of: a
    batch id that is not one of this ledger's committed ranges there (`known`: batch id,
    topic, partition, until_offset), this batch's own id included. The output topic then
    holds records the ledger does not know: the ledger was restored from a backup or copied
    from another (batch ids and positions rewound under the same identity), and producing
    the batch would put them there twice (review H1). A known batch above from_offset is a
    position moved back on purpose (reset-position after a recreated topic, or allowing
    duplicates); at or below it any id is fine: the previous batch, a skip, a forward reset
    (a restored ledger moved to the group's offsets numbers its batches again)."""
    for r in batch.ranges:  # committed_state was False: no range is at until with this id
        got = found.get(r.topic_partition)
        meta = _parse(got[1]) if got is not None else None
        if got is None or meta is None or r.until_offset <= r.from_offset or (
                meta.pipeline, meta.ledger) != (mark.pipeline, mark.ledger):
            continue
        if got[0] <= r.from_offset or (meta.batch_id, r.topic, r.partition, got[0]) in known:
            continue
        if meta.batch_id != batch.batch_id and not is_live(batch):
            continue  # a replay's group is its own: only its own id is a stale commit there
        raise KafkaSinkError(
            f"pipeline {mark.pipeline} batch {batch.batch_id}: the sink's consumer group "
            f"{mark.group(batch)} holds offset {got[0]} for {r.topic}[{r.partition}], "
            f"committed by batch {meta.batch_id} of this ledger to {meta.topic}, but this "
            f"batch reads from offset {r.from_offset} and the ledger has no record of that "
            f"commit: the ledger was restored from a backup (or copied from another ledger) "
            f"and is behind its output topic, and producing the batch would put records "
            f"there twice. Abandon it (offsetflow abandon --batch-id {batch.batch_id}) and "
            f"move each position to the sink group's offset (offsetflow reset-position "
            f"{mark.pipeline} --topic {r.topic} --partition {r.partition} --offset "
            f"{got[0]}, and so for every partition); if this ledger is a copy, give it its "
            f"own identity instead (see README, 'Two ledgers')")


def not_produced_in(batch: Batch, mark: CommitMark,
                    found: Mapping[tuple[str, int], tuple[int, str | None]]
                    ) -> list[NotProduced]:
    """The records a committed batch's transaction left out (`committed_state` is True)."""
    out: list[NotProduced] = []
    for (topic, partition), (_, raw) in sorted(found.items()):
        meta = _parse(raw)
        if meta is None or not meta.not_produced or (
                meta.pipeline, meta.batch_id, meta.ledger) != (
                mark.pipeline, batch.batch_id, mark.ledger):
            continue
        for item in meta.not_produced.split(","):
            off, size = item.split(":")
            out.append(NotProduced(topic, partition, int(off),
                                   None if size == "nullkey" else int(size)))
    return out


def records_in(batch: Batch, mark: CommitMark,
               found: Mapping[tuple[str, int], tuple[int, str | None]]) -> dict[str, int] | None:
    """A committed batch's staged records per "topic/partition" as its commit recorded
    them (`committed_state` is True); None if a range's commit predates the count."""
    out: dict[str, int] = {}
    for r in batch.ranges:
        if r.until_offset <= r.from_offset:
            continue
        got = found.get(r.topic_partition)
        meta = _parse(got[1]) if got is not None else None
        if meta is None or meta.records is None or (
                meta.pipeline, meta.batch_id, meta.ledger) != (
                mark.pipeline, batch.batch_id, mark.ledger):
            return None
        out[f"{r.topic}/{r.partition}"] = meta.records
    return out


def payload_columns(columns: Sequence[str]) -> list[str]:
    """The columns a JSON value holds by default: all but the source record's own."""
    return [c for c in columns if c not in RESERVED_COLUMNS]


def check_columns(sink: KafkaSinkConfig, columns: Mapping[str, str], source_file: str) -> None:
    """Columns the sink reads exist in the stage (a transform decides them at run time)."""
    wanted: list[tuple[str, str]] = [("sink.value_columns", c) for c in sink.value_columns]
    if sink.key_column is not None:
        wanted.append(("sink.key_column", sink.key_column))
    if sink.value_format == "raw":
        wanted.append(("sink.value_column", sink.value_column))
    elif not sink.value_columns and not payload_columns(list(columns)):
        raise ConfigError(source_file, "sink.value_columns",
                          f"the staged rows have no payload columns for a JSON value (only "
                          f"{sorted(columns)}); list value_columns or use value_format: raw")
    for fld, col in wanted:
        if col not in columns:
            raise ConfigError(source_file, fld, f"{col!r} is not a column of the staged rows "
                                                f"({sorted(columns)})")
    key_col, key_field = key_source(sink, columns)
    if key_col is not None and columns[key_col] in _NESTED_TYPES:
        raise ConfigError(source_file, key_field,
                          f"the record key column {key_col!r} is {columns[key_col]} (a nested "
                          f"value); a key must be bytes, text or a scalar: pick or build "
                          f"such a column")


# Spark's arrays, structs and maps are staged as jsonb: no one obvious key encoding
_NESTED_TYPES = frozenset({"json", "jsonb"})


def key_source(sink: KafkaSinkConfig, columns: Mapping[str, str]
               ) -> tuple[str | None, str]:
    """The column the record key comes from and the setting that chose it: `key_column`,
    else the stage's `key` (the source key, or what a transform put there), else none."""
    if sink.key_column is not None:
        return sink.key_column, "sink.key_column"
    return ("key" if "key" in columns else None), "transform"


def _as_bytes(col: str, pg_type: str) -> sql.Composable:
    """A column as record bytes: bytea as is, text as UTF-8, else its JSON scalar text
    (a number its decimal text, a boolean true/false, a timestamp ISO text)."""
    ident = sql.SQL("s.{}").format(sql.Identifier(col))
    if pg_type == "bytea":
        return ident
    if pg_type == "text":
        return sql.SQL("convert_to({}, 'UTF8')").format(ident)
    return sql.SQL("convert_to(to_json({}) #>> '{{}}', 'UTF8')").format(ident)


def _json_row(cols: Sequence[str]) -> sql.Composable:
    """The value's columns as one row whose JSON is the value: `row_to_json` of a LATERAL
    row (about twice as fast as json_build_object, which looks up every argument's type on
    every row, and with no 100-argument limit); compact JSON, names as the columns'."""
    return sql.SQL(", LATERAL (SELECT {}) offsetflow_v").format(sql.SQL(", ").join(
        sql.SQL("s.{c} AS {c}").format(c=sql.Identifier(c)) for c in cols))


def select_sql(sink: KafkaSinkConfig, columns: Mapping[str, str],
               stage: sql.Composable) -> sql.Composed:
    """topic, partition, offset, key bytes, value (bytes; a JSON value: text), headers (jsonb
    or NULL), timestamp (epoch ms or NULL) of every staged row, in source order. A tombstone
    (the source `value` is NULL) stays one: a NULL value, whatever the value format."""
    key_col, _ = key_source(sink, columns)
    # a transform's `key` may be any type: encoded like key_column (never bytes(int))
    key = (_as_bytes(key_col, columns[key_col]) if key_col is not None
           else sql.SQL("NULL::bytea"))
    row: sql.Composable = sql.SQL("")
    if sink.value_format == "raw":
        value = _as_bytes(sink.value_column, columns[sink.value_column])
    else:
        # text: psycopg2 reads it as str (no hex bytea on the wire), librdkafka writes UTF-8
        value = sql.SQL("row_to_json(offsetflow_v.*)::text")
        row = _json_row(list(sink.value_columns) or payload_columns(list(columns)))
        if "value" in columns:
            value = sql.SQL("CASE WHEN s.value IS NULL THEN NULL ELSE {} END").format(value)
    headers = (sql.SQL("s.headers") if sink.headers == "carry" and "headers" in columns
               else sql.SQL("NULL::jsonb"))
    ts = (sql.SQL("(extract(epoch FROM s.\"timestamp\") * 1000)::bigint")
          if columns.get("timestamp", "").startswith("timestamp") else sql.SQL("NULL::bigint"))
    return sql.SQL("SELECT s.topic, s.partition, s.\"offset\", {key}, {value}, {headers}, {ts} "
                   "FROM {stage} s{row} ORDER BY s.topic, s.partition, s.\"offset\"").format(
                       key=key, value=value, headers=headers, ts=ts, stage=stage, row=row)


_SCALAR_BYTES = 64  # a generous size of any fixed-width (or short numeric) column


def row_bytes_sql(columns: Mapping[str, str], stage: sql.Composable) -> sql.Composed:
    """The largest staged row in bytes: its text, bytea and json columns (no value is
    detoasted: octet_length reads the stored length; jsonb its stored size) plus a fixed
    allowance per other column. What the driver holds per row fetched is a few times that
    (bytea arrives as hex, then bytes): `rows_per_fetch` sizes its fetches by it."""
    var = [(c, t) for c, t in columns.items() if t in ("text", "bytea", "json", "jsonb")]
    parts = [sql.SQL("coalesce({}(s.{}), 0)").format(
        sql.SQL("octet_length" if t in ("text", "bytea") else "pg_column_size"),
        sql.Identifier(c)) for c, t in var]
    fixed = sql.Literal(_SCALAR_BYTES * (len(columns) - len(var)))
    return sql.SQL("SELECT coalesce(max({}), 0) + {} FROM {} s").format(
        sql.SQL(" + ").join(parts) if parts else sql.SQL("0"), fixed, stage)


def rows_per_fetch(max_row_bytes: int, budget_bytes: int, max_rows: int) -> int:
    """Rows per fetch of the stage so that one fetch stays within `budget_bytes` of driver
    memory: a row costs about three times its staged bytes (hex text in the result, the
    bytes object, the record handed to librdkafka)."""
    return max(1, min(max_rows, budget_bytes // (3 * max_row_bytes + 256)))


def record_headers(batch_id: int, topic: str, partition: int, offset: int,
                   carried: list[dict[str, Any]] | None
                   ) -> list[tuple[str, bytes | str | None]]:
    """The source record's headers (staged as JSON, binary values base64) and the two
    offsetflow headers that name the batch and the source record."""
    out: list[tuple[str, bytes | str | None]] = []
    for h in carried or ():
        v = h.get("value")
        out.append((str(h.get("key")), None if v is None else base64.b64decode(v)))
    out.append((BATCH_HEADER, str(batch_id).encode()))
    out.append((SOURCE_HEADER, f"{topic}/{partition}/{offset}".encode()))
    return out
