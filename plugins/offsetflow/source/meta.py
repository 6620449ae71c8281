"""Kafka metadata adapter: partitions and earliest/latest offsets in batched admin calls.

Thin edge over confluent-kafka's AdminClient; planning itself is pure (`planner`).
Under read_committed, "latest" is the last stable offset, so a batch never names an
offset of a transaction that is still open. Errors that mean "ask again" (a broker that
just restarted, a leader being elected) are retried with backoff (`kafka_retry`), a
warning per retry; the last one fails naming the topic/partition.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from confluent_kafka import IsolationLevel, KafkaError, KafkaException, TopicCollection
from confluent_kafka import TopicPartition as KTopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from offsetflow.errors import KafkaAuthError, KafkaUnavailableError
from offsetflow.ranges import PartitionOffsets, TopicPartition
from offsetflow.source.retry import RetryPolicy, is_retriable

log = logging.getLogger(__name__)
ZERO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"  # Uuid(0, 0): "no topic id"
# what librdkafka reports (through error_cb) when the brokers refuse the credentials; the
# call itself only times out on "Broker transport failure", which is worth retrying
AUTH_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED})
T = TypeVar("T")


class _CallFailed(Exception):
    """A Kafka error and what it concerns (a topic, a partition, or the whole call)."""

    def __init__(self, where: str, error: Any) -> None:
        super().__init__(where, error)
        self.where = where
        self.error = error

    @property
    def code(self) -> int | None:
        return self.error.code() if isinstance(self.error, KafkaError) else None


def _failed(where: str, e: KafkaException) -> _CallFailed:
    return _CallFailed(where, e.args[0] if e.args else e)


class KafkaMetadata:
    """`origin`: where the client settings come from (e.g. "Airflow connection 'x'"), named
    when the brokers refuse them."""

    def __init__(self, admin_conf: Mapping[str, Any], isolation_level: str = "read_committed",
                 timeout_s: float = 15.0, retry: RetryPolicy | None = None,
                 origin: str = "") -> None:
        self._retry = retry or RetryPolicy()
        self._conf = dict(admin_conf)
        self._origin = origin
        self._auth_error: KafkaError | None = None
        user_cb = self._conf.get("error_cb")

        def on_error(err: KafkaError) -> None:
            if err.code() in AUTH_CODES:
                self._auth_error = err
            if callable(user_cb):  # a callback of the connection's (the provider's way)
                user_cb(err)
        self._conf["error_cb"] = on_error
        self._isolation = (IsolationLevel.READ_COMMITTED if isolation_level == "read_committed"
                           else IsolationLevel.READ_UNCOMMITTED)
        self._timeout = timeout_s
        self._admin: AdminClient | None = None
        self._budget_t0: float | None = None  # set by retry_budget()

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(dict(self._conf))  # type: ignore[arg-type]
        return self._admin

    @contextlib.contextmanager
    def retry_budget(self) -> Iterator[None]:
        """Calls made inside share one `max_elapsed_s` for their retries (from the first
        call on): planning makes several under the pipeline's lock, and per-call budgets
        would add up to minutes. Nested uses keep the outer budget."""
        if self._budget_t0 is not None:
            yield
            return
        self._budget_t0 = time.monotonic()
        try:
            yield
        finally:
            self._budget_t0 = None

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """`call` until it succeeds, a non-retriable error, or the policy's last attempt
        (or the time budget: the call's own, or the one of `retry_budget`)."""
        delays = self._retry.delays()
        t0 = self._budget_t0 if self._budget_t0 is not None else time.monotonic()
        for attempt in range(len(delays) + 1):
            try:
                return call()
            except KafkaException as e:
                failed = _failed("", e)
            except _CallFailed as e:
                failed = e
            self._check_auth(what)
            where = f" of {failed.where}" if failed.where else ""
            code = failed.code
            if code is None or not is_retriable(code) or \
                    not self._retry.may_retry(attempt, time.monotonic() - t0):
                tries = f" after {attempt + 1} attempts" if attempt else ""
                raise KafkaUnavailableError(
                    f"{what}{where} failed{tries} (Kafka at "
                    f"{self._conf.get('bootstrap.servers')}): {failed.error}") from None
            log.warning("%s%s: retriable Kafka error %s; retry %d of %d in %.2f s", what,
                        where, failed.error, attempt + 1, len(delays), delays[attempt])
            time.sleep(delays[attempt])
        raise AssertionError("unreachable")

    def _check_auth(self, what: str) -> None:
        """Raise KafkaAuthError if the brokers refused the credentials (error_cb is served
        by poll: the failed call only says the transport failed)."""
        if self._admin is not None:
            self._admin.poll(0)
        if self._auth_error is None:
            return
        origin = self._origin or "kafka.client"
        raise KafkaAuthError(
            f"{what} failed: Kafka at {self._conf.get('bootstrap.servers')} refused the "
            f"credentials of {origin}: {self._auth_error.str()}. Check the SASL settings "
            f"(sasl.mechanism, sasl.username, sasl.password, or the OAUTHBEARER callback) of "
            f"{origin}")

    def _cluster(self) -> Any:
        return self._retrying("listing topics",
                              lambda: self.admin.list_topics(timeout=self._timeout))

    def topics(self, names: Iterable[str] = (), pattern: str | None = None) -> list[str]:
        """Existing topics: the listed names (an unknown one is an error) or a pattern match."""
        import re

        md = self._cluster()
        existing = {t for t in md.topics if not t.startswith("__")}
        if pattern is not None:
            return sorted(t for t in existing if re.fullmatch(pattern, t))
        names = list(names)
        missing = [t for t in names if t not in existing]
        if missing:
            raise KafkaUnavailableError(f"topic(s) {missing} do not exist in Kafka at "
                                        f"{self._conf.get('bootstrap.servers')}")
        return names

    def missing(self, topics: Iterable[str]) -> list[str]:
        """Those of `topics` that do not exist in Kafka (deleted)."""
        existing = self._cluster().topics
        return sorted(t for t in topics if t not in existing)

    def partitions(self, topics: Iterable[str]) -> list[TopicPartition]:
        names = list(topics)

        def call() -> list[TopicPartition]:
            md = self.admin.list_topics(timeout=self._timeout)
            out: list[TopicPartition] = []
            for t in names:
                tm = md.topics.get(t)
                if tm is None or tm.error is not None:
                    raise _CallFailed(f"topic {t}", tm.error if tm else "unknown topic")
                out.extend((t, p) for p in sorted(tm.partitions))
            return out
        return self._retrying("reading partition metadata", call)

    def topic_ids(self, topics: Iterable[str]) -> dict[str, str]:
        """Kafka's topic id per topic: it changes when a topic is deleted and recreated.
        A topic without one (the zero Uuid a broker without topic ids answers) is left
        out: recorded as an id, every such topic would look like the same one."""
        names = list(topics)
        if not names:
            return {}
        def call() -> dict[str, str]:
            futures = self.admin.describe_topics(TopicCollection(names),
                                                 request_timeout=self._timeout)
            out = {}
            for t, f in futures.items():
                try:
                    tid = f.result().topic_id
                except KafkaException as e:
                    raise _failed(f"topic {t}", e) from e
                if tid is not None and str(tid) != ZERO_TOPIC_ID:
                    out[t] = str(tid)
            return out
        return self._retrying("describing topics", call)

    def retention_ms(self, topics: Iterable[str]) -> dict[str, int | None]:
        """Topic retention.ms (None: unlimited)."""
        from confluent_kafka.admin import ConfigResource, ResourceType

        res = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
        if not res:
            return {}
        try:
            futures = self.admin.describe_configs(res, request_timeout=self._timeout)
            out: dict[str, int | None] = {}
            for r, f in futures.items():
                entry = f.result().get("retention.ms")
                v = int(entry.value) if entry is not None and entry.value is not None else -1
                out[r.name] = None if v < 0 else v
            return out
        except KafkaException as e:
            raise KafkaUnavailableError(f"describing topic configs failed: {e}") from e

    def record_timestamps(self, at: Mapping[TopicPartition, int],
                          consumer_conf: Mapping[str, str], timeout_s: float = 5.0
                          ) -> dict[TopicPartition, int]:
        """Timestamp (ms) of the first record at or after each given offset."""
        import time

        from confluent_kafka import Consumer

        if not at:
            return {}
        conf = dict(consumer_conf)
        conf["enable.partition.eof"] = "true"
        c = Consumer(conf)
        out: dict[TopicPartition, int] = {}
        try:
            c.assign([KTopicPartition(t, p, o) for (t, p), o in at.items()])
            pending = set(at)
            deadline = time.monotonic() + timeout_s
            while pending and time.monotonic() < deadline:
                m = c.poll(0.5)
                if m is None:
                    continue
                tp = (m.topic() or "", int(m.partition() or 0))
                if tp not in pending:
                    continue
                if m.error() is None:
                    ts_type, ts = m.timestamp()
                    if ts_type:
                        out[tp] = int(ts)
                pending.discard(tp)
                c.pause([KTopicPartition(tp[0], tp[1])])
        finally:
            c.close()
        return out

    def _list_offsets(self, specs: Mapping[TopicPartition, OffsetSpec]) -> dict[TopicPartition,
                                                                               int]:
        if not specs:
            return {}
        req = {KTopicPartition(t, p): s for (t, p), s in specs.items()}

        def call() -> dict[TopicPartition, int]:
            futures = self.admin.list_offsets(req, isolation_level=self._isolation,
                                              request_timeout=self._timeout)
            out = {}
            for tp, f in futures.items():
                try:
                    out[(tp.topic, tp.partition)] = int(f.result().offset)
                except KafkaException as e:
                    raise _failed(f"{tp.topic}[{tp.partition}]", e) from e
            return out
        return self._retrying("listing offsets", call)

    def partition_offsets(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition,
                                                                       PartitionOffsets]:
        """Earliest and latest (last stable) offsets of all partitions in two batched calls."""
        tps = list(tps)
        earliest = self._list_offsets({tp: OffsetSpec.earliest() for tp in tps})
        latest = self._list_offsets({tp: OffsetSpec.latest() for tp in tps})
        return {tp: PartitionOffsets(earliest[tp], latest[tp]) for tp in tps}

    def offsets_for_time(self, tps: Iterable[TopicPartition], timestamp_ms: int
                         ) -> dict[TopicPartition, int]:
        """First offset at or after `timestamp_ms` per partition (-1: none yet)."""
        return self._list_offsets({tp: OffsetSpec.for_timestamp(timestamp_ms) for tp in tps})
