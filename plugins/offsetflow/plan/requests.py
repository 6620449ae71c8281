"""Backfill and replay requests (UI form, DAG run conf, CLI): parsed and checked as pure code.

A request names a pipeline and a window per partition, as offsets or as timestamps. Bad
input is refused here, before any work starts, with a message the user sees in the UI.
Resolving timestamps against the broker and checking the ledger happen in `backfill`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from offsetflow.config import IDENT_RE, TOPIC_RE, validate_table_name
from offsetflow.errors import ConfigError, RequestError
from offsetflow.ranges import OffsetRange, PartitionOffsets, TopicPartition


@dataclass(frozen=True)
class WindowRequest:
    """What the user asked for; `kind` is backfill or replay."""

    kind: str
    pipeline: str
    topic: str | None = None
    partitions: tuple[int, ...] | None = None  # None: every partition of the topic(s)
    from_offsets: Mapping[int, int] = field(default_factory=dict)
    until_offsets: Mapping[int, int] = field(default_factory=dict)
    from_timestamp_ms: int | None = None
    until_timestamp_ms: int | None = None
    records_per_batch: int = 100_000
    target_table: str | None = None  # backfill only: a side table instead of the sink
    dry_run: bool = False
    # write the window again where an earlier window put it and it cannot be replaced
    # (a Kafka sink's replay_topic): the user accepts the copies
    allow_duplicates: bool = False
    # write the window into a shadow beside the live target, to be diffed and then
    # published or discarded (`offsetflow.ops.audit`); the live target is untouched
    audit: bool = False

    @property
    def by_time(self) -> bool:
        return self.from_timestamp_ms is not None


def _int(v: Any, name: str, minimum: int = 0) -> int:
    if isinstance(v, bool):
        raise RequestError(f"{name} must be an integer, got {v!r}")
    try:
        i = int(str(v).strip())
    except (TypeError, ValueError) as e:
        raise RequestError(f"{name} must be an integer, got {v!r}") from e
    if i < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {i}")
    return i


def _timestamp(v: Any, name: str) -> int | None:
    if v in (None, ""):
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return int(v)
    s = str(v).strip()
    if s.isdigit():
        return int(s)
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError as e:
        raise RequestError(f"{name}: {s!r} is not an ISO-8601 time or epoch milliseconds") from e
    if dt.tzinfo is None:
        raise RequestError(f"{name}: {s!r} needs a time zone, e.g. 2026-01-01T00:00:00Z")
    return int(dt.timestamp() * 1000)


def _offsets(v: Any, name: str) -> dict[int, int]:
    """Offsets per partition: {"0": 10, "1": 20}, or one number for every partition (-1)."""
    if v in (None, "", {}):
        return {}
    if isinstance(v, Mapping):
        return {_int(p, f"{name} partition"): _int(o, f"{name}[{p}]") for p, o in v.items()}
    return {-1: _int(v, name)}


def parse_request(kind: str, conf: Mapping[str, Any]) -> WindowRequest:
    """Parse a form/conf: pipeline, topic, partitions, from/until (offsets or timestamps)."""
    if kind not in ("backfill", "replay"):
        raise RequestError(f"unknown request kind {kind!r}")
    pipeline = str(conf.get("pipeline") or "").strip()
    if not pipeline:
        raise RequestError("pipeline is required")
    topic = conf.get("topic") or None
    if topic is not None and not TOPIC_RE.match(str(topic)):
        raise RequestError(f"topic {topic!r} is not a valid Kafka topic name")
    parts_raw = conf.get("partitions")
    partitions: tuple[int, ...] | None = None
    if parts_raw not in (None, "", []):
        if isinstance(parts_raw, str):
            parts_raw = [p for p in parts_raw.replace(" ", "").split(",") if p]
        if not isinstance(parts_raw, (list, tuple)):
            parts_raw = [parts_raw]
        partitions = tuple(sorted({_int(p, "partitions") for p in parts_raw}))
    frm = _offsets(conf.get("from_offsets", conf.get("from_offset")), "from_offset")
    until = _offsets(conf.get("until_offsets", conf.get("until_offset")), "until_offset")
    from_ts = _timestamp(conf.get("from_timestamp"), "from_timestamp")
    until_ts = _timestamp(conf.get("until_timestamp"), "until_timestamp")
    if (frm or until) and (from_ts is not None or until_ts is not None):
        raise RequestError("give the window as offsets or as timestamps, not both")
    if from_ts is not None or until_ts is not None:
        if from_ts is None or until_ts is None:
            raise RequestError("a time window needs both from_timestamp and until_timestamp")
        if until_ts <= from_ts:
            raise RequestError(f"until_timestamp ({until_ts}) must be after from_timestamp "
                               f"({from_ts})")
    elif not frm or not until:
        raise RequestError("give from_offset and until_offset (or from/until timestamps)")
    for p, u in until.items():
        f = frm.get(p, frm.get(-1))
        if f is not None and u < f:
            where = "" if p == -1 else f" for partition {p}"
            raise RequestError(f"until_offset {u} < from_offset {f}{where}")
    target = conf.get("target_table") or None
    if target is not None:
        if kind == "replay":
            raise RequestError("a replay always writes the pipeline's own sink")
        try:
            validate_table_name("request", "target_table", str(target))
        except ConfigError as e:
            raise RequestError(str(e)) from e
    rpb = _int(conf.get("records_per_batch") or 100_000, "records_per_batch", 1)
    return WindowRequest(kind=kind, pipeline=pipeline, topic=str(topic) if topic else None,
                         partitions=partitions, from_offsets=frm, until_offsets=until,
                         from_timestamp_ms=from_ts, until_timestamp_ms=until_ts,
                         records_per_batch=rpb, target_table=str(target) if target else None,
                         dry_run=bool(conf.get("dry_run", False)),
                         allow_duplicates=_flag(conf.get("allow_duplicates"),
                                                "allow_duplicates"),
                         audit=_flag(conf.get("audit"), "audit"))


def _flag(v: Any, name: str) -> bool:
    if v in (None, "", False, True):
        return bool(v)
    s = str(v).strip().lower()
    if s in ("true", "1", "yes"):
        return True
    if s in ("false", "0", "no"):
        return False
    raise RequestError(f"{name} must be true or false, got {v!r}")


def resolve_window(req: WindowRequest, tps: list[TopicPartition],
                   by_time: tuple[Mapping[TopicPartition, int], Mapping[TopicPartition, int]]
                   | None = None) -> dict[TopicPartition, tuple[int, int]]:
    """The request's window per partition (`tps`: the partitions that exist)."""
    existing = {tp[1] for tp in tps}
    if req.partitions is not None:
        unknown = sorted(set(req.partitions) - existing)
        if unknown:
            topic = tps[0][0] if tps else req.topic
            raise RequestError(f"partition(s) {unknown} do not exist in topic {topic} "
                               f"(it has {len(existing)} partitions)")
        tps = [tp for tp in tps if tp[1] in req.partitions]
    for p in set(req.from_offsets) | set(req.until_offsets):
        if p != -1 and p not in existing:
            raise RequestError(f"partition {p} does not exist in topic "
                               f"{tps[0][0] if tps else req.topic}")
    window: dict[TopicPartition, tuple[int, int]] = {}
    for tp in tps:
        if by_time is not None:
            lo, hi = by_time[0][tp], by_time[1][tp]
        else:
            lo_o = req.from_offsets.get(tp[1], req.from_offsets.get(-1))
            hi_o = req.until_offsets.get(tp[1], req.until_offsets.get(-1))
            if lo_o is None or hi_o is None:
                continue
            lo, hi = lo_o, hi_o
        window[tp] = (lo, hi)
    window = {tp: w for tp, w in window.items() if w[1] > w[0]}
    if not window:
        raise RequestError("the window holds no offsets")
    return window


