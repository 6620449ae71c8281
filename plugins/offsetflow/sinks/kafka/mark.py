"""The marks a Kafka sink's batch leaves, and what they tell (pure; `offsetflow.sinks.kafka.sink`
does the I/O; how a staged row becomes a record is `offsetflow.sinks.kafka.form`).

- Names (`CommitMark`): the `transactional.id` and the consumer group a batch's transaction
  commits its source positions to, per pipeline and ledger. Live batches share the
  pipeline's (stable across attempts, so `init_transactions` of a newer attempt fences a
  zombie of an older one); a replay or backfill batch has its own, so it neither fences the
  live run nor overwrites the live batch's record of its commit. The groups are
  `offsetflow-sink-...`, never the lag publisher's `offsetflow-<pipeline>`. Which topic a
  batch writes: `output_topic`.
- The record of a commit: each committed offset carries `CommitMark.metadata` (pipeline,
  batch id, ledger, output topic, the records the topic could not take), so `find` tells
  this batch's commit from any other (an earlier batch that ended at the same offset after
  a position reset, a replay of the same range, another ledger's batch of the same number);
  each record carries the batch and its source record in two headers.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from datetime import UTC, datetime

from offsetflow.config import KafkaSinkConfig
from offsetflow.errors import ConfigError, KafkaSinkError
from offsetflow.ledger import Batch

BATCH_HEADER = "offsetflow.batch"
SOURCE_HEADER = "offsetflow.source"  # topic/partition/offset of the source record
_NOT_PRODUCED = "not_produced="
# the broker refuses offset metadata over offset.metadata.max.bytes (4096 by default)
METADATA_MAX_BYTES = 4000


AVRO_UNFIT = ("the value did not fit the sink's Avro schema (sink.value_format: avro; the "
              "commit's metadata keeps no reason)")


@dataclass(frozen=True)
class NotProduced:
    """A staged row the output topic can never take as it is: over the record size limit
    (`size`; `limit` the limit it broke, when known), without a key for a compacted topic
    (`size` None), or with a timestamp outside what the topic accepts (`timestamp`, epoch
    ms: `message.timestamp.before.max.ms` / `after.max.ms` of a CreateTime topic). It goes
    to the dead-letter table and into the commit's offset metadata, never into the
    topic."""

    topic: str
    partition: int
    offset: int
    size: int | None
    timestamp: int | None = None
    limit: int | None = field(default=None, compare=False)
    # sink.value_format: avro: why the value does not fit the Avro schema (`size` None)
    reason: str | None = field(default=None, compare=False)

    def error(self, out: str, limit: int | None) -> str:
        if self.reason is not None:
            return f"kafka sink: not produced to {out}: {self.reason}"
        if self.timestamp is not None:
            return timestamp_error(out, self.timestamp)
        if self.size is None:
            return (f"kafka sink: not produced to {out}: a record without a key, and {out} "
                    f"is compacted (cleanup.policy=compact), which refuses keyless records")
        limit = self.limit or limit
        over = f" over the limit of {limit} bytes" if limit else " over the record size limit"
        return (f"kafka sink: not produced to {out}: the record is {self.size} bytes,{over} "
                f"(the producer's message.max.bytes, sink.producer, and the topic's "
                f"max.message.bytes)")

    @property
    def token(self) -> str:
        """How the commit's offset metadata lists it (`not_produced_in` reads it back)."""
        if self.reason is not None:
            return f"{self.offset}:avro"
        if self.timestamp is not None:
            return f"{self.offset}:ts{self.timestamp}"
        return f"{self.offset}:{'nullkey' if self.size is None else self.size}"


def timestamp_error(out: str, ts: int) -> str:
    """Why a CreateTime topic refuses a record with timestamp `ts` (epoch ms): older than
    its message.timestamp.before.max.ms allows, or further ahead than after.max.ms."""
    when = datetime.fromtimestamp(ts / 1000, tz=UTC).isoformat(timespec="milliseconds")
    old = ts < time.time() * 1000
    setting = "message.timestamp.before.max.ms" if old else "message.timestamp.after.max.ms"
    return (f"kafka sink: not produced to {out}: the record's timestamp {when} ({ts}) is "
            f"{'older' if old else 'further ahead'} than {out} accepts ({setting}, with "
            f"message.timestamp.type=CreateTime: the sink copies the source timestamp); "
            f"raise {setting} or set message.timestamp.type=LogAppendTime on {out} to take "
            f"such records")


def is_live(batch: Batch) -> bool:
    return batch.moves_positions and batch.kind == "scheduled"


@dataclass(frozen=True)
class CommitMark:
    """Whose commit a committed offset records: the pipeline, the ledger
    (`offsetflow.ledger.identity`) and the output topic. Two ledgers running a pipeline of
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
        return f"{base} {_NOT_PRODUCED}" + ",".join(s.token for s in skipped)


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
    planned = batch.target_table.removeprefix("kafka:")
    if batch.target_table.startswith("kafka:") and planned != sink.replay_topic:
        # the refusal of a window already written there compared the topic recorded here
        raise ConfigError(
            source_file, "sink.replay_topic",
            f"{batch.kind} batch {batch.batch_id} was planned into side topic {planned}, but "
            f"the config now names {sink.replay_topic}; restore sink.replay_topic to "
            f"{planned} to run it, or abandon it and ask for the window again into "
            f"{sink.replay_topic}")
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
            f"own identity instead (see docs/sinks/kafka.md, 'Two ledgers')")


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
            if size == "avro":
                out.append(NotProduced(topic, partition, int(off), None, reason=AVRO_UNFIT))
                continue
            if size.startswith("ts"):
                out.append(NotProduced(topic, partition, int(off), None, int(size[2:])))
                continue
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
