"""Per-partition lag and recent batches: the operator's view (CLI, plugin page, JSON)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from offsetflow.config import PipelineConfig
from offsetflow.errors import KafkaAuthError, KafkaUnavailableError
from offsetflow.ledger import Ledger
from offsetflow.ranges import PartitionOffsets, TopicPartition


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    committed: int | None
    earliest: int | None
    latest: int | None
    lag: int | None  # offsets between the committed position and the latest offset
    retention_headroom: int | None  # offsets the position is ahead of the earliest one
    lag_seconds: float | None = None  # age of the oldest record not yet committed
    retention_seconds: float | None = None  # topic retention.ms / 1000 (None: unlimited)
    headroom_seconds: float | None = None  # time before the oldest unread record ages out
    warning: str | None = None


def lag_rows(committed: Mapping[TopicPartition, int],
             offsets: Mapping[TopicPartition, PartitionOffsets]) -> list[PartitionLag]:
    """Pure: join ledger positions with Kafka offsets; a partition absent on one side shows
    None there (new partition not read yet, or a partition gone from Kafka)."""
    rows = []
    for tp in sorted(set(committed) | set(offsets)):
        c = committed.get(tp)
        o = offsets.get(tp)
        start = c if c is not None else (o.earliest if o else None)
        rows.append(PartitionLag(
            tp[0], tp[1], c, o.earliest if o else None, o.latest if o else None,
            (o.latest - start) if o is not None and start is not None else None,
            (c - o.earliest) if o is not None and c is not None else None))
    return rows


def with_times(rows: list[PartitionLag], oldest_unread_ms: Mapping[TopicPartition, int],
               retention_ms: Mapping[str, int | None], now_ms: int,
               warn_fraction: float = 0.25) -> list[PartitionLag]:
    """Pure: add lag in time and retention headroom, and warn before unread data ages out."""
    out = []
    for r in rows:
        tp = (r.topic, r.partition)
        ts = oldest_unread_ms.get(tp)
        lag_s = max(0.0, (now_ms - ts) / 1000) if ts is not None and (r.lag or 0) > 0 else 0.0
        ret = retention_ms.get(r.topic)
        ret_s = ret / 1000 if ret is not None and ret >= 0 else None
        head = (ret_s - lag_s) if ret_s is not None else None
        warning = None
        if r.committed is not None and r.earliest is not None and r.committed < r.earliest:
            warning = f"data loss: offsets [{r.committed}, {r.earliest}) are gone"
        elif head is not None and ret_s and head < warn_fraction * ret_s:
            warning = (f"unread data ages out in {head:.0f}s "
                       f"({100 * head / ret_s:.0f}% of retention left)")
        out.append(replace(r, lag_seconds=round(lag_s, 3), retention_seconds=ret_s,
                           headroom_seconds=None if head is None else round(head, 3),
                           warning=warning))
    return out


@dataclass(frozen=True)
class Unread:
    """What a pipeline has not committed yet, for the lag metrics."""

    lag: int  # offsets
    oldest_age_s: float | None  # seconds since its oldest record was written (0: none)


def unread_now(cfg: PipelineConfig, dsn: str, now_ms: int | None = None,
               timeout_s: float = 3.0) -> Unread:
    """The pipeline's lag from its committed positions and Kafka's last stable offsets, and
    the age of the oldest record not yet committed (None when Kafka gave no timestamp).
    Measured from the ledger, so it keeps moving while batches fail. For metrics: one try
    of each Kafka call, `timeout_s` each (a failed plan or run measures it, often because
    Kafka is down: the planner's retry budget would hold that task a minute or more)."""
    from offsetflow.plan import pending_offsets
    from offsetflow.source import KafkaMetadata, RetryPolicy

    with Ledger(dsn) as ledger:
        committed = ledger.positions(cfg.name)
    k = KafkaMetadata(cfg.admin_settings(), cfg.isolation_level, timeout_s=timeout_s,
                      retry=RetryPolicy(attempts=1), origin=cfg.kafka_origin)
    offsets = k.partition_offsets(k.partitions(k.topics(cfg.topics, cfg.topic_pattern)))
    pending = pending_offsets(committed, offsets, cfg.starting.kind)
    if not pending:
        return Unread(0, 0.0)
    heads = {tp: offsets[tp].latest - n for tp, n in pending.items()}
    stamps = k.record_timestamps(heads, cfg.consumer_settings(), timeout_s=timeout_s)
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    age = (now - min(stamps.values())) / 1000 if stamps else None
    return Unread(sum(pending.values()), None if age is None else max(0.0, age))


def pipeline_status(cfg: PipelineConfig, dsn: str, recent: int = 10) -> dict[str, Any]:
    from offsetflow.ops.runner import kafka_for

    with Ledger(dsn) as ledger:
        committed = ledger.positions(cfg.name)
        batches = ledger.recent_batches(cfg.name, recent)
        history = ledger.lag_history(cfg.name)
    kafka_error = None
    offsets: dict[TopicPartition, PartitionOffsets] = {}
    rows: list[PartitionLag] = []
    try:
        k = kafka_for(cfg)
        topics = k.topics(cfg.topics, cfg.topic_pattern)
        offsets = k.partition_offsets(k.partitions(topics))
        rows = lag_rows(committed, offsets)
        unread = {(r.topic, r.partition): r.committed if r.committed is not None
                  else (r.earliest or 0) for r in rows if (r.lag or 0) > 0}
        rows = with_times(rows, k.record_timestamps(unread, cfg.consumer_settings()),
                          k.retention_ms(topics), int(time.time() * 1000))
    except (KafkaUnavailableError, KafkaAuthError) as e:
        kafka_error = str(e)
        rows = lag_rows(committed, offsets)
    shown = [b.to_dict() for b in batches]
    registry_error = with_schema_versions(cfg, shown)
    return {
        "pipeline": cfg.name,
        "kafka_error": kafka_error,
        "partitions": [asdict(r) for r in rows],
        "total_lag": sum(r.lag or 0 for r in rows),
        "max_lag_seconds": max((r.lag_seconds or 0 for r in rows), default=0),
        "warnings": [f"{r.topic}[{r.partition}]: {r.warning}" for r in rows if r.warning],
        "batches": shown,
        "schema_registry_error": registry_error,
        "lag_history": history,
    }


# (registry URL, schema id, subject) -> the id's version in the subject (None: not in it).
# A registry's ids are immutable and so is the version an id got in a subject: each is
# asked once per process (the plugin's web server, a CLI call)
_VERSIONS: dict[tuple[str, int, str], int | None] = {}
# the registry's whole wait per pipeline's status (one try per id; the ids not answered
# within it show `version unknown` and are asked on the next load)
STATUS_REGISTRY_TIMEOUT_S = 2.0
# a registry that did not answer is not asked again for this long (by any pipeline's
# status in this process): a page of many pipelines on one registry waits for it once
REGISTRY_QUIET_S = 30.0
_DOWN: dict[str, tuple[float, str]] = {}  # registry URL -> (asked again after, its error)


def with_schema_versions(cfg: PipelineConfig, batches: list[dict[str, Any]]) -> str | None:
    """Add to each batch dict that recorded schema ids (`schemas`) its `schema_versions`:
    topic -> schema id -> {"subject", "version"} (version None: unknown, or the id is not
    in the subject), looked up in the pipeline's registry and cached. Why at display time:
    the ledger keeps ids (what the records carry), the registry owns versions, and the
    commit does not wait on the registry for a label. A registry that does not answer
    (one try, a short timeout: the page must not hang on it) leaves the versions unknown:
    returns its error, the ids are still shown."""
    if cfg.registry is None or not any(b.get("schemas") for b in batches):
        return None
    from offsetflow.errors import SchemaRegistryError
    from offsetflow.source import RegistryClient

    reg = cfg.registry
    client = RegistryClient(reg.url, reg.username, reg.password,
                            timeout_s=STATUS_REGISTRY_TIMEOUT_S, backoff=())
    now = time.monotonic()
    deadline = now + STATUS_REGISTRY_TIMEOUT_S
    down = _DOWN.get(client.url)
    error: str | None = down[1] if down is not None and down[0] > now else None
    for b in batches:
        schemas = b.get("schemas") or {}
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for topic, ids in _schema_ids(schemas).items():
            subject = f"{topic}-value"
            for sid in ids:
                key = (client.url, sid, subject)
                if key not in _VERSIONS and error is None:
                    left = deadline - time.monotonic()
                    late = (f"schema registry {client.shown}: not every version answered "
                            f"in time ({STATUS_REGISTRY_TIMEOUT_S:g} s); the rest are asked "
                            f"on the next load")
                    client.timeout_s = left
                    try:
                        if left <= 0:
                            error = late
                        else:
                            _VERSIONS[key] = client.version_in(sid, subject)
                    except SchemaRegistryError as e:
                        if left < STATUS_REGISTRY_TIMEOUT_S / 2 and "timed out" in e.reason:
                            error = late  # slow, not down: the budget's rest ran out
                        else:  # the page's words, not a batch's way out
                            error = f"schema registry {e.url}: {e.what}: {e.reason}"
                            _DOWN[client.url] = (time.monotonic() + REGISTRY_QUIET_S, error)
                out.setdefault(topic, {})[str(sid)] = {
                    "subject": subject, "version": _VERSIONS.get(key),
                    "known": key in _VERSIONS}
        b["schema_versions"] = out
    return error


def _schema_ids(schemas: Mapping[str, Any]) -> dict[str, list[int]]:
    readers = schemas.get("readers") or {}
    writers = schemas.get("writers") or {}
    out: dict[str, list[int]] = {}
    for topic in sorted(set(readers) | set(writers)):
        ids = {int(k) for k in writers.get(topic) or {}}
        if readers.get(topic) is not None:
            ids.add(int(readers[topic]))
        out[topic] = sorted(ids)
    return out


def format_status(st: Mapping[str, Any]) -> str:
    lines = [f"pipeline {st['pipeline']}  total lag {st['total_lag']}  "
             f"oldest unread {st.get('max_lag_seconds', 0):.0f}s"]
    lines += [f"  WARNING {w}" for w in st.get("warnings", [])]
    if st.get("kafka_error"):
        lines.append(f"  kafka: {st['kafka_error']}")
    lines.append(f"  {'topic':<24}{'part':>5}{'committed':>12}{'latest':>12}{'lag':>10}")
    for p in st["partitions"]:
        lines.append(f"  {p['topic']:<24}{p['partition']:>5}{_n(p['committed']):>12}"
                     f"{_n(p['latest']):>12}{_n(p['lag']):>10}")
    lines.append("  recent batches:")
    for b in st["batches"]:
        span = sum(r["until_offset"] - r["from_offset"] for r in b["ranges"])
        lines.append(f"    #{b['batch_id']:<6}{b['kind']:<10}{b['status']:<10}"
                     f"offsets {span:<9}rows {_n(b['rows_written']):<9}"
                     f"{(b['error'] or '')[:80]}")
        if b.get("schemas"):
            summary = schema_summary(b["schemas"], b.get("schema_versions"))
            lines.append(f"{'':<11}schemas {summary}")
    if st.get("schema_registry_error"):
        lines.append(f"  schema versions unknown: {st['schema_registry_error']}")
    return "\n".join(lines)


def schema_summary(schemas: Mapping[str, Any],
                   versions: Mapping[str, Any] | None = None) -> str:
    """A batch's schema ids in one line: `topic: read as 5, written 3 (from [0]@0), 5
    (from [1]@12)` per topic (reader id; each writer id with its first record); with
    `versions` (`with_schema_versions`) each id also names its subject and version:
    `5 (orders-value v2)`, `3 (orders-value v1, from [0]@0)`, or `version unknown` when
    the registry did not answer."""
    readers = schemas.get("readers") or {}
    writers = schemas.get("writers") or {}
    parts = []
    for topic in sorted(set(readers) | set(writers)):
        known = (versions or {}).get(topic) or {}
        w = ", ".join(_labelled(sid, known, f"from [{at[0]}]@{at[1]}") for sid, at in sorted(
            (writers.get(topic) or {}).items(), key=lambda kv: int(kv[0])))
        r = readers.get(topic)
        parts.append(f"{topic}: read as {_labelled(r, known) if r is not None else 'writer'}, "
                     f"written {w or '-'}")
    return "; ".join(parts)


def _labelled(sid: Any, known: Mapping[str, Any], where: str | None = None) -> str:
    v = known.get(str(sid))
    label = None
    if v is not None:
        label = (f"{v['subject']} v{v['version']}" if v["version"] is not None
                 else f"not in {v['subject']}" if v.get("known")
                 else "version unknown: registry not answering")
    inside = ", ".join(x for x in (label, where) if x)
    return f"{sid} ({inside})" if inside else str(sid)


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)