def check_replay_window(window: Mapping[TopicPartition, tuple[int, int]],
                        committed: Mapping[TopicPartition, int]) -> None:
    """A replay may only cover offsets the pipeline has already committed."""
    for tp, (lo, hi) in sorted(window.items()):
        pos = committed.get(tp)
        if pos is None or hi > pos:
            raise RequestError(
                f"cannot replay {tp[0]}[{tp[1]}] [{lo}, {hi}): offsets from "
                f"{pos if pos is not None else lo} on were never committed by this pipeline "
                f"(committed position: {pos}); use a backfill or wait for the scheduled run")


def check_backfill_window(window: Mapping[TopicPartition, tuple[int, int]],
                          committed: Mapping[TopicPartition, int], table: str) -> None:
    """A backfill into the pipeline's own table may only cover offsets the live pipeline
    has committed: a row beyond the live position would be written again by the next live
    batch, which the table's coordinates index refuses (every live batch would fail)."""
    for tp, (lo, hi) in sorted(window.items()):
        pos = committed.get(tp)
        if pos is None or hi > pos:
            live = "none yet" if pos is None else str(pos)
            raise RequestError(
                f"cannot backfill {tp[0]}[{tp[1]}] [{lo}, {hi}) into the pipeline's own "
                f"table {table}: the live pipeline has not committed offsets from "
                f"{pos if pos is not None else lo} on (live position {live}) and will write "
                f"them itself. Backfill into another table (target_table), end the window "
                f"at the live position, or wait until the live position reaches {hi}; to "
                f"re-process committed offsets use a replay")


def gone_from_kafka(window: Mapping[TopicPartition, tuple[int, int]],
                    offsets: Mapping[TopicPartition, PartitionOffsets]
                    ) -> list[tuple[TopicPartition, int, int]]:
    """Parts of the window that Kafka no longer (or not yet) holds."""
    out = []
    for tp, (lo, hi) in sorted(window.items()):
        o = offsets[tp]
        if lo < o.earliest:
            out.append((tp, lo, min(hi, o.earliest)))
        if hi > o.latest:
            out.append((tp, max(lo, o.latest), hi))
    return out


def window_ranges(window: Mapping[TopicPartition, tuple[int, int]]) -> list[OffsetRange]:
    return [OffsetRange(tp[0], tp[1], lo, hi) for tp, (lo, hi) in sorted(window.items())]


def is_valid_identifier(name: str) -> bool:
    return bool(IDENT_RE.match(name))
