"""Which Kafka errors planning retries, and how long it waits: pure policy, no I/O.

Right after a broker restart (or a leader change) metadata calls fail for a few seconds with
errors that say "ask again": a leader epoch the broker does not know yet, a partition whose
leader is still being elected, a coordinator still loading, a request that timed out. These
are retried with bounded exponential backoff (`kafka_meta` sleeps and logs each retry); any
other error, or the last attempt's, fails the run with the topic/partition it concerns.
"""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError

# "ask again later" codes of the metadata calls planning makes (list_topics, list_offsets,
# describe_topics); not UNKNOWN_TOPIC_OR_PART: that one is how a deleted topic answers
RETRIABLE_CODES = frozenset({
    KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.OFFSET_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.NOT_CONTROLLER,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
})


def is_retriable(code: int) -> bool:
    return code in RETRIABLE_CODES


@dataclass(frozen=True)
class RetryPolicy:
    """`attempts` calls in all; the waits between them double from `base_s` up to `cap_s`
    (0.25, 0.5, 1, 2, 4, 4, 4 s by default: ~16 s of waiting, enough for a broker restart).
    No retry starts after `max_elapsed_s`: planning holds the pipeline's lock meanwhile, and
    each call may itself wait for its request timeout."""

    attempts: int = 8
    base_s: float = 0.25
    cap_s: float = 4.0
    max_elapsed_s: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.cap_s < self.base_s \
                or self.max_elapsed_s < 0:
            raise ValueError(f"invalid retry policy {self}")

    def may_retry(self, attempt: int, elapsed_s: float) -> bool:
        """After failed attempt `attempt` (0-based) and `elapsed_s` since the first call."""
        delays = self.delays()
        return attempt < len(delays) and elapsed_s + delays[attempt] <= self.max_elapsed_s

    def delays(self) -> tuple[float, ...]:
        """The wait before each retry (one fewer than the attempts)."""
        return tuple(min(self.cap_s, self.base_s * 2 ** i) for i in range(self.attempts - 1))
